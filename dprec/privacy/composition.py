"""One (ε, δ) for a whole run: training periods (any q, σ, T) plus pure-ε charges (DP top-k).

Gaussian periods compose inside the accountant; pure ε-DP charges add to its ε at the same δ by
basic composition (note 001 App. C.3, Lemma C.5). Both parts are reported.
"""
import dataclasses
from typing import List, Sequence

from dprec.errors import DprecError
from dprec.privacy import accounting


@dataclasses.dataclass(frozen=True)
class CompositionResult:
  epsilon: float
  delta: float
  training_epsilon: float
  selection_epsilon: float
  accountant: str
  periods: List[dict]
  note: str = ""

  def to_dict(self):
    return dataclasses.asdict(self)


def compose_periods(periods: Sequence[accounting.TrainingPeriod], delta, accountant="pld",
                    pure_epsilons: Sequence[float] = ()):
  """ε at δ of all periods composed, plus the sum of the pure-ε charges."""
  if any(e < 0 for e in pure_epsilons):
    raise DprecError(f"pure epsilon charges must be >= 0, got {list(pure_epsilons)}")
  training = accounting.gaussian_epsilon(periods, delta, accountant)
  selection = float(sum(pure_epsilons))
  poisson = all(p.poisson for p in periods)
  return CompositionResult(
      epsilon=training + selection, delta=delta, training_epsilon=training,
      selection_epsilon=selection, accountant=accountant,
      periods=[dataclasses.asdict(p) for p in periods], note=accounting.poisson_note(poisson))
