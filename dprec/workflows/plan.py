"""The privacy plan of a run, fixed before it starts: one planner for single runs and streams.

A run trains `expected_periods` periods (1 for `train ctr` and `train seqrec`; a stream's expected
number for `stream`) of T Poisson-subsampled Gaussian steps at q = B/N each. Before training it
may release Gaussian mechanisms once (`train ctr`'s DP base rate, `train seqrec`'s DP histogram of
p_i; each calibrated alone for its share of ε) and pure-ε DP top-k selections (`selection_epsilon`
in total, split evenly over the periods). One σ is calibrated (`dprec.privacy.plan_training`, PLD
by default) so that everything planned spends at most `epsilon_total`: the mechanisms composed
with the steps in the accountant, the selections deducted first by basic composition (Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models", arXiv:2311.08357
App. C.3). A stream's periods compose by the unit it protects (`plan_stream`; README, "Privacy
model"): for a row, which lives in one period, in parallel (σ is calibrated for the costliest
period; the DP top-k refreshes read the running counts of every period so far and compose
sequentially); for a user, whose rows recur across periods, sequentially, each step Poisson-
sampling users at q = B/U (U the users of a period, public as N is) and clipping each sampled user's
at most `max_rows_per_user` rows as one unit (user-level sampling, `dprec.training.user_sampling`),
so the steps are the sampled Gaussian at q over users. For DP-AdaFEST the σ is
the composed (σ1⁻² + σ2⁻²)^(−1/2) (Ghazi et al. 2023, §3.3). What the run's ledger spent on the data
set before it (`spent`, `dprec.workflows.run_budget.plan_prior`: a preprocessing job's DP top-k
vocabulary, other runs' training) is composed the same way, so σ is calibrated for what it
leaves. Periods beyond the plan are charged too; a run stops before one that would exceed the
budget.
"""
import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence, Tuple

from dprec import privacy
from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import truncation
from dprec.privacy_unit import PRIVACY_UNITS

