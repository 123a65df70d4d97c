"""ε of Poisson-subsampled Gaussian training (DP-SGD, DP-FEST, DP-AdaFEST) with `dp_accounting`.

A training period is T steps of the sampled Gaussian mechanism with rate q and noise multiplier σ
(Ghazi et al. 2023: dominating pair ((1-q)N(0,σ²) + qN(1,σ²), N(0,σ²)) self-composed T times,
add/remove-one adjacency). Fixed-size shuffled batches are accounted as if Poisson (Ghazi et al.
2023, §3.3, [PHK+23] §4.3) and flagged. One DP-AdaFEST step composes two Gaussians on the same
sample, which equals one Gaussian with σ = (σ1⁻² + σ2⁻²)^(−1/2) (Ghazi et al. 2023, §3.3, Sec 3.3;
App. C.4 misprints the exponent).

The privacy unit (docs/guide/privacy_accounting.md, "The privacy unit"). Everything above protects
one unit that each step samples independently at rate q and whose contribution to the clipped sum
is at most C: a row under example-level sampling (ELS), a user under user-level sampling (ULS:
users are Poisson-sampled at q, each sampled user's rows clipped as one contribution; Charles et
al., "Fine-Tuning Large Language Models with User-Level Differential Privacy", arXiv:2407.07737,
§3), so ULS is this same accountant at q over users. ELS protects a user of at most k rows
(`TrainingPeriod.group_size`) as a group of k rows: each of the user's rows joins a step
independently at q, so the user moves the sum by m·C with m ~ Binomial(k, q), and the step is
dominated by the mixture of Gaussians (N(0, σ²), Σ_m Binom(m; k, q)·N(m, σ²)) (dp_accounting's
`MixtureGaussianPrivacyLoss`; the vector case reduces to the scalar one by Choquette-Choo et al.,
"Privacy Amplification for Matrix Mechanisms", arXiv:2310.15526, Cor. 4.7, and the steps compose
adaptively by dominating pairs). `group_privacy` is the generic conversion for any (ε, δ)-DP
release (Vadhan, "The Complexity of Differential Privacy", Lemma 2.2), looser for Gaussians.
"""
import dataclasses
import functools
import math
from typing import Sequence

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution
import numpy as np
from scipy import stats

from dprec.errors import DprecError

ACCOUNTANTS = ("pld", "rdp")
NOT_POISSON_NOTE = "not Poisson, accounted as if Poisson"
# dp_accounting's PLDAccountant default; results are reproducible only with the same interval.
PLD_DISCRETIZATION = 1e-4


@dataclasses.dataclass(frozen=True)
class TrainingPeriod:
  """T steps of the Poisson-subsampled Gaussian mechanism (rate q, noise multiplier σ), seen by
  a unit of `group_size` rows each sampled at q (1: the unit sampled is the unit protected;
  k > 1: a user of at most k rows under example-level sampling, see the module docstring)."""
  noise_multiplier: float
  sampling_rate: float
  steps: int
  poisson: bool = True
  group_size: int = 1

  def __post_init__(self):
    check_gaussian_parameters(self.noise_multiplier, self.sampling_rate, self.steps)
    check_group_size(self.group_size)


@dataclasses.dataclass(frozen=True)
class PrivacyResult:
  """(ε, δ) of one training period and how it was accounted."""
  epsilon: float
  delta: float
  noise_multiplier: float
  sampling_rate: float
  steps: int
  accountant: str
  poisson: bool
  note: str = ""

  def to_dict(self):
    return dataclasses.asdict(self)


def check_accountant(accountant):
  if accountant not in ACCOUNTANTS:
    raise DprecError(f"unknown accountant {accountant!r}: expected one of {', '.join(ACCOUNTANTS)}")


def check_delta(delta):
  if not 0 < delta < 1:
    raise DprecError(f"delta must be in (0, 1), got {delta}")


