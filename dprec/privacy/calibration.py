"""Smallest noise multiplier σ meeting a target (ε, δ): inverse accounting (Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357)."""
import dataclasses
import math
from typing import Sequence, Tuple

from scipy import optimize

from dprec.errors import BudgetExceededError
from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import composition

# A plan must leave training at least this share of the target ε (what earlier releases and
# this run's other releases leave); below it σ grows without bound and nothing is learnt.
MIN_TRAINING_SHARE = 0.01
# Below this σ the guarantee is meaningless; the search does not look there.
MIN_NOISE_MULTIPLIER = 1e-2
# The σ search's PLD grid, in multiples of the accounting grid (see `_calibrate`).
COARSE_PLD_FACTOR = 10
# The search's relative precision on its grid, as a share of rtol: the accounting grid's
# optimum sits a few 1e-4 below the coarse one, so this leaves σ·(1 − rtol) below it.
SEARCH_PRECISION = 0.1
# Per step of the bracket search, σ moves by at most this factor.
MAX_BRACKET_STEP = 2.0


def _calibrate(make_periods, target_epsilon, delta, accountant, rtol, progress=None):
  """Smallest σ meeting the target on the accounting grid, within rtol: ε(σ) <= target and
  ε(σ·(1 − rtol)) > target, both computed as the ledger does (`accounting.gaussian_epsilon`).

  `make_periods(σ)` lists the `TrainingPeriod`s whose composition is accounted. With PLD, σ is
  first searched on a grid `COARSE_PLD_FACTOR`× coarser (10× faster per σ, its ε a little above
  the accounting grid's) by `_search_root`, then moved in steps of rtol on the accounting grid
  until both conditions hold (`_step_to_optimum`: two evaluations when the coarse σ is within
  rtol, as it is on every case measured). The accounting grid's PLDs stay cached, so the plan's
  ε at the returned σ is not recomputed. `progress(sigma)`, if given, is called for every σ
  accounted.
  """
  accounting.check_accountant(accountant)
  accounting.check_delta(delta)
  if not target_epsilon > 0:
    raise DprecError(f"target epsilon must be > 0, got {target_epsilon}")
  if not 0 < rtol < 1:
    raise DprecError(f"rtol must be in (0, 1), got {rtol}")

  def epsilon(sigma, grid):
    if progress is not None:
      progress(sigma)
    return accounting.gaussian_epsilon(make_periods(sigma), delta, accountant, grid)

  fine = accounting.PLD_DISCRETIZATION  # RDP ignores the grid
  coarse = COARSE_PLD_FACTOR * fine if accountant == "pld" else fine
  try:
    sigma = _search_root(lambda s: epsilon(s, coarse), target_epsilon, SEARCH_PRECISION * rtol)
    sigma = _step_to_optimum(lambda s: epsilon(s, fine) <= target_epsilon, sigma, rtol)
  except _BelowMinimum:
    sigma = 0.0
  if sigma < MIN_NOISE_MULTIPLIER:
    raise DprecError(
        f"the target epsilon {target_epsilon} is met with a noise multiplier below "
        f"{MIN_NOISE_MULTIPLIER}: that is not meaningful privacy; lower the target")
  return float(sigma)


class _BelowMinimum(Exception):
  """The target is met at σ = MIN_NOISE_MULTIPLIER: the search stops there."""


def _search_root(epsilon_of, target, precision):
  """σ within relative `precision` above the root of ε(σ) = target, ε decreasing in σ.

  log ε is close to linear in log σ, so the root is bracketed by secant steps on that scale
  from σ = 1 (the first assumes ε ∝ 1/σ; each moves σ at most `MAX_BRACKET_STEP`×), then
  found by Brent's method on the same scale (`scipy.optimize.brentq`): a handful of
  evaluations where halving from [0, 1] took a dozen.
  """
  floor, max_step = math.log(MIN_NOISE_MULTIPLIER), math.log(MAX_BRACKET_STEP)
  known = {}

  def gap(log_sigma):  # log(ε/target): decreasing, -inf where ε = 0
    if log_sigma not in known:
      value = epsilon_of(math.exp(log_sigma))
      known[log_sigma] = math.log(value / target) if value > 0 else -math.inf
    return known[log_sigma]

  previous, x = None, 0.0
  while gap(x) != 0:
    if previous is not None and (gap(previous) > 0) != (gap(x) > 0):
      root = optimize.brentq(lambda u: max(gap(u), -1e3), previous, x, xtol=precision / 2)
      return math.exp(root + precision / 2)
    slope = -1.0  # ε ∝ 1/σ to first order
    if previous is not None and math.isfinite(gap(previous) - gap(x)) and gap(previous) > gap(x):
      slope = (gap(x) - gap(previous)) / (x - previous)
    step = -1.1 * gap(x) / slope if math.isfinite(gap(x)) else -max_step  # overshoot to bracket
    step = math.copysign(min(max(abs(step), precision), max_step), step)
    previous, x = x, max(x + step, floor)
    if x == previous:  # met at the smallest σ searched
      raise _BelowMinimum()
  return math.exp(x)


