"""Smallest noise multiplier σ meeting a target (ε, δ): inverse accounting (note 001 App. C.5)."""
import dataclasses
from typing import Sequence, Tuple

import dp_accounting

from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import composition

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
                  selection_delta=0.0, progress=None, gaussian_mechanisms=()):
  """Calibrate one σ for periods [(q_i, T_i)] after deducting the selection (note 001 C.3).

  Basic composition: ε_total = ε_train(δ − δ_select) + ε_select, so training gets the target
  minus ε_select at δ − δ_select. `gaussian_mechanisms` (their noise multipliers, e.g. a DP
  histogram's) are released once each before training and composed with it in the accountant
  (PLD), so training's σ is calibrated for what they leave.
  """
  if not periods:
    raise DprecError("plan_training needs at least one (sampling_rate, steps) period")
  if selection_epsilon < 0 or selection_epsilon >= target_epsilon:
    raise DprecError(
        f"selection epsilon {selection_epsilon} leaves nothing of the target {target_epsilon} "
        "for training")
  for q, steps in periods:
    accounting.check_gaussian_parameters(1.0, q, steps)

  def make_event(sigma):
    return dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(s) for s in gaussian_mechanisms]
        + [accounting.dp_sgd_event(sigma, q, steps) for q, steps in periods])

  if not 0 <= selection_delta < delta:
    raise DprecError(f"selection delta {selection_delta} must be in [0, delta={delta})")
  sigma = _calibrate(make_event, target_epsilon - selection_epsilon, delta - selection_delta,
                     accountant, rtol, progress)
  planned = [accounting.gaussian_mechanism_period(s) for s in gaussian_mechanisms]
  planned += [accounting.TrainingPeriod(sigma, q, int(steps), poisson) for q, steps in periods]
  return TrainingPlan(sigma, composition.compose_periods(
      planned, delta, accountant, selections=[(selection_epsilon, selection_delta)]))
