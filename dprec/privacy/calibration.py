"""Smallest noise multiplier σ meeting a target (ε, δ): inverse accounting (note 001 App. C.5)."""
import dataclasses
from typing import Sequence, Tuple

import dp_accounting

from dprec.errors import BudgetExceededError
from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import composition

# A plan must leave training at least this share of the target ε (what earlier releases and
# this run's other releases leave); below it σ grows without bound and nothing is learnt.
MIN_TRAINING_SHARE = 0.01
# Below this σ the guarantee is meaningless; above it an absolute tolerance of rtol·σ_min is
# a relative tolerance of rtol.
MIN_NOISE_MULTIPLIER = 1e-2
# The σ search's PLD grid, in multiples of the accounting grid (see `_calibrate`).
COARSE_PLD_FACTOR = 10


def _calibrate(make_event, target_epsilon, delta, accountant, rtol, progress=None):
  """Smallest σ with ε(σ) <= target, within rtol: dp_accounting's bracketing (Brent) search.

  With PLD the search runs on a grid 10× coarser than the accounting one (10–15× faster per σ;
  its ε is pessimistic, so its σ is valid), then two evaluations on the accounting grid confirm
  that σ meets the target and that σ·(1 − rtol) does not; else the search reruns on that grid.
  `progress(sigma)`, if given, is called for every σ the search accounts (each can take seconds).
  """
  accounting.check_accountant(accountant)
  accounting.check_delta(delta)
  if not target_epsilon > 0:
    raise DprecError(f"target epsilon must be > 0, got {target_epsilon}")
  if not 0 < rtol < 1:
    raise DprecError(f"rtol must be in (0, 1), got {rtol}")

  def make_reported_event(sigma):
    if progress is not None:
      progress(sigma)
    return make_event(sigma)

  def search(pld_discretization):
    return dp_accounting.calibrate_dp_mechanism(
        lambda: accounting.make_accountant(accountant, pld_discretization), make_reported_event,
        target_epsilon, delta, tol=rtol * MIN_NOISE_MULTIPLIER)

  def meets_target(sigma):
    fresh = accounting.make_accountant(accountant)
    return fresh.compose(make_reported_event(sigma)).get_epsilon(delta) <= target_epsilon

  fine = accounting.PLD_DISCRETIZATION  # RDP ignores the grid
  if accountant == "pld":
    sigma = search(COARSE_PLD_FACTOR * fine)
    within_rtol = meets_target(sigma) and not meets_target(sigma * (1 - rtol))
    if not within_rtol:
      sigma = search(fine)
  else:
    sigma = search(fine)
  if sigma < MIN_NOISE_MULTIPLIER:
    raise DprecError(
        f"the target epsilon {target_epsilon} is met with noise multiplier {sigma:.3g} < "
        f"{MIN_NOISE_MULTIPLIER}: that is not meaningful privacy; lower the target")
  return float(sigma)


def calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, steps, accountant="pld",
                               rtol=1e-3):
  """σ such that T sampled-Gaussian steps at rate q give ε <= target, within rtol of the optimum."""
  accounting.check_gaussian_parameters(1.0, sampling_rate, steps)
  if steps == 0:
    raise DprecError("steps must be > 0 to calibrate a noise multiplier")
  return _calibrate(
      lambda sigma: accounting.dp_sgd_event(sigma, sampling_rate, steps),
      target_epsilon, delta, accountant, rtol)


def calibrate_gaussian_mechanism(target_epsilon, delta, accountant="pld", rtol=1e-3):
  """σ of one (unsampled) Gaussian mechanism, e.g. a DP histogram, with ε <= target at δ."""
  return _calibrate(dp_accounting.GaussianDpEvent, target_epsilon, delta, accountant, rtol)


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
  """One σ for every planned period so that training plus selection fit the budget."""
  noise_multiplier: float
  composition: composition.CompositionResult

  @property
  def epsilon(self):
    return self.composition.epsilon

  def to_dict(self):
    return {"noise_multiplier": self.noise_multiplier, **self.composition.to_dict()}