def check_gaussian_parameters(noise_multiplier, sampling_rate, steps):
  if not noise_multiplier >= 0:
    raise DprecError(f"noise multiplier must be >= 0, got {noise_multiplier}")
  if not 0 < sampling_rate <= 1:
    raise DprecError(f"sampling rate must be in (0, 1], got {sampling_rate}")
  if int(steps) != steps or steps < 0:
    raise DprecError(f"steps must be a non-negative integer, got {steps}")


def check_group_size(group_size):
  if int(group_size) != group_size or group_size < 1:
    raise DprecError(f"max rows per user (group size) must be an integer >= 1, got {group_size}: "
                     "pass --max-rows-per-user 1 or more")


def poisson_note(poisson):
  return "" if poisson else NOT_POISSON_NOTE


def dp_sgd_event(noise_multiplier, sampling_rate, steps):
  """The `DpEvent` of T Poisson-subsampled Gaussian steps."""
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), int(steps))


def group_sensitivities(sampling_rate, group_size):
  """(sensitivities, probabilities) of a group of k rows each sampled at q: m·C with
  probability Binom(m; k, q), in units of C (dp_accounting's mixture of Gaussians)."""
  counts = np.arange(group_size + 1)
  return [float(m) for m in counts], [float(p) for p in stats.binom.pmf(counts, group_size,
                                                                         sampling_rate)]


def gaussian_mechanism_period(noise_multiplier):
  """One release of the (unsampled) Gaussian mechanism, e.g. a DP histogram: the sampled
  Gaussian at q = 1 for one step, whose PLD and RDP are exactly the Gaussian mechanism's."""
  return TrainingPeriod(noise_multiplier, 1.0, 1)


def make_accountant(accountant="pld", pld_discretization=PLD_DISCRETIZATION):
  """A fresh `dp_accounting` accountant with add/remove-one adjacency. A coarser PLD grid is
  faster and pessimistic (its ε is an upper bound on the default grid's)."""
  check_accountant(accountant)
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if accountant == "pld":
    return dp_accounting.pld.PLDAccountant(relation, pld_discretization)
  return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)


@functools.lru_cache(maxsize=32)
def _step_pld(noise_multiplier, sampling_rate, discretization, group_size=1):
  """One sampled-Gaussian step's PLD: the expensive part, shared by every T and period (for a
  group of k rows, the PLD `dp_accounting.dp_event.MixtureOfGaussiansDpEvent` composes)."""
  if group_size > 1 and sampling_rate == 1:  # every row of the group released: sensitivity k·C
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, sensitivity=group_size,
        value_discretization_interval=discretization)
  if group_size > 1:
    if not hasattr(privacy_loss_distribution, "from_mixture_gaussian_mechanism"):
      raise DprecError("accounting a group of rows per user needs dp-accounting >= 0.4.4 (its "
                       "mixture of Gaussians): pip install -U dp-accounting")
    sensitivities, probabilities = group_sensitivities(sampling_rate, group_size)
    return privacy_loss_distribution.from_mixture_gaussian_mechanism(
        noise_multiplier, sensitivities, probabilities,
        value_discretization_interval=discretization)
  return privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=noise_multiplier,
      value_discretization_interval=discretization,
      sampling_prob=sampling_rate)


@functools.lru_cache(maxsize=32)
def _period_pld(noise_multiplier, sampling_rate, steps, discretization, group_size=1):
  return _step_pld(noise_multiplier, sampling_rate, discretization, group_size).self_compose(steps)


def gaussian_epsilon(periods: Sequence[TrainingPeriod], delta, accountant="pld",
                     pld_discretization=PLD_DISCRETIZATION):
  """ε at δ of the composition of training periods (any order: composition commutes).

  PLD composes the same `privacy_loss_distribution` objects, in the same order, as
  `dp_accounting.pld.PLDAccountant` does for these events (tests check equality), but caches the
  one-step and period PLDs so a ledger re-accounting a growing run, and a calibration confirming
  the σ it then plans with, stay fast. `pld_discretization` other than the accounting grid is
  for σ calibration's search only (a coarser grid: faster, pessimistic).
  """
  check_accountant(accountant)
  check_delta(delta)
  return _composed_epsilon(tuple(p for p in periods if p.steps > 0), float(delta), accountant,
                           pld_discretization)


