"""`train ctr --privacy-unit user`: the training rows' users, the batches and the rows the
one-off releases read, in memory and out of core (`dprec.workflows.ctr` wires them into a run).

What ε protects: all rows with one `user_id` (the day files' trailing column). U, the number of
training users, is public as N is at the row level, δ defaults to 1/U (as 1/N for rows: a δ near
1/U would allow a mechanism that publishes one user's rows whole with probability δ·U), the
ledger is user-level, and a user's rows are bounded to k = `max_rows_per_user` (public) in one of
two ways:

- `user_sampling` "users" (user-level sampling, ULS; Charles et al., "Fine-Tuning Large Language
  Models with User-Level Differential Privacy", arXiv:2407.07737, Algorithm 2): each step
  Poisson-samples users at q = B/U (B: expected users per batch), a sampled user brings at most k
  of their rows drawn afresh by the key (`dprec.training.user_sampling`), and the DP step clips
  the user's summed gradient as one (`dprec.clipping.units`; DP-AdaFEST's contribution map per
  user): the sampled Gaussian at q over users.
- "rows" (example-level sampling with group privacy, ELS; the baseline of Chua et al., "Mind the
  Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning",
  arXiv:2406.14322): each user's rows are cut once to at most k by the key
  (`user_sampling.rows_per_user`), then training is the row-level run on those N_k rows (B rows
  per batch, q = B/N_k, N_k public as N is), and ε is the user's as a group of k rows, each
  sampled at q: the mixture of Gaussians of `dprec.privacy.accounting` (PLD; exact, tighter than
  the kε conversion), to which σ is calibrated.

The one-off releases (DP base rate, DP Platt scaling) read at most k rows of each user: ULS rows
drawn once by the key apart from the steps' draws (in memory `private_users.statistic_rows`) at
noise k·σ (a user moves them k rows' worth: the Gaussian at σ per user, `private_users`), ELS the
bounded training rows, charged as row-level releases converted for a group of k. Out of core
(`dprec.workflows.out_of_core`) the user batch job draws the same kinds of rows, by user bucket,
and writes them beside the batches (`pipelines.user_batches`); the releases stream them
(`out_of_core.Data.bounded`), so the driver never holds a row array of all rows. DP-FEST's
bucket counts (public at the user level: --top-k-epsilon 0) read every row, in memory and out of
core alike.
"""
import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf

from dprec.privacy_unit import UNIT_KEY, USER_KEY
from dprec.training import user_sampling
from dprec.workflows import out_of_core
from dprec.workflows import private_users

USER_EPSILON = ("(epsilon, delta)-DP for adding or removing one user (all training rows with "
                "their user_id), covering the model, the DP top-k rows and every field listed "
                "under 'covered'")


@dataclasses.dataclass(frozen=True)
class UserPlan:
  """What a user-level plan needs of the training rows, public as N is: N, U, k, and N_k the
  rows kept at most k a user (ELS's population); in memory also the rows grouped by user."""
  num_rows: int
  num_users: int
  bounded_rows: int
  max_rows_per_user: int
  rows: Optional[user_sampling.UserRows] = dataclasses.field(default=None, compare=False,
                                                             repr=False)

  @classmethod
  def of(cls, data, max_rows_per_user: int) -> "UserPlan":
    """The users of loaded `data` (its rows grouped by user: `UserRows.group`, refusing rows
    without an integer user id) or, out of core, of one streaming pass over the rows' user ids
    (`out_of_core.Data.user_counts`: memory two ints a user); both before anything is
    charged."""
    if isinstance(data, out_of_core.Data):
      num_rows, rows, counts = data.train_rows, None, data.user_counts()[1]
    else:
      num_rows = len(data.train["label"])
      rows = user_sampling.UserRows.group(data.train.get(USER_KEY), num_rows)
      counts = rows.counts
    return cls(num_rows, len(counts), int(np.minimum(counts, max_rows_per_user).sum()),
               max_rows_per_user, rows)


