"""Poisson sampling over users for user-level DP training (user-level sampling, ULS).

Each step samples every user independently with probability q (Binomial(U, q) users, then a
uniform subset of that size: `poisson.poisson_batch_indices` over users), and a sampled user
brings at most k = `max_rows_per_user` of their rows, a uniform k-subset drawn afresh each step
(all of them when they have at most k). The DP step clips each sampled user's summed gradient
as one unit (Charles et al., "Fine-Tuning Large Language Models with User-Level Differential
Privacy", arXiv:2407.07737, Algorithm 2; Chua et al., "Mind the Privacy Unit! User-Level
Differential Privacy for Language Model Fine-Tuning", arXiv:2406.14322), so one user moves a
step's clipped sum by at most C whichever rows are drawn: the step is the Poisson-subsampled
Gaussian at rate q over users, accounted as rows are (`dprec.privacy.accounting`). Drawing the
k rows afresh each step costs nothing in the proof (the bound is per step and the draw of one
user's rows never depends on another user's data) and lets a user's rows all train over the run.
The number of users U is treated as public, as the number of rows N is for row-level runs
(q = expected users per batch / U).

k is public: the run's configuration, never read off the data (a k computed from the rows per
user, e.g. their maximum or a quantile, would be a release of its own and would have to be a DP
quantile, charged). `DEFAULT_MAX_ROWS_PER_USER` is a fixed constant; for ULS it bounds the
batch's rows and the step's work, not ε.

A batch is the flat rows of the sampled users plus the int32 feature `UNIT_KEY`: each row's unit
index in [0, U_batch), the rows of one unit contiguous (in row order), units in increasing user
order, the interface of the DP step's per-user clipping. The randomness comes from the run's
secret key (`UserSampling.entropy`, as `poisson.BatchSampling`'s), one stream per step, so a
resumed run draws the very batches an uninterrupted one would. Memory: O(N) ints for the rows
grouped by user (`UserRows`), no per-user Python object.
"""
import dataclasses
import os
from typing import Iterator, Mapping, Optional, Tuple

import numpy as np

from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy_unit import DEFAULT_MAX_ROWS_PER_USER, UNIT_KEY, USER_KEY
from dprec.training import poisson


@dataclasses.dataclass(frozen=True)
class UserRows:
  """Rows grouped by user: `order` [N] the row indices sorted by user id (stable), `starts` and
  `counts` [U] where each user's rows begin in `order` and how many, users by increasing id."""
  order: np.ndarray
  starts: np.ndarray
  counts: np.ndarray

  @property
  def num_users(self) -> int:
    return len(self.counts)

  @classmethod
  def group(cls, user_ids, num_rows: Optional[int] = None, field: str = USER_KEY) -> "UserRows":
    """Groups rows by their integer user ids (one per row, >= 0); refuses missing ids, a
    count other than `num_rows`, and ids that are not integers."""
    if user_ids is None:
      raise DprecError(f"user-level sampling needs a '{field}' column: every row needs the id of "
                       "its user (add the column, or train at --privacy-unit row)")
    ids = np.asarray(user_ids)
    if ids.dtype.kind not in "iu":
      raise DprecError(f"field {field}: user ids must be integers, got dtype {ids.dtype}: write "
                       "each user's id as a non-negative integer")
    if ids.ndim != 1 or (num_rows is not None and len(ids) != num_rows):
      raise DprecError(f"field {field}: {ids.shape} user ids for {num_rows} rows: every row needs "
                       "one user id")
    if ids.size == 0:
      raise DprecError(f"field {field}: no rows: user-level sampling needs at least one user")
    missing = np.flatnonzero(ids < 0)
    if missing.size:
      raise DprecError(f"field {field}: row {missing[0]} (and {missing.size - 1} more) has user id "
                       f"{ids[missing[0]]}: every row needs its user's non-negative id")
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.r_[0, np.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1]
    del sorted_ids
    return cls(order, starts, np.diff(np.r_[starts, len(ids)]))