FIXED_BATCHES_NOTE = "fixed-size batches: not Poisson, accounted as if Poisson"


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
  """The DP parameters of a run (every period uses the same ones).

  Attributes:
    epsilon_total: the run's budget (inf: non-private, nothing is charged).
    delta: δ of the whole run (None for a non-private single run).
    sampling_rate: Poisson rate q of every step.
    steps_per_period: T, the steps of one period (of the whole run when it has one period).
    noise_multiplier: composed σ charged per step (None or 0 when non-private).
    expected_periods: periods the budget was planned for.
    examples_per_period, batch_size: N and B with q = B / N (a user-level stream: U, the users of
      a period, and B the expected users per batch).
    selection_epsilon_per_period: pure ε of each period's DP top-k (0: public counts).
    accountant: "pld" or "rdp".
    poisson: False for fixed-size batches (accounted as if Poisson, and flagged so).
    mechanisms: {ledger label: σ} of Gaussian mechanisms released once before training.
    forward: DP-Forward's `dprec.privacy.ForwardPlan` (SeqLDP releases instead of DP steps).
    spent: what the ledger had spent on the data set before the run (composed with it).
    privacy_unit: what a stream protects, "row" or "user" (None: a single run, a row); also the
      unit of the ledger a stream opens.
    parallel_periods: the periods read disjoint units and compose in parallel (row streams).
    period_mechanisms: {name: σ} of Gaussian mechanisms released in every period (DP Platt
      scaling), charged under the period's label.
    max_rows_per_user: k of a user-level stream (None otherwise): the most rows of a sampled
      user in a step, and of a user in each period's releases (`release_noise_multiplier`).
    max_batch_size: B_max a step's Poisson batch is truncated to (None: exact Poisson), and
      truncation_delta the δ it costs (`dprec.privacy.truncation`), taken from training's δ.
    group_size: k > 1: rows are sampled (example-level sampling) and ε protects a user of at
      most k rows as a group (`accounting.TrainingPeriod.group_size`): σ and the mechanisms' σ
      are per row, and every charge is a row-level one converted for the group (`charge_fields`).
  """
  epsilon_total: float
  delta: Optional[float]
  sampling_rate: float
  steps_per_period: int
  noise_multiplier: Optional[float]
  expected_periods: int = 1
  examples_per_period: int = 0
  batch_size: int = 0
  selection_epsilon_per_period: float = 0.0
  accountant: str = "pld"
  poisson: bool = True
  mechanisms: Mapping[str, float] = dataclasses.field(default_factory=dict)
  forward: Optional[object] = None
  spent: privacy.Spent = privacy.Spent()
  privacy_unit: Optional[str] = None
  parallel_periods: bool = False
  period_mechanisms: Mapping[str, float] = dataclasses.field(default_factory=dict)
  max_rows_per_user: Optional[int] = None
  max_batch_size: Optional[int] = None
  truncation_delta: float = 0.0
  group_size: int = 1

  def release_noise_multiplier(self, noise_multiplier):
    """The noise multiplier, on a row's sensitivity, of a release (DP base rate, DP Platt
    scaling) whose plan σ is per protected unit: a user-level stream's releases read at most
    k = `max_rows_per_user` rows of a user, which move their sum by at most k times a row's
    sensitivity Δ, so noise k·σ·Δ is the Gaussian mechanism at σ for the user (charged so)."""
    return noise_multiplier * (self.max_rows_per_user or 1)

  @property
  def charge_fields(self) -> dict:
    """The ledger arguments of every charge of the plan: a group plan's charges are row-level
    ones converted for a user of at most k rows (`dprec.privacy.ledger`); else none."""
    return {"unit": "row", "group_size": self.group_size} if self.group_size > 1 else {}

  @property
  def private(self) -> bool:
    return math.isfinite(self.epsilon_total)

  @property
  def steps(self) -> int:
    """All planned steps (T of a single run)."""
    return self.steps_per_period * self.expected_periods

  @property
  def selection_epsilon(self) -> float:
    """Pure ε of all planned DP top-k selections."""
    return self.selection_epsilon_per_period * self.expected_periods

  @property
  def notes(self):
    """Caveats of the plan for the summary."""
    notes = [FIXED_BATCHES_NOTE] if self.private and not self.poisson else []
    if self.private and self.max_batch_size is not None:
      notes.append(f"Poisson batches truncated to {self.max_batch_size} rows: delta "
                   f"{self.truncation_delta:.3g} of delta charged for it (Chua et al. 2024)")
    return notes

  @property
  def spent_with_truncation(self) -> privacy.Spent:
    """`spent` and the (0, `truncation_delta`) charge of the cap, which training composes with."""
    return _with_truncation(self.spent, self.truncation_delta)

  def planned_epsilon(self, periods=None):
    """ε after `periods` periods of steps and selections (default: all planned), with what was
    spent before, computed by dprec.privacy directly."""
    if not self.private:
      return math.inf
    periods = self.expected_periods if periods is None else periods
    composed = min(periods, 1) if self.parallel_periods else periods  # the costliest period
    training = privacy.TrainingPeriod(self.noise_multiplier, self.sampling_rate,
                                      self.steps_per_period * composed,
                                      group_size=self.group_size)
    mechanisms = [dataclasses.replace(privacy.gaussian_mechanism_period(sigma),
                                      group_size=self.group_size)
                  for sigma in list(self.mechanisms.values()) * bool(periods)
                  + list(self.period_mechanisms.values()) * composed]
    spent = self.spent_with_truncation
    return privacy.compose_periods(  # selections by basic composition
        list(spent.periods) + mechanisms + [training], self.delta, self.accountant,
        selections=spent.selections + ((self.selection_epsilon_per_period * periods, 0.0),)
    ).epsilon

  def to_dict(self):
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in ("mechanisms", "period_mechanisms", "forward", "poisson")}


@functools.lru_cache(maxsize=64)
def _calibrated(epsilon, delta, sampling_rate, steps, selection_epsilon, accountant, poisson,
                mechanisms, spent, group_size=1):
  """Calibration takes seconds (PLD, BENCHMARKS.md): reuse it across runs of one process.
  Identical periods compose like one period of all their steps, so T·P steps are calibrated as
  one period (the σ of the list of periods, several times faster)."""
  return privacy.plan_training(epsilon, delta, [(sampling_rate, steps)],
                               selection_epsilon=selection_epsilon, accountant=accountant,
                               poisson=poisson, gaussian_mechanisms=mechanisms,
                               spent=spent, group_size=group_size).noise_multiplier