@functools.lru_cache(maxsize=4096)
def _composed_epsilon(periods, delta, accountant, pld_discretization):
  """`gaussian_epsilon` of periods with steps, remembered: a σ calibration and the ledger ask
  again for the ε they computed before (a resumed run, a plan confirmed, every run of a
  process planning the same training)."""
  if not periods:  # nothing released (RDP's conversion would report a small ε > 0)
    return 0.0
  if any(p.noise_multiplier == 0 for p in periods):
    return math.inf
  if accountant == "rdp":
    if any(p.group_size > 1 for p in periods):
      raise DprecError("the RDP accountant has no mixture of Gaussians for a group of rows per "
                       "user (example-level sampling, user-level unit): use --accountant pld")
    events = [dp_sgd_event(p.noise_multiplier, p.sampling_rate, p.steps) for p in periods]
    return make_accountant("rdp").compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)
  pld = privacy_loss_distribution.identity(pld_discretization)
  for p in periods:
    pld = pld.compose(_period_pld(float(p.noise_multiplier), float(p.sampling_rate), int(p.steps),
                                  pld_discretization, int(p.group_size)))
  return float(pld.get_epsilon_for_delta(delta))


def gaussian_delta(periods: Sequence[TrainingPeriod], epsilon, accountant="pld"):
  """δ at ε of the composition of training periods: `gaussian_epsilon`'s inverse, on the same
  PLD (the same grid and objects) or RDP accountant."""
  check_accountant(accountant)
  periods = tuple(p for p in periods if p.steps > 0)
  if not periods:
    return 0.0
  if accountant == "rdp":
    events = [dp_sgd_event(p.noise_multiplier, p.sampling_rate, p.steps) for p in periods]
    return float(make_accountant("rdp").compose(dp_accounting.ComposedDpEvent(events))
                 .get_delta(float(epsilon)))
  pld = privacy_loss_distribution.identity(PLD_DISCRETIZATION)
  for p in periods:
    pld = pld.compose(_period_pld(float(p.noise_multiplier), float(p.sampling_rate), int(p.steps),
                                  PLD_DISCRETIZATION, int(p.group_size)))
  return float(pld.get_delta_for_epsilon(float(epsilon)))


def compute_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant="pld", poisson=True):
  """ε after `steps` Poisson-subsampled Gaussian steps (fixed-size batches flagged, not Poisson)."""
  period = TrainingPeriod(noise_multiplier, sampling_rate, int(steps), poisson)
  epsilon = gaussian_epsilon([period], delta, accountant)
  return PrivacyResult(
      epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
      sampling_rate=sampling_rate, steps=int(steps), accountant=accountant, poisson=poisson,
      note=poisson_note(poisson))


def group_privacy(epsilon, delta, group_size):
  """(kε, k·e^((k−1)ε)·δ): what any (ε, δ)-DP release guarantees to a group of k units (Vadhan,
  "The Complexity of Differential Privacy", Lemma 2.2; Dwork and Roth, "The Algorithmic
  Foundations of Differential Privacy", Thm. 2.2 for δ = 0): the conversion of a row-level
  selection charge to a user of at most k rows."""
  check_group_size(group_size)
  if not epsilon >= 0 or not 0 <= delta < 1:
    raise DprecError(f"need epsilon >= 0 and 0 <= delta < 1, got ({epsilon}, {delta})")
  k = int(group_size)
  return k * epsilon, (k * math.exp((k - 1) * epsilon) * delta if delta else 0.0)


GROUP_METHODS = ("mixture", "conversion")


