"""A streaming run's rows of a period: loaded once, grouped by user for a user-level plan, drawn
into the Poisson batches of its steps and into the rows its releases read.

Every draw comes from the run's secret key and (period, step) only (`Run.numpy_rng`), so a
restart after a crash draws the same batches and release rows again.
"""
from dprec.errors import DprecError
from dprec.privacy_unit import UNIT_KEY, USER_KEY
from dprec.training.period_source import Period
from dprec.training.poisson import poisson_batch_indices
from dprec.training.user_sampling import UserRows, rows_per_user, user_batch


class PeriodRows:
  """The rows of the period in use (evaluated, then trained on) under `plan`, drawn with `run`'s
  key."""

  def __init__(self, plan, run):
    self.plan, self.run = plan, run
    self._loaded = (None, None)  # (period index, its arrays): evaluated, then trained on
    self._grouped = (None, None)  # (period index, its `UserRows`): a user-level plan's

  def load(self, period: Period):
    """(features, labels) of period p (read once while p is in use)."""
    if self._loaded[0] != period.index:
      self._loaded = (period.index, period.load())
    return self._loaded[1]

  def users(self, period: Period) -> UserRows:
    """Period p's rows grouped by user (a user-level plan); refuses rows without an integer
    user id, before anything is charged."""
    if self._grouped[0] != period.index:
      features, labels = self.load(period)
      if USER_KEY not in features:
        raise DprecError(f"period {period.index} (days {list(period.days)}): --privacy-unit user "
                         f"needs a '{USER_KEY}' column in the stream's records")
      self._grouped = (period.index, UserRows.group(features[USER_KEY], len(labels),
                                                    f"{USER_KEY} of period {period.index}"))
    return self._grouped[1]

  def release_rows(self, period: Period):
    """Period p's rows the releases read (DP base rate, DP Platt scaling): all of them, or for a
    user-level plan at most k = `max_rows_per_user` of each user's, drawn uniformly by the run's
    key (`user_sampling.rows_per_user`), so one user moves a release by at most k rows' worth."""
    features, labels = self.load(period)
    if self.plan.privacy_unit != "user":
      return features, labels
    kept = rows_per_user(self.users(period), self.plan.max_rows_per_user,
                         self.run.key.numpy_rng("rows per user", period.index))
    return {k: v[kept] for k, v in features.items()}, labels[kept]

  def batches(self, period, features, labels, start, stop, sizes):
    """Poisson batches of steps [start, stop): step (p, s) always draws the same (secret) batch;
    each batch's size is appended to `sizes`. A user-level plan samples users at q, each
    bringing at most k rows, and marks each row's user in the batch (`UNIT_KEY`: the DP step
    clips per user; `user_sampling.user_batch`)."""
    for step in range(start, stop):
      if self.plan.privacy_unit == "user":
        indices, unit = user_batch(
            self.users(period), self.plan.sampling_rate, self.plan.max_rows_per_user,
            self.run.key.numpy_rng("user poisson", period.index, step))
      else:
        rng = self.run.key.numpy_rng("poisson", period.index, step)
        indices = next(poisson_batch_indices(len(labels), self.plan.sampling_rate, 1, rng))
      sizes.append(len(indices))
      batch = {k: v[indices] for k, v in features.items()}
      if self.plan.privacy_unit == "user":
        batch[UNIT_KEY] = unit
      yield batch, labels[indices]
