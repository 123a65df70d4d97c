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


def _calibrate(make_event, target_epsilon, delta, accountant, rtol, progress=None):
  """Smallest σ with ε(σ) <= target, within rtol: dp_accounting's bracketing (Brent) search.

  For PLD the search starts from the RDP answer: RDP over-estimates ε, so its σ is an upper end
  of the bracket and sets the scale of an absolute tolerance rtol·σ/2. That takes about half the
  PLD evaluations (seconds each) of a search from [0, 1] to a fixed tolerance.
  `progress(sigma)`, if given, is called for every σ the search accounts with `accountant`.
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

  def search(accountant_name, event_fn, bracket, tol):
    return dp_accounting.calibrate_dp_mechanism(
        lambda: accounting.make_accountant(accountant_name), event_fn, target_epsilon, delta,
        bracket_interval=bracket, tol=tol)

  rdp_event = make_reported_event if accountant == "rdp" else make_event
  sigma = search("rdp", rdp_event, None, rtol * MIN_NOISE_MULTIPLIER)
  if accountant == "pld" and sigma >= MIN_NOISE_MULTIPLIER:
    try:
      sigma = search("pld", make_reported_event,
                     dp_accounting.ExplicitBracketInterval(sigma / 2, sigma), rtol * sigma / 2)
    except ValueError:  # a safeguard: RDP σ not above PLD σ; search from [0, 1]
      sigma = search("pld", make_reported_event, None, rtol * MIN_NOISE_MULTIPLIER)
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
                  selection_delta=0.0, progress=None):
  """Calibrate one σ for periods [(q_i, T_i)] after deducting the selection (note 001 C.3).

  Basic composition: ε_total = ε_train(δ − δ_select) + ε_select, so training gets the target
  minus ε_select at δ − δ_select.
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
        [accounting.dp_sgd_event(sigma, q, steps) for q, steps in periods])

  if not 0 <= selection_delta < delta:
    raise DprecError(f"selection delta {selection_delta} must be in [0, delta={delta})")
  sigma = _calibrate(make_event, target_epsilon - selection_epsilon, delta - selection_delta,
                     accountant, rtol, progress)
  planned = [accounting.TrainingPeriod(sigma, q, int(steps), poisson) for q, steps in periods]
  return TrainingPlan(sigma, composition.compose_periods(
      planned, delta, accountant, selections=[(selection_epsilon, selection_delta)]))