def group_epsilon(noise_multiplier, sampling_rate, steps, group_size, delta, method="mixture",
                  accountant="pld"):
  """ε at δ of T Poisson-subsampled Gaussian steps for a user of at most k rows, each row
  sampled at q (example-level sampling read at the user level).

  "mixture": the accountant on the group's mixture of Gaussians (`TrainingPeriod.group_size`,
  the module docstring; PLD only). "conversion": `group_privacy` of the row-level guarantee,
  kε(δ_row) at the largest δ_row on a log grid with k·e^((k−1)ε(δ_row))·δ_row <= δ (every δ_row
  meeting it gives a valid bound).
  """
  if method not in GROUP_METHODS:
    raise DprecError(f"unknown group method {method!r}: expected one of {', '.join(GROUP_METHODS)}")
  check_delta(delta)
  if method == "mixture":
    return gaussian_epsilon([TrainingPeriod(noise_multiplier, sampling_rate, int(steps),
                                            group_size=group_size)], delta, accountant)
  period = TrainingPeriod(noise_multiplier, sampling_rate, int(steps))
  k = int(group_size)
  for row_delta in np.geomspace(delta / k, delta / k * 1e-12, 241):
    row_epsilon = gaussian_epsilon([period], float(row_delta), accountant)
    epsilon, converted = group_privacy(row_epsilon, float(row_delta), k)
    if converted <= delta:
      return epsilon
  return math.inf


def composed_noise_multiplier(sigma1, sigma2):
  """σ of one Gaussian equivalent to two on the same sample: (σ1⁻² + σ2⁻²)^(−1/2) (Ghazi et al.,
  "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
  arXiv:2311.08357, §3.1)."""
  if sigma1 <= 0 or sigma2 <= 0:
    raise DprecError(f"noise multipliers must be > 0, got {sigma1} and {sigma2}")
  return (sigma1 ** -2 + sigma2 ** -2) ** -0.5


def quantile_gradient_noise_multiplier(noise_multiplier, count_noise_multiplier):
  """σ_Δ of the clipped sum when the same step also releases a quantile count of noise σ_b
  and sensitivity ½ (Andrew et al. 2021, Theorem 1): σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), so that
  the pair is one Gaussian of multiplier σ (`composed_noise_multiplier(σ_Δ, 2σ_b)`)."""
  if noise_multiplier <= 0 or not 2 * count_noise_multiplier > noise_multiplier:
    raise DprecError(f"the quantile count's noise 2·σ_b = {2 * count_noise_multiplier} must "
                     f"exceed the step's σ = {noise_multiplier} (> 0)")
  return (noise_multiplier ** -2 - (2 * count_noise_multiplier) ** -2) ** -0.5


def adafest_noise_multipliers(noise_multiplier, ratio=5.0):
  """Split σ into (σ1, σ2) with σ1 = r·σ2 and composed(σ1, σ2) = σ: σ2 = σ·sqrt(1 + r⁻²).

  σ1 noises the contribution map (selection), σ2 the gradient (Ghazi et al. 2023, §3.2).
  """
  if noise_multiplier <= 0 or ratio <= 0:
    raise DprecError(f"noise multiplier and ratio must be > 0, got {noise_multiplier}, {ratio}")
  sigma2 = noise_multiplier * math.sqrt(1.0 + ratio ** -2)
  return ratio * sigma2, sigma2


def dataset_sampling(dataset_size, batch_size, epochs=1.0):
  """(q, T) for batches of B out of N over E epochs: q = B/N, T = ceil(E·N/B)."""
  if dataset_size <= 0 or batch_size <= 0 or batch_size > dataset_size:
    raise DprecError(
        f"need 0 < batch size <= dataset size, got batch {batch_size}, dataset {dataset_size}")
  if epochs <= 0:
    raise DprecError(f"epochs must be > 0, got {epochs}")
  return batch_size / dataset_size, int(math.ceil(epochs * dataset_size / batch_size))