@functools.lru_cache(maxsize=64)
def _mechanism_sigma(epsilon, delta, accountant):
  return privacy.calibrate_gaussian_mechanism(epsilon, delta, accountant)


def _with_truncation(spent: privacy.Spent, delta: float) -> privacy.Spent:
  return spent if not delta else dataclasses.replace(
      spent, selections=spent.selections + ((0.0, delta),))


def _check_sizes(expected_periods, examples_per_period, batch_size):
  if expected_periods < 1 or examples_per_period < 1 or batch_size < 1:
    raise DprecError("expected periods, examples per period and batch size must be positive, got "
                     f"{expected_periods}, {examples_per_period}, {batch_size}")


def plan_privacy(epsilon_total, delta, examples_per_period, batch_size, steps_per_period,
                 expected_periods=1, selection_epsilon=0.0,
                 mechanisms: Sequence[Tuple[str, float]] = (),
                 noise_multiplier: Optional[float] = None, accountant="pld", poisson=True,
                 spent: privacy.Spent = privacy.Spent(), max_batch_size: Optional[int] = None,
                 group_size: int = 1):
  """The `PrivacyPlan` for a budget (or a given σ checked by the ledger as the run goes).

  Args:
    epsilon_total: the run's ε; `math.inf` plans a non-private run (no σ, nothing charged).
    delta: δ of the run (typically 1/N over everything it trains on).
    examples_per_period, batch_size: N and B; q = B / N.
    steps_per_period, expected_periods: T and how many periods of T steps the budget must last.
    selection_epsilon: total pure ε of the DP top-k selections, split evenly per period and
      deducted from training's budget.
    mechanisms: [(ledger label, ε share)]: Gaussian mechanisms released once before training,
      each calibrated alone to ε share · `epsilon_total`, composed with training.
    noise_multiplier: use this σ instead of calibrating one (the run may then stop early).
    accountant, poisson: as `dprec.privacy.plan_training`.
    spent: what the run's ledger spent on the data set before the run
      (`run_budget.plan_prior`); σ is calibrated for what it leaves of `epsilon_total`.
    max_batch_size: truncate each Poisson batch to B_max rows, at δ_trunc
      (`dprec.privacy.truncation.checked_delta`: refused above a tenth of δ) taken from
      training's δ before σ is calibrated.
    group_size: k > 1: ε protects a user of at most k of the N rows, each sampled at q
      (example-level sampling and group privacy, `PrivacyPlan.group_size`); a mechanism's σ
      is then k times the user-level Gaussian's at its share (a user moves it by k rows).

  Raises:
    DprecError: for inconsistent sizes or a selection budget that leaves nothing for training
      (BudgetExceededError when what was spent leaves nothing useful).
  """
  _check_sizes(expected_periods, examples_per_period, batch_size)
  common = dict(epsilon_total=epsilon_total, delta=delta,
                sampling_rate=min(1.0, batch_size / examples_per_period),
                steps_per_period=int(steps_per_period), expected_periods=expected_periods,
                examples_per_period=examples_per_period, batch_size=batch_size,
                accountant=accountant, poisson=poisson, spent=spent)
  accounting.check_group_size(group_size)
  if group_size > 1:
    common.update(privacy_unit="user", group_size=int(group_size))
  if max_batch_size is not None:
    if not poisson:
      raise DprecError("--max-batch-size caps Poisson batches; fixed-size batches have B rows")
    if max_batch_size < 1:
      raise DprecError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    common["max_batch_size"] = int(max_batch_size)
  if not math.isfinite(epsilon_total):
    return PrivacyPlan(noise_multiplier=noise_multiplier, **common)
  if max_batch_size is not None:
    common["truncation_delta"] = truncation.checked_delta(
        examples_per_period, common["sampling_rate"], common["steps_per_period"] * expected_periods,
        max_batch_size, epsilon_total, delta)
  sigmas = {label: group_size * _mechanism_sigma(share * epsilon_total, delta, accountant)
            for label, share in mechanisms}
  if noise_multiplier is None:
    noise_multiplier = _calibrated(epsilon_total, delta, common["sampling_rate"],
                                   common["steps_per_period"] * expected_periods,
                                   selection_epsilon, accountant, poisson,
                                   tuple(sigmas.values()),
                                   _with_truncation(spent, common.get("truncation_delta", 0.0)),
                                   int(group_size))
  return PrivacyPlan(noise_multiplier=noise_multiplier, mechanisms=sigmas,
                     selection_epsilon_per_period=selection_epsilon / expected_periods, **common)



