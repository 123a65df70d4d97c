"""One (ε, δ) for a whole run: training periods (any q, σ, T) plus selection charges (DP top-k).

Gaussian periods compose inside the accountant. Selection charges, pure ε or (ε_i, δ_i), add by
basic composition (Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large
Embedding Models", arXiv:2311.08357, Lemma C.5): the training part is evaluated at δ − Σ δ_i and the
ε_i are added. Both parts are reported. `Spent` is what a ledger recorded before a run (a
preprocessing job's DP top-k, another run's training), in the same two parts.

Parallel composition (`compose_partitioned`): releases that each read one part of a partition of
the data (a row-level stream's periods: every row lives in one day) compose, for one unit, only
with the releases that read that unit's part and with those that read every part; ε is the
largest over the parts (README, "Privacy model": adaptive parallel composition).
"""
import dataclasses
from typing import List, Sequence, Tuple

from dprec.errors import DprecError
from dprec.privacy import accounting


@dataclasses.dataclass(frozen=True)
class Spent:
  """Releases already made on a data set: Gaussian periods (composed with later ones in the
  accountant) and selection charges (ε_i, δ_i) (added by basic composition)."""
  periods: Tuple[accounting.TrainingPeriod, ...] = ()
  selections: Tuple[Tuple[float, float], ...] = ()

  def __bool__(self):
    return bool(self.periods or self.selections)

  @property
  def selection_epsilon(self):
    return float(sum(e for e, _ in self.selections))

  @property
  def selection_delta(self):
    return float(sum(d for _, d in self.selections))


@dataclasses.dataclass(frozen=True)
class CompositionResult:
  epsilon: float
  delta: float
  training_epsilon: float
  training_delta: float
  selection_epsilon: float
  selection_delta: float
  accountant: str
  periods: List[dict]
  note: str = ""
  # Parallel composition: [{"days", "epsilon"}] per part of the data (the result is the worst).
  partitions: List[dict] = dataclasses.field(default_factory=list)

  def to_dict(self):
    return dataclasses.asdict(self)


def compose_periods(periods: Sequence[accounting.TrainingPeriod], delta, accountant="pld",
                    selections: Sequence[Tuple[float, float]] = ()):
  """ε at δ of all periods composed with selection charges (ε_i, δ_i) (δ_i = 0: pure)."""
  charges = [(float(e), float(d)) for e, d in selections]
  if any(e < 0 or d < 0 for e, d in charges):
    raise DprecError(f"selection charges must be >= 0, got {charges}")
  selection_delta = float(sum(d for _, d in charges))
  if selection_delta >= delta:
    raise DprecError(f"selection delta {selection_delta:g} leaves nothing of delta {delta:g} "
                     "for training")
  training = accounting.gaussian_epsilon(periods, delta - selection_delta, accountant)
  selection = float(sum(e for e, _ in charges))
  poisson = all(p.poisson for p in periods)
  return CompositionResult(
      epsilon=training + selection, delta=delta, training_epsilon=training,
      training_delta=delta - selection_delta, selection_epsilon=selection,
      selection_delta=selection_delta, accountant=accountant,
      periods=[dataclasses.asdict(p) for p in periods], note=accounting.poisson_note(poisson))


def compose_partitioned(shared: Spent, parts: Sequence[Tuple[Tuple[int, ...], Spent]], delta,
                        accountant="pld") -> CompositionResult:
  """ε at δ of releases `shared` that read every unit, composed with releases that each read one
  part of the data: `parts` [(days, what the releases reading exactly those days spent)].

  A unit (a row) lives in one day d; removing it changes only the releases whose days contain d
  and the shared ones, whatever the others (adaptively) did with their outputs, so it is
  protected at the composition of those; the run's ε is the largest over the days
  (README, "Privacy model"). Without parts: `compose_periods` of `shared`."""
  by_day = {}
  for index, (days, _) in enumerate(parts):
    for day in days:
      by_day.setdefault(int(day), []).append(index)
  if not by_day:
    return compose_periods(list(shared.periods), delta, accountant, selections=shared.selections)
  groups = {}  # days read by the same releases have the same ε
  for day, indices in sorted(by_day.items()):
    groups.setdefault(tuple(indices), []).append(day)
  results = []
  for indices, days in groups.items():
    spents = [shared] + [parts[i][1] for i in indices]
    result = compose_periods([p for s in spents for p in s.periods], delta, accountant,
                             selections=[c for s in spents for c in s.selections])
    results.append((result, days))
  worst = max(results, key=lambda pair: pair[0].epsilon)[0]
  return dataclasses.replace(
      worst, partitions=[{"days": days, "epsilon": r.epsilon} for r, days in results])