def plan_training(target_epsilon, delta, periods: Sequence[Tuple[float, int]],
                  selection_epsilon=0.0, accountant="pld", poisson=True, rtol=1e-3,
                  selection_delta=0.0, progress=None, gaussian_mechanisms=(),
                  spent: composition.Spent = composition.Spent()):
  """Calibrate one σ for periods [(q_i, T_i)] after deducting the selection (note 001 C.3).

  Basic composition: ε_total = ε_train(δ − δ_select) + ε_select, so training gets the target
  minus ε_select at δ − δ_select. `gaussian_mechanisms` (their noise multipliers, e.g. a DP
  histogram's) are released once each before training and composed with it in the accountant
  (PLD), so training's σ is calibrated for what they leave. `spent` (what a ledger recorded on
  the data set before this run: a preprocessing job's DP top-k, other runs' training) counts
  the same way: its selections are deducted, its periods composed in the accountant. A plan
  that would leave training less than `MIN_TRAINING_SHARE` of the target is refused.
  """
  if not periods:
    raise DprecError("plan_training needs at least one (sampling_rate, steps) period")
  if selection_epsilon < 0 or selection_epsilon >= target_epsilon:
    raise DprecError(
        f"selection epsilon {selection_epsilon} leaves nothing of the target {target_epsilon} "
        "for training")
  for q, steps in periods:
    accounting.check_gaussian_parameters(1.0, q, steps)
  if not 0 <= selection_delta < delta:
    raise DprecError(f"selection delta {selection_delta} must be in [0, delta={delta})")
  selections = tuple(spent.selections) + ((selection_epsilon, selection_delta),)
  fixed = list(spent.periods) + [accounting.gaussian_mechanism_period(s)
                                 for s in gaussian_mechanisms]
  _check_room(target_epsilon, delta, fixed, selections, accountant, spent)

  def make_event(sigma):
    return dp_accounting.ComposedDpEvent(
        [accounting.dp_sgd_event(p.noise_multiplier, p.sampling_rate, p.steps) for p in fixed]
        + [accounting.dp_sgd_event(sigma, q, steps) for q, steps in periods])

  sigma = _calibrate(make_event, target_epsilon - sum(e for e, _ in selections),
                     delta - sum(d for _, d in selections), accountant, rtol, progress)
  planned = fixed + [accounting.TrainingPeriod(sigma, q, int(steps), poisson)
                     for q, steps in periods]
  return TrainingPlan(sigma, composition.compose_periods(planned, delta, accountant,
                                                         selections=selections))


def _check_room(target_epsilon, delta, fixed, selections, accountant, spent):
  """Refuses (BudgetExceededError) when what is spent and reserved before training leaves it
  less than `MIN_TRAINING_SHARE` of the target: its σ would grow without bound."""
  if sum(d for _, d in selections) >= delta:
    raise BudgetExceededError(f"the selection deltas {[d for _, d in selections]} leave nothing "
                              f"of delta {delta:g} for training")
  committed = composition.compose_periods(fixed, delta, accountant,
                                          selections=selections).epsilon
  left = target_epsilon - committed
  if left >= MIN_TRAINING_SHARE * target_epsilon:
    return
  already = ""
  if spent:
    before = composition.compose_periods(list(spent.periods), delta, accountant,
                                         selections=spent.selections).epsilon
    already = f"the ledger has already spent epsilon {before:.4g} on this data set; "
  raise BudgetExceededError(
      f"{already}with this run's other releases that is epsilon {committed:.4g} of the target "
      f"{target_epsilon:g} at delta {delta:g}, leaving {max(left, 0.0):.3g} for training, under "
      f"{MIN_TRAINING_SHARE:.0%} of it: nothing useful is left to train with (use a fresh "
      "ledger, a larger budget, or less selection epsilon)")