@dataclasses.dataclass(frozen=True)
class UserSampling:
  """How to draw user-level batches.

  Attributes:
    users_per_batch: the expected users per batch, q·U (q = users_per_batch / U).
    max_rows_per_user: k, the most rows a sampled user brings to a step (public, >= 1).
    entropy: seed of the numpy generators that pick users and rows; secret, as
      `poisson.BatchSampling.entropy` (a run passes bits derived from its noise key,
      `dprec.workflows.run.Run.key.entropy("user poisson")`; None draws 256 bits from the OS
      CSPRNG). Never a public seed, unless the run is flagged as not private.
  """
  users_per_batch: float
  max_rows_per_user: int = DEFAULT_MAX_ROWS_PER_USER
  entropy: Optional[int] = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    accounting.check_group_size(self.max_rows_per_user)
    if not self.users_per_batch > 0:
      raise DprecError(f"users per batch must be > 0, got {self.users_per_batch}")
    if self.entropy is None:
      object.__setattr__(self, "entropy", int.from_bytes(os.urandom(32), "little"))

  def sampling_rate(self, num_users: int) -> float:
    """q = users per batch / U, the rate the accountant uses (over users)."""
    if self.users_per_batch > num_users:
      raise DprecError(f"{self.users_per_batch} users per batch exceeds the {num_users} users")
    return self.users_per_batch / num_users

  def step_rng(self, step: int) -> np.random.Generator:
    """Step `step`'s generator: its own stream of the secret entropy."""
    return np.random.default_rng(np.random.SeedSequence(self.entropy, spawn_key=(int(step),)))


def user_batch(users: UserRows, sampling_rate: float, max_rows_per_user: int,
               rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
  """(rows, unit) of one step: every user joins with probability q, independently, and brings a
  uniform subset of at most k of their rows; `rows` [B] the row indices, `unit` [B] int32 each
  row's unit index, units contiguous and increasing, each unit's rows in increasing order."""
  accounting.check_group_size(max_rows_per_user)
  sampled = next(poisson.poisson_batch_indices(users.num_users, sampling_rate, 1, rng))
  return unit_rows(users, sampled, max_rows_per_user, rng)


def unit_rows(users: UserRows, sampled: np.ndarray, max_rows_per_user: int,
              rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
  """(rows, unit) of the users at indices `sampled` (unit i: `sampled[i]`; a user may appear
  more than once, each time a unit of their own rows): each unit a uniform subset of at most k
  of its user's rows, drawn by `rng`; units contiguous and increasing, each unit's rows in
  increasing order."""
  counts, starts = users.counts[sampled], users.starts[sampled]
  total = int(counts.sum())
  unit = np.repeat(np.arange(len(sampled), dtype=np.int32), counts)
  first = np.repeat(np.cumsum(counts) - counts, counts)  # where each unit begins in the flat list
  # A uniform order within each unit (units stay in order), then each unit's first k.
  shuffled = np.lexsort((rng.random(total), unit))
  kept = shuffled[np.arange(total) - first < np.minimum(counts, max_rows_per_user)[unit]]
  rows = users.order[np.repeat(starts, counts)[kept] + (kept - first[kept])]
  unit = unit[kept]
  ordered = np.lexsort((rows, unit))
  return rows[ordered], unit[ordered]


def rows_per_user(users: UserRows, max_rows_per_user: int, rng: np.random.Generator) -> np.ndarray:
  """Sorted indices of at most k uniformly chosen rows of every user (`user_batch` at q = 1):
  what a one-off release reads, so that one user moves it by at most k rows' worth."""
  return np.sort(user_batch(users, 1.0, max_rows_per_user, rng)[0])


def user_batch_indices(users: UserRows, sampling: UserSampling, steps: int,
                       start: int = 0) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
  """`user_batch` of steps `start`..`steps − 1`, each from its own stream of the secret key."""
  rate = sampling.sampling_rate(users.num_users)
  for step in range(start, steps):
    yield user_batch(users, rate, sampling.max_rows_per_user, sampling.step_rng(step))


def user_batches(features: Mapping[str, np.ndarray], labels: Optional[np.ndarray],
                 user_ids, sampling: UserSampling, steps: int, start: int = 0):
  """Batches `start`..`steps − 1` of user-level sampling: (features with `UNIT_KEY`, labels),
  or the features alone when `labels` is None; `user_ids` one integer per row."""
  arrays = {name: np.asarray(value) for name, value in features.items()}
  if UNIT_KEY in arrays:
    raise DprecError(f"feature {UNIT_KEY!r} is reserved for the privacy unit of user-level "
                     "batches: rename that feature")
  sizes = {len(a) for a in arrays.values()} | ({len(labels)} if labels is not None else set())
  if len(sizes) != 1:  # none (no features) or several
    raise DprecError(f"features and labels must have one length, got {sorted(sizes)}")
  users = UserRows.group(user_ids, sizes.pop())
  for rows, unit in user_batch_indices(users, sampling, steps, start):
    batch = {name: array[rows] for name, array in arrays.items()}
    batch[UNIT_KEY] = unit
    yield (batch, np.asarray(labels)[rows]) if labels is not None else batch