def users(options, data) -> Optional[UserPlan]:
  """The training rows' users at the user level (`UserPlan.of`); None at the row level."""
  return UserPlan.of(data, options.rows_per_user) if options.user_level else None


def sampled_units(options, users: Optional[UserPlan], num_rows: int) -> int:
  """What a batch samples: N rows; U users (ULS); N_k = Σ_u min(n_u, k) rows (ELS), fixed by
  the data and k, not by the key (public, as N)."""
  if users is None:
    return num_rows
  return users.num_users if options.user_sampling == "users" else users.bounded_rows


def in_memory_rows(options, data, users: Optional[UserPlan], run):
  """(training rows, the rows the one-off releases read) of loaded `data`: at the row level the
  training data twice; ULS all rows and at most k rows of every user
  (`private_users.statistic_rows`); ELS the rows of every user cut once to at most k
  (`user_sampling.rows_per_user`), both."""
  if users is None:
    return data.train, data.train
  k = options.rows_per_user
  if options.user_sampling == "users":
    return data.train, private_users.statistic_rows(
        data.train, None, users.rows, k, run.key.numpy_rng("user statistic rows"))[0]
  rows = user_sampling.rows_per_user(users.rows, k, run.key.numpy_rng("user rows"))
  bounded = {key: values[rows] for key, values in data.train.items()}
  return bounded, bounded


def write_batches(options, data, base, run, users: Optional[UserPlan], beam_args):
  """Out of core: (the batch directory, its checked manifest, the batch job's summary or None
  when this run's batches were there, the rows the one-off releases read as
  `out_of_core.Data`): at the row level the row-level job's batches and every row; at the user
  level the user batch job's and the rows it bounded to at most k a user (`Data.bounded`). A
  finished job's batches are reused only if they are this run's, key's and plan's (resume);
  others are refused before anything is paid."""
  if users is None:
    return (*out_of_core.write_batches(data, base, run, options.batch_size, options.steps,
                                       beam_args, options.max_batch_size), data)
  directory, manifest, job = out_of_core.write_user_batches(
      data, base, run, users, options.user_sampling, options.batch_size, options.steps,
      beam_args)
  return directory, manifest, job, data.bounded(directory, manifest)


def in_memory_batches(options, features, train, run, start) -> Optional[tf.data.Dataset]:
  """ULS's batches of steps `start`.. of the loaded training rows `train` (`features` of them)
  from the run's key; None for the row-level sampler (row level and ELS)."""
  if not (options.user_level and options.user_sampling == "users"):
    return None
  sampling = user_sampling.UserSampling(options.batch_size, options.rows_per_user,
                                        run.key.entropy("user poisson"))
  return user_level_batches(features, train["label"], train[USER_KEY], sampling, options.steps,
                            start)


def summary_fields(options, users: Optional[UserPlan]) -> dict:
  """The summary's privacy unit: the unit, the sampling, k, U and N_k (all public)."""
  return {"privacy_unit": options.privacy_unit,
          "user_sampling": options.user_sampling if options.user_level else None,
          "max_rows_per_user": options.rows_per_user, "users": users and users.num_users,
          "bounded_rows": users and users.bounded_rows}


def user_level_batches(features, labels, user_ids, sampling, steps, start) -> tf.data.Dataset:
  """Steps `start`..`steps − 1` of user-level sampling (`user_sampling.user_batches`) as a
  dataset of (features with `UNIT_KEY`, labels)."""
  specs = {key: tf.TensorSpec((None,) + value.shape[1:], tf.as_dtype(value.dtype))
           for key, value in features.items()}
  specs[UNIT_KEY] = tf.TensorSpec((None,), tf.int32)
  return tf.data.Dataset.from_generator(
      lambda: user_sampling.user_batches(features, labels, user_ids, sampling, steps, start),
      output_signature=(specs, tf.TensorSpec((None,), tf.as_dtype(labels.dtype)))).prefetch(1)
