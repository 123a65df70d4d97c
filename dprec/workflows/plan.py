"""The privacy plan of a run, fixed before it starts: one planner for single runs and streams.

A run trains `expected_periods` periods (1 for `train ctr` and `train seqrec`; a stream's expected
number for `stream`) of T Poisson-subsampled Gaussian steps at q = B/N each. Before training it
may release Gaussian mechanisms once (`train ctr`'s DP base rate, `train seqrec`'s DP histogram of
p_i; each calibrated alone for its share of ε) and pure-ε DP top-k selections (`selection_epsilon`
in total, split evenly over the periods). One σ is calibrated (`dprec.privacy.plan_training`, PLD
by default) so that everything planned spends at most `epsilon_total`: the mechanisms composed
with the steps in the accountant, the selections deducted first by basic composition (note 001
App. C.3; a stream's periods compose sequentially, a user's impressions recurring across days).
For DP-AdaFEST the σ is the composed (σ1⁻² + σ2⁻²)^(−1/2) (seed 001 §3.3). What the run's ledger
spent on the data set before it (`spent`, `dprec.workflows.run.plan_prior`: a preprocessing
job's DP top-k vocabulary, other runs' training) is composed the same way, so σ is calibrated
for what it leaves. Periods beyond the plan are charged too; a run stops before one that would
exceed the budget.
"""
import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence, Tuple

from dprec import privacy
from dprec.errors import DprecError

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
    examples_per_period, batch_size: N and B with q = B / N.
    selection_epsilon_per_period: pure ε of each period's DP top-k (0: public counts).
    accountant: "pld" or "rdp".
    poisson: False for fixed-size batches (accounted as if Poisson, and flagged so).
    mechanisms: {ledger label: σ} of Gaussian mechanisms released once before training.
    forward: DP-Forward's `dprec.privacy.ForwardPlan` (SeqLDP releases instead of DP steps).
    spent: what the ledger had spent on the data set before the run (composed with it).
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
    return [FIXED_BATCHES_NOTE] if self.private and not self.poisson else []

  def planned_epsilon(self, periods=None):
    """ε after `periods` periods of steps and selections (default: all planned), with what was
    spent before, computed by dprec.privacy directly."""
    if not self.private:
      return math.inf
    periods = self.expected_periods if periods is None else periods
    training = privacy.TrainingPeriod(self.noise_multiplier, self.sampling_rate,
                                      self.steps_per_period * periods)
    return privacy.compose_periods(  # selections by basic composition
        list(self.spent.periods) + [training], self.delta, self.accountant,
        selections=self.spent.selections + ((self.selection_epsilon_per_period * periods, 0.0),)
    ).epsilon

  def to_dict(self):
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in ("mechanisms", "forward", "poisson")}


@functools.lru_cache(maxsize=64)
def _calibrated(epsilon, delta, sampling_rate, steps, selection_epsilon, accountant, poisson,
                mechanisms, spent):
  """Calibration takes seconds (PLD, BENCHMARKS.md): reuse it across runs of one process.
  Identical periods compose like one period of all their steps, so T·P steps are calibrated as
  one period (the σ of the list of periods, several times faster)."""
  return privacy.plan_training(epsilon, delta, [(sampling_rate, steps)],
                               selection_epsilon=selection_epsilon, accountant=accountant,
                               poisson=poisson, gaussian_mechanisms=mechanisms,
                               spent=spent).noise_multiplier


@functools.lru_cache(maxsize=64)
def _mechanism_sigma(epsilon, delta, accountant):
  return privacy.calibrate_gaussian_mechanism(epsilon, delta, accountant)


def _check_sizes(expected_periods, examples_per_period, batch_size):
  if expected_periods < 1 or examples_per_period < 1 or batch_size < 1:
    raise DprecError("expected periods, examples per period and batch size must be positive, got "
                     f"{expected_periods}, {examples_per_period}, {batch_size}")


def plan_privacy(epsilon_total, delta, examples_per_period, batch_size, steps_per_period,
                 expected_periods=1, selection_epsilon=0.0,
                 mechanisms: Sequence[Tuple[str, float]] = (),
                 noise_multiplier: Optional[float] = None, accountant="pld", poisson=True,
                 spent: privacy.Spent = privacy.Spent()):
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
    spent: what the run's ledger spent on the data set before the run (`run.plan_prior`); σ is
      calibrated for what it leaves of `epsilon_total`.

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
  if not math.isfinite(epsilon_total):
    return PrivacyPlan(noise_multiplier=noise_multiplier, **common)
  sigmas = {label: _mechanism_sigma(share * epsilon_total, delta, accountant)
            for label, share in mechanisms}
  if noise_multiplier is None:
    noise_multiplier = _calibrated(epsilon_total, delta, common["sampling_rate"],
                                   common["steps_per_period"] * expected_periods,
                                   selection_epsilon, accountant, poisson,
                                   tuple(sigmas.values()), spent)
  return PrivacyPlan(noise_multiplier=noise_multiplier, mechanisms=sigmas,
                     selection_epsilon_per_period=selection_epsilon / expected_periods, **common)


def plan_stream(epsilon_total, delta, expected_periods, examples_per_period, batch_size,
                epochs_per_period=1.0, selection_epsilon=0.0,
                noise_multiplier: Optional[float] = None, accountant="pld",
                spent: privacy.Spent = privacy.Spent()):
  """The plan of a stream: T = ceil(epochs · N_period / B) steps per period at q = B / N_period
  (from the *expected* examples per period, fixed before any data is seen), σ 0 when
  non-private."""
  _check_sizes(expected_periods, examples_per_period, batch_size)
  if not epsilon_total > 0:
    raise DprecError(f"--epsilon-total must be positive, got {epsilon_total}")
  steps = max(1, math.ceil(epochs_per_period * examples_per_period / batch_size))
  plan = plan_privacy(epsilon_total, delta, examples_per_period, batch_size, steps,
                      expected_periods, selection_epsilon, noise_multiplier=noise_multiplier,
                      accountant=accountant, spent=spent)
  return plan if plan.private else dataclasses.replace(plan, noise_multiplier=0.0)
