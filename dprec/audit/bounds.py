"""ε lower bounds from canary guesses: the one-run audit of Steinke, Nasr & Jagielski (2023,
"Privacy auditing with one (1) training run", Thm. 3.1/5.2 and their Algorithm 1).

Each of m canaries is inserted independently with probability 1/2. From the scores of the
trained model the auditor guesses "in" for the `k_plus` highest and "out" for the `k_minus`
lowest and abstains on the rest: r = k_plus + k_minus guesses, v of them right. If training is
(ε, δ)-DP, v is stochastically dominated by Binomial(r, e^ε/(1+e^ε)) up to a δ term:

    Pr[V ≥ v] ≤ β + 2mδ·α,   β = Pr[Bin(r, q) ≥ v],
                             α = max_{1≤i≤v} Pr[v − i ≤ Bin(r, q) < v] / i,   q = e^ε/(1+e^ε).

The lower bound at confidence c is the largest ε whose p-value is still below 1 − c: every ε
below it is rejected. Guesses of independent runs pool (each run's guesses are dominated
independently), so R runs of m canaries count as r = Σ r_j guesses out of R·m canaries.
"""
import math

import numpy as np
from scipy import stats


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
  """Pr[≥ v of r guesses right] under (ε, δ)-DP with m canaries (the bound above)."""
  if not 0 <= v <= r <= m:
    raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
  if epsilon < 0 or not 0 <= delta <= 1:
    raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
  q = 1.0 / (1.0 + math.exp(-epsilon))
  beta = float(stats.binom.sf(v - 1, r, q))
  if delta == 0 or v == 0:
    return beta
  below = np.cumsum(stats.binom.pmf(v - np.arange(1, v + 1), r, q))  # Pr[v-i <= Bin < v]
  alpha = float(np.max(below / np.arange(1, v + 1)))
  return min(1.0, beta + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, confidence: float = 0.95,
                        epsilon_max: float = 100.0, tolerance: float = 1e-6) -> float:
  """The largest ε rejected at `confidence` (0 if even ε = 0 is not), by bisection: the
  p-value grows with ε."""
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  level = 1.0 - confidence
  if one_run_p_value(m, r, v, 0.0, delta) >= level:
    return 0.0
  low, high = 0.0, epsilon_max
  if one_run_p_value(m, r, v, high, delta) < level:
    return high
  while high - low > tolerance:
    middle = 0.5 * (low + high)
    if one_run_p_value(m, r, v, middle, delta) < level:
      low = middle
    else:
      high = middle
  return low


def guess_membership(scores, included, k_plus: int, k_minus: int, rng=None):
  """(r, v): guess "in" for the `k_plus` highest scores and "out" for the `k_minus` lowest
  (ties broken at random by `rng`, so equal scores carry no information); v counts the right
  guesses against the boolean `included`."""
  scores, included = np.asarray(scores, np.float64), np.asarray(included, bool)
  if scores.shape != included.shape or scores.ndim != 1:
    raise ValueError("scores and included must be 1-D arrays of the same length")
  if k_plus < 0 or k_minus < 0 or k_plus + k_minus > scores.size:
    raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= {scores.size}")
  rng = rng if rng is not None else np.random.default_rng()
  order = np.lexsort((rng.random(scores.size), scores))  # ascending score, random tie-break
  right = int(np.sum(~included[order[:k_minus]]))
  right += int(np.sum(included[order[scores.size - k_plus:]])) if k_plus else 0
  return k_plus + k_minus, right
