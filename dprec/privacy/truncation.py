"""What a cap on Poisson batch sizes costs: truncated Poisson subsampling, charged as δ.

Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling" (NeurIPS 2024,
arXiv:2411.04205, §4) cap each Poisson batch at B_max rows (a fixed shape for the accelerator)
and absorb the cap into δ. The argument: couple the truncated run A_t with the exact one A on
the same randomness; they differ only on the event E that some step's Poisson batch holds more
than B_max rows. For data sets D, D' differing in one example, any set S of outcomes, and A
(ε, δ)-DP,

    P[A_t(D) ∈ S] ≤ P[A(D) ∈ S] + P_D[E] ≤ e^ε·P[A(D') ∈ S] + δ + P_D[E]
                  ≤ e^ε·P[A_t(D') ∈ S] + δ + P_D[E] + e^ε·P_D'[E],

so A_t is (ε, δ + (1 + e^ε)·p)-DP with p ≥ P_D[E], P_D'[E]. The steps sample independently and
a step's batch size is Binomial(n, q) over the n examples of the data set, whose tail grows with
n; a neighbour of the N-example training set has at most N + 1, so

    p = 1 − (1 − P[Binomial(N + 1, q) > B_max])^T      (Chua et al. bound it by T times the tail).

ε here is the run's whole ε, which its budget bounds; the δ is charged to the ledger as an
(0, δ_trunc) release, so training keeps δ − δ_trunc (`PrivacyLedger.charge_approximate`).
"""
import math

from scipy import stats

from dprec.errors import DprecError

LABEL = "poisson truncation"  # the ledger charge's label
# A cap may cost at most this share of the run's δ (it is refused below the smallest that
# does): σ is then calibrated at ≥ 0.9·δ, which moves it by well under 1%.
MAX_DELTA_SHARE = 0.1


def exceed_probability(num_examples: int, sampling_rate: float, steps: int,
                       max_batch_size: int) -> float:
  """p: the probability that any of `steps` Poisson batches at rate q over N + 1 examples holds
  more than `max_batch_size` rows (module docstring)."""
  tail = float(stats.binom.sf(max_batch_size, num_examples + 1, sampling_rate))
  return -math.expm1(steps * math.log1p(-tail)) if tail < 1 else 1.0


def truncation_delta(num_examples: int, sampling_rate: float, steps: int, max_batch_size: int,
                     epsilon: float) -> float:
  """δ_trunc = (1 + e^ε)·p, the δ a run of ε pays for truncating its batches to B_max."""
  return (1.0 + math.exp(epsilon)) * exceed_probability(num_examples, sampling_rate, steps,
                                                        max_batch_size)


def smallest_max_batch_size(num_examples: int, sampling_rate: float, steps: int,
                            epsilon: float, delta_allowed: float) -> int:
  """The smallest B_max whose δ_trunc is at most `delta_allowed` (δ_trunc falls as B_max
  grows; at B_max = N + 1 it is 0)."""
  low, high = 0, num_examples + 1
  while low < high:
    middle = (low + high) // 2
    if truncation_delta(num_examples, sampling_rate, steps, middle, epsilon) <= delta_allowed:
      high = middle
    else:
      low = middle + 1
  return low


def checked_delta(num_examples: int, sampling_rate: float, steps: int, max_batch_size: int,
                  epsilon: float, delta: float) -> float:
  """δ_trunc of a planned cap; refuses, in one line, a cap that would cost more than
  `MAX_DELTA_SHARE` of the run's δ, naming the smallest one that does not."""
  cost = truncation_delta(num_examples, sampling_rate, steps, max_batch_size, epsilon)
  if cost > MAX_DELTA_SHARE * delta:
    smallest = smallest_max_batch_size(num_examples, sampling_rate, steps, epsilon,
                                       MAX_DELTA_SHARE * delta)
    raise DprecError(
        f"--max-batch-size {max_batch_size}: some step's Poisson batch (expected "
        f"{sampling_rate * num_examples:.4g} rows) exceeds it with a chance that costs δ "
        f"{cost:.3g} > {MAX_DELTA_SHARE:g}·δ = {MAX_DELTA_SHARE * delta:.3g}; the plan allows "
        f"a cap of at least {smallest}")
  return cost
