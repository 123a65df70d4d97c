"""The privacy plan of a streaming run: one budget, fixed up front, spread over the periods.

A stream is trained period by period (seed 001 §4.3, Table 5). The whole run is one mechanism
accounted in one ledger: every period's Poisson-subsampled Gaussian steps compose sequentially
with the others (a person's impressions recur across days, so periods are not treated as disjoint),
and so do the pure-ε DP top-k refreshes of DP-FEST / DP-AdaFEST+ (note 001 §2.1: k selections cost k
exponential-mechanism draws). The plan fixes, before any data is seen, the sampling rate
q = B / N_period and the steps per period T from the *expected* number of periods and examples,
and calibrates one noise multiplier σ so that all planned periods together spend at most
`epsilon_total` (composed σ of AdaFEST, (σ1⁻² + σ2⁻²)^(−1/2); seed 001 §3.3), together with what
the ledger spent on the data set before the run (`spent`: e.g. a DP top-k vocabulary of the
preprocessing job, composed as `privacy.plan_training` does). Periods beyond the plan are
charged too and the trainer stops before one would exceed the budget.
"""
import dataclasses
import math
from typing import Optional

from dprec import privacy
from dprec.errors import DprecError


@dataclasses.dataclass(frozen=True)
class StreamPlan:
  """Per-period DP parameters of a streaming run (all periods use the same ones).

  Attributes:
    epsilon_total: the run's budget (inf for non-private training: nothing is charged).
    delta: δ of the whole run.
    expected_periods: periods the budget was planned for.
    examples_per_period: expected training examples per period (sets q).
    batch_size: expected batch size B = q · examples_per_period.
    sampling_rate: Poisson rate q of every step.
    steps_per_period: T, steps trained on each period.
    noise_multiplier: composed σ charged per step (0 when non-private).
    selection_epsilon_per_period: pure ε of each period's DP top-k refresh (0: public counts).
    accountant: "pld" or "rdp".
    spent: what the ledger had spent on the data set before the run (composed with it).
  """
  epsilon_total: float
  delta: float
  expected_periods: int
  examples_per_period: int
  batch_size: int
  sampling_rate: float
  steps_per_period: int
  noise_multiplier: float
  selection_epsilon_per_period: float = 0.0
  accountant: str = "pld"
  spent: privacy.Spent = privacy.Spent()

  @property
  def private(self):
    return math.isfinite(self.epsilon_total)

  def planned_epsilon(self, periods=None):
    """ε after `periods` periods (default: all planned), with what was spent before, computed
    by dprec.privacy directly."""
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
    return dataclasses.asdict(self)


def plan_stream(epsilon_total, delta, expected_periods, examples_per_period, batch_size,
                epochs_per_period=1.0, selection_epsilon=0.0,
                noise_multiplier: Optional[float] = None, accountant="pld",
                spent: privacy.Spent = privacy.Spent()):
  """Computes the StreamPlan for a budget (or checks a given σ against it).

  Args:
    epsilon_total: total ε of the run; `math.inf` plans a non-private run.
    delta: δ of the run (typically 1/N over the whole stream).
    expected_periods: how many periods the budget must last.
    examples_per_period: expected examples in a period; q = batch_size / examples_per_period.
    batch_size: expected batch size of the Poisson batches.
    epochs_per_period: expected passes over a period's data (T = ceil(epochs · N_period / B)).
    selection_epsilon: total pure ε reserved for DP top-k refreshes, split evenly per period and
      deducted from the training budget (basic composition, as seed 001 App. C.3 does).
    noise_multiplier: use this σ instead of calibrating one (the run may then stop early).
    accountant: "pld" (default, as seed 001) or "rdp".
    spent: what the run's ledger spent on the data set before the run (`Run.spent_before`);
      σ is calibrated for what it leaves of `epsilon_total`.

  Raises:
    DprecError: for inconsistent sizes or a selection budget that leaves nothing for training
      (BudgetExceededError when what was spent leaves nothing useful).
  """
  if expected_periods < 1 or examples_per_period < 1 or batch_size < 1:
    raise DprecError("expected periods, examples per period and batch size must be positive, got "
                     f"{expected_periods}, {examples_per_period}, {batch_size}")
  if not epsilon_total > 0:
    raise DprecError(f"--epsilon-total must be positive, got {epsilon_total}")
  sampling_rate = min(1.0, batch_size / examples_per_period)
  steps = max(1, math.ceil(epochs_per_period * examples_per_period / batch_size))
  common = dict(epsilon_total=epsilon_total, delta=delta, expected_periods=expected_periods,
                examples_per_period=examples_per_period, batch_size=batch_size,
                sampling_rate=sampling_rate, steps_per_period=steps, accountant=accountant,
                spent=spent)
  if not math.isfinite(epsilon_total):
    return StreamPlan(noise_multiplier=0.0, **common)
  if noise_multiplier is None:
    if not 0 <= selection_epsilon < epsilon_total:
      raise DprecError(f"the selection budget {selection_epsilon} leaves nothing of "
                       f"--epsilon-total {epsilon_total} for training")
    # Identical periods compose like one period of all their steps: calibrate that (the same σ
    # as for the list of periods, several times faster).
    noise_multiplier = privacy.plan_training(
        epsilon_total, delta, [(sampling_rate, steps * expected_periods)],
        selection_epsilon=selection_epsilon, accountant=accountant, spent=spent).noise_multiplier
  return StreamPlan(noise_multiplier=noise_multiplier,
                    selection_epsilon_per_period=selection_epsilon / expected_periods, **common)