def _step_to_optimum(meets, sigma, rtol):
  """σ' with meets(σ') and not meets(σ'·(1 − rtol)), from a σ close to it: steps of rtol
  (doubling while they keep the same answer), then halving the step in log σ."""
  known = {}

  def ok(s):
    if s not in known:
      known[s] = meets(s)
    return known[s]

  hi, lo, factor = None, None, 1 - rtol
  if ok(sigma):
    hi, step = sigma, factor
    while lo is None:
      if ok(hi * step):
        hi, step = hi * step, step * step
      else:
        lo = hi * step
  else:
    lo, step = sigma, 1 / factor
    while hi is None:
      if ok(lo * step):
        hi = lo * step
      else:
        lo, step = lo * step, step * step
  while lo < hi * factor:  # ε failed at lo, met at hi: bisect in log σ
    middle = math.sqrt(lo * hi)
    hi, lo = (middle, lo) if ok(middle) else (hi, middle)
  while ok(hi * factor):  # not monotone between the grid points: keep stepping down
    hi *= factor
  return hi


def calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, steps, accountant="pld",
                               rtol=1e-3, group_size=1):
  """σ such that T sampled-Gaussian steps at rate q give ε <= target, within rtol of the optimum.

  The target protects the unit sampled at q (a row, or a user under user-level sampling); with
  `group_size` k > 1, a user of at most k rows each sampled at q (example-level sampling, the
  mixture of Gaussians of `accounting.TrainingPeriod`): σ is then the rows' noise multiplier
  (noise σ·C on the sum of C-clipped rows) that gives the user-level target."""
  accounting.check_gaussian_parameters(1.0, sampling_rate, steps)
  accounting.check_group_size(group_size)
  if steps == 0:
    raise DprecError("steps must be > 0 to calibrate a noise multiplier")
  return _calibrate(
      lambda sigma: [accounting.TrainingPeriod(sigma, sampling_rate, int(steps),
                                               group_size=int(group_size))],
      target_epsilon, delta, accountant, rtol)


def calibrate_gaussian_mechanism(target_epsilon, delta, accountant="pld", rtol=1e-3):
  """σ of one (unsampled) Gaussian mechanism, e.g. a DP histogram, with ε <= target at δ."""
  return _calibrate(lambda sigma: [accounting.gaussian_mechanism_period(sigma)],
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
                  selection_delta=0.0, progress=None, gaussian_mechanisms=(),
                  spent: composition.Spent = composition.Spent(), group_size=1):
  """Calibrate one σ for periods [(q_i, T_i)] after deducting the selection (Ghazi et al. 2023 C.3).

  Basic composition: ε_total = ε_train(δ − δ_select) + ε_select, so training gets the target
  minus ε_select at δ − δ_select. `gaussian_mechanisms` (their noise multipliers, e.g. a DP
  histogram's) are released once each before training and composed with it in the accountant
  (PLD), so training's σ is calibrated for what they leave. `spent` (what a ledger recorded on
  the data set before this run: a preprocessing job's DP top-k, other runs' training) counts
  the same way: its selections are deducted, its periods composed in the accountant. A plan
  that would leave training less than `MIN_TRAINING_SHARE` of the target is refused.
  `group_size` k > 1: the target protects a user of at most k rows of every period and
  mechanism (example-level sampling read at the user level, `accounting.TrainingPeriod`), and σ
  is the rows' noise multiplier.
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
  accounting.check_group_size(group_size)
  fixed = list(spent.periods) + [
      dataclasses.replace(accounting.gaussian_mechanism_period(s), group_size=int(group_size))
      for s in gaussian_mechanisms]
  _check_room(target_epsilon, delta, fixed, selections, accountant, spent)

  def make_periods(sigma):
    return fixed + [accounting.TrainingPeriod(sigma, q, int(steps), poisson, int(group_size))
                    for q, steps in periods]

  sigma = _calibrate(make_periods, target_epsilon - sum(e for e, _ in selections),
                     delta - sum(d for _, d in selections), accountant, rtol, progress)
  planned = make_periods(sigma)
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
