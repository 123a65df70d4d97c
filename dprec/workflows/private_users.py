"""`dprec.make_private` at `privacy_unit="user"`: the batches `fit` trains on, the rows the one-off
releases read, and the check that the model's DP step can clip per user, made before anything is
paid.

What is protected: adding or removing one user with all of their rows (the ids `user_id`). Each
step samples users, not rows: every user joins with probability q = B/U, independently, drawn
from the run's secret key, and brings a uniform subset of at most k = `max_rows_per_user` of
their rows, drawn afresh each step by the key (`dprec.training.user_sampling.user_batches`: a
user's rows beyond k sit that step out). The batch carries each row's unit (`UNIT_KEY`), and the
DP step clips each user's summed gradient to C2 as one (`dprec.clipping.units`), so the step is
the Poisson-subsampled Gaussian at q over users, accounted as rows are at row level, on a
user-level ledger. U, the number of distinct ids, is public, as N is at row level.

The one-off releases (the output bias's DP label statistic, the recalibration) are Gaussian
mechanisms built for a per-example sensitivity Δ. They read at most k rows of each user
(`statistic_rows`, drawn once by the key), so a user moves their statistic by at most k·Δ
(triangle inequality); adding noise k·σ·Δ (`PrivateTraining` scales the planned σ by k) makes
each the Gaussian mechanism at σ per user, which is what the plan calibrates and the ledger
charges: the row-level Gaussian at k·σ converted for a group of k rows (the ledger's conversion,
`dprec.privacy.ledger`: all k rows in, sensitivity k) is exactly the Gaussian at σ.
"""
import numpy as np
import tensorflow as tf

from dprec.errors import DprecError
from dprec.privacy_unit import UNIT_KEY
from dprec.training import user_sampling
from dprec.workflows import private_inputs


def check_structure(structure):
  """Refuses model inputs that cannot carry `UNIT_KEY` beside them: a batch's features must be
  a dict (the DP step pops the key before the forward pass)."""
  if not isinstance(structure, dict):
    raise DprecError("privacy_unit='user' needs a model whose input is a dict of features: the "
                     f"batch carries each row's user as the feature {UNIT_KEY!r}, popped by the "
                     "DP step (name the inputs: keras.Input(..., name=...) in a dict)")
  if UNIT_KEY in structure:
    raise DprecError(f"the feature {UNIT_KEY!r} is reserved for the privacy unit of user-level "
                     "batches: rename that input")


def batches(features, labels, structure, user_ids, sampling, steps) -> tf.data.Dataset:
  """`steps` user-level batches of `features` {input_i: array} (and labels) in the model's
  structure, each with `UNIT_KEY` (`user_sampling.user_batches`)."""
  check_structure(structure)
  specs = {k: tf.TensorSpec((None,) + v.shape[1:], tf.as_dtype(v.dtype))
           for k, v in features.items()}
  specs[UNIT_KEY] = tf.TensorSpec((None,), tf.int32)
  signature = specs if labels is None else (
      specs, tf.TensorSpec((None,) + labels.shape[1:], tf.as_dtype(labels.dtype)))
  dataset = tf.data.Dataset.from_generator(
      lambda: user_sampling.user_batches(features, labels, user_ids, sampling, steps),
      output_signature=signature)
  pack = private_inputs.packer(structure, with_labels=False)

  def with_units(batch, *labels):
    x = dict(pack(batch), **{UNIT_KEY: batch[UNIT_KEY]})
    return (x, *labels) if labels else x

  return dataset.map(with_units)


def statistic_rows(features, labels, users, max_rows_per_user, rng):
  """(features, labels) of at most k uniformly chosen rows of every user (by `rng`, drawn from
  the run's key): what the one-off releases read."""
  rows = user_sampling.rows_per_user(users, max_rows_per_user, rng)
  return ({k: v[rows] for k, v in features.items()},
          None if labels is None else np.asarray(labels)[rows])


def check_step(model, features, labels, structure):
  """Refuses, before anything is paid, a model whose DP step cannot clip per user: the step's
  own trace-time refusal (layers without a per-unit norm, `ExtraNorms`) run on two rows, and a
  distribution strategy of more than one replica (it could split a user's rows)."""
  strategy = getattr(model, "distribute_strategy", None)
  if strategy is not None and strategy.num_replicas_in_sync > 1:
    raise DprecError(f"privacy_unit='user' trains on one replica (the model's strategy has "
                     f"{strategy.num_replicas_in_sync}): replicas could split a user's rows")
  check_structure(structure)
  pack = private_inputs.packer(structure, with_labels=False)
  few = {k: v[:2] for k, v in features.items()}
  x = dict(pack(few), **{UNIT_KEY: np.zeros(len(next(iter(few.values()))), np.int32)})
  model.per_example_squared_norms(x, None if labels is None else np.asarray(labels)[:2])