def plan_stream(epsilon_total, delta, expected_periods, examples_per_period, batch_size,
                epochs_per_period=1.0, selection_epsilon=0.0,
                noise_multiplier: Optional[float] = None, accountant="pld",
                spent: privacy.Spent = privacy.Spent(), privacy_unit="row",
                max_rows_per_user: Optional[int] = None,
                mechanisms: Sequence[Tuple[str, float]] = (),
                period_mechanisms: Sequence[Tuple[str, float]] = ()):
  """The plan of a stream: T = ceil(epochs · N_period / B) steps per period at q = B / N_period
  (from the *expected* units per period, fixed before any data is seen), σ 0 when non-private.

  `privacy_unit` "row": each row lives in one period, so the periods compose in parallel and σ
  is calibrated for one period (its T steps, the `period_mechanisms`, and the `mechanisms`
  released once, with the first period), with every selection (`selection_epsilon` in all,
  sequential) deducted. "user": `examples_per_period` is U, the users of a period, and
  `batch_size` the expected users per batch; each step Poisson-samples users at q = B/U and a
  sampled user brings at most k = `max_rows_per_user` rows, clipped as one (Charles et al.,
  "Fine-Tuning Large Language Models with User-Level Differential Privacy", arXiv:2407.07737,
  Algorithm 2), so a step is the sampled Gaussian at q over users. A user can be in every
  period: everything composes sequentially over `expected_periods`, each period mechanism
  getting its share over the periods; the releases read at most k rows of a user
  (`PrivacyPlan.release_noise_multiplier`). `mechanisms` / `period_mechanisms`: [(name, ε
  share)], each calibrated alone to its share of `epsilon_total` (per unit)."""
  _check_sizes(expected_periods, examples_per_period, batch_size)
  if not epsilon_total > 0:
    raise DprecError(f"--epsilon must be positive, got {epsilon_total}")
  if privacy_unit not in PRIVACY_UNITS:
    raise DprecError(f"--privacy-unit must be one of {', '.join(PRIVACY_UNITS)}, got "
                     f"{privacy_unit!r}")
  parallel = privacy_unit == "row"
  if parallel and max_rows_per_user is not None:
    raise DprecError("--max-rows-per-user goes with --privacy-unit user")
  if not parallel:
    if max_rows_per_user is None:
      from dprec.training import user_sampling
      max_rows_per_user = user_sampling.DEFAULT_MAX_ROWS_PER_USER
    accounting.check_group_size(max_rows_per_user)
  steps = max(1, math.ceil(epochs_per_period * examples_per_period / batch_size))
  common = dict(epsilon_total=epsilon_total, delta=delta,
                sampling_rate=min(1.0, batch_size / examples_per_period), steps_per_period=steps,
                expected_periods=expected_periods, examples_per_period=examples_per_period,
                batch_size=batch_size, accountant=accountant, spent=spent,
                privacy_unit=privacy_unit, parallel_periods=parallel,
                max_rows_per_user=None if parallel else int(max_rows_per_user))
  if not math.isfinite(epsilon_total):
    return PrivacyPlan(noise_multiplier=0.0, **common)
  repeats = 1 if parallel else expected_periods
  once = {name: _mechanism_sigma(share * epsilon_total, delta, accountant)
          for name, share in mechanisms}
  each = {name: _mechanism_sigma(share * epsilon_total / repeats, delta, accountant)
          for name, share in period_mechanisms}
  if noise_multiplier is None:
    fixed = tuple(list(once.values()) + list(each.values()) * repeats)
    noise_multiplier = _calibrated(epsilon_total, delta, common["sampling_rate"], steps * repeats,
                                   selection_epsilon, accountant, True, fixed, spent)
  return PrivacyPlan(noise_multiplier=noise_multiplier, mechanisms=once, period_mechanisms=each,
                     selection_epsilon_per_period=selection_epsilon / expected_periods, **common)
