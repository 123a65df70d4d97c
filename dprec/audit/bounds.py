"""ε lower bounds from canary guesses, two one-run analyses.

Each of m canaries is inserted independently with probability 1/2. From what the auditor
observes it guesses "in" for the `k_plus` highest-scored canaries and "out" for the `k_minus`
lowest and abstains on the rest: r = k_plus + k_minus guesses, v of them right.

Steinke, Nasr & Jagielski (2023, "Privacy auditing with one (1) training run", Thm. 3.1/5.2 and
their Algorithm 1), for any (ε, δ)-DP mechanism: v is stochastically dominated by
Binomial(r, e^ε/(1+e^ε)) up to a δ term,

    Pr[V ≥ v] ≤ β + 2mδ·α,   β = Pr[Bin(r, q) ≥ v],
                             α = max_{1≤i≤v} Pr[v − i ≤ Bin(r, q) < v] / i,   q = e^ε/(1+e^ε).

Mahloujifar, Melis & Chaudhuri (2024, "Auditing f-differential privacy in one run", the
`audit_rh_with_cap` procedure of their §4; jax-privacy's `auditing` module implements it) test
a tradeoff function f instead: if every canary's inclusion is f-DP, k "in" guesses with c right
have probability below β unless a recursion on (r, h) — lower bounds on the masses of the right
and wrong guesses, r pushed through x ↦ f(1 − x) — ends with r + h ≤ k/m. We test μ-GDP
(f(α) = Φ(Φ⁻¹(1 − α) − μ), Dong, Roth & Su 2022 Def. 2.7), whose (ε, δ) curve is
δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (their Cor. 2.13): the bound is the ε at δ of the
largest μ rejected. It is the tighter of the two when the mechanism's tradeoff curve is close to
a Gaussian one (many noisy steps: Dong et al.'s CLT), which is the claim tested; Steinke et al.'s
bound needs no such assumption.

Either way the lower bound at confidence c is the largest ε whose p-value is below 1 − c, and
guesses of independent runs pool (R runs of m canaries count as r = Σ r_j guesses out of R·m).
"""
import dataclasses
import math
from typing import Dict, Optional

import dp_accounting
import numpy as np
from scipy import optimize
from scipy import special
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


def gdp_delta(epsilon: float, mu: float) -> float:
  """δ(ε) of μ-GDP (Dong, Roth & Su 2022, Cor. 2.13), computed in the log domain."""
  if mu <= 0:
    return 0.0
  first = stats.norm.logcdf(-epsilon / mu + mu / 2)
  second = epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2)
  return float(np.exp(first) * -np.expm1(second - first)) if first > second else 0.0


def gdp_epsilon(mu: float, delta: float) -> float:
  """The smallest ε with δ(ε) ≤ `delta` for μ-GDP (0 for μ = 0)."""
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta}")
  if mu <= 0 or gdp_delta(0.0, mu) <= delta:
    return 0.0
  high = 1.0
  while gdp_delta(high, mu) > delta:
    high *= 2
  return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, high, xtol=1e-9))


def gdp_mu(epsilon: float, delta: float) -> float:
  """The μ whose GDP curve passes through (ε, δ): the Gaussian claim an (ε, δ) claim is read as."""
  if epsilon <= 0:
    return 0.0
  high = 1.0
  while gdp_delta(epsilon, high) < delta:
    high *= 2
  return float(optimize.brentq(lambda mu: gdp_delta(epsilon, mu) - delta, 1e-9, high,
                               xtol=1e-12))


def gdp_rejects(m: int, k: int, c: int, mu: float, significance: float) -> bool:
  """Whether c right among k "in" guesses on m canaries refutes μ-GDP at `significance`
  (Mahloujifar et al. 2024, `audit_rh_with_cap`)."""
  if not 0 <= c <= k <= m:
    raise ValueError(f"need 0 <= c <= k <= m, got c={c}, k={k}, m={m}")
  if c == 0:
    return False
  right, wrong = significance * c / m, significance * (k - c) / m
  for i in range(c - 1, -1, -1):
    # x ↦ f(1 − x) for f = G_μ: Φ(Φ⁻¹(x) − μ).
    pushed = max(wrong, float(special.ndtr(special.ndtri(right) - mu)))
    if pushed == wrong:
      break  # neither mass moves again
    right = min(right + i / (k - i) * (pushed - wrong), 1.0)
    wrong = pushed
  return right + wrong > k / m


def gdp_epsilon_lower_bound(m: int, k: int, c: int, delta: float, confidence: float = 0.95,
                            mu_max: float = 50.0, tolerance: float = 1e-6) -> float:
  """The ε at `delta` of the largest μ-GDP claim that c right of k "in" guesses refute at
  `confidence` (0 if none is): bisection on μ, rejection being monotone in it."""
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  significance = 1.0 - confidence
  if not gdp_rejects(m, k, c, tolerance, significance):
    return 0.0
  low, high = tolerance, mu_max
  if gdp_rejects(m, k, c, high, significance):
    return gdp_epsilon(high, delta)
  while high - low > tolerance:
    middle = 0.5 * (low + high)
    if gdp_rejects(m, k, c, middle, significance):
      low = middle
    else:
      high = middle
  return gdp_epsilon(low, delta)


def clopper_pearson_upper(count, n, alpha):
  """The Clopper–Pearson upper confidence limit at level 1 − `alpha` on a binomial rate from
  `count` successes in `n` trials (elementwise)."""
  count = np.asarray(count, np.float64)
  upper = stats.beta.ppf(1.0 - alpha, count + 1.0, np.maximum(n - count, 1e-300))
  return np.where(count >= n, 1.0, upper)


def threshold_error_counts(in_scores, out_scores):
  """(false positives, false negatives) of the rule "in if score ≥ t" at every distinct score t
  (and +∞), the counts of "out" canaries at or above t and of "in" canaries below it."""
  in_scores = np.sort(np.asarray(in_scores, np.float64))
  out_scores = np.sort(np.asarray(out_scores, np.float64))
  thresholds = np.append(np.unique(np.concatenate([in_scores, out_scores])), np.inf)
  false_negatives = np.searchsorted(in_scores, thresholds, side="left")
  false_positives = out_scores.size - np.searchsorted(out_scores, thresholds, side="left")
  return false_positives, false_negatives


def error_rate_limits(in_scores, out_scores, confidence: float):
  """(FPR, FNR) upper limits of the rule "in if score ≥ t" at every threshold t, Clopper–Pearson
  at (1 − confidence)/(2H) for H thresholds: all 2H hold together with probability
  ≥ `confidence` when the canaries are independent trials."""
  false_positives, false_negatives = threshold_error_counts(in_scores, out_scores)
  alpha = (1.0 - confidence) / (2 * false_positives.size)
  return (clopper_pearson_upper(false_positives, np.size(out_scores), alpha),
          clopper_pearson_upper(false_negatives, np.size(in_scores), alpha))


def clopper_pearson_epsilon(in_scores, out_scores, delta: float, confidence: float) -> float:
  """The counting bound (Jagielski, Ullman & Oprea 2020, "Auditing differentially private
  machine learning: how private is private SGD?", arXiv:2006.07709): at every threshold,
  ε ≥ log((TPR_lo − δ) / FPR_hi) (`error_rate_limits`); the best threshold's. Valid for canaries
  that are independent trials of the audited mechanism (white-box Dirac canaries are)."""
  fpr_high, fnr_high = error_rate_limits(in_scores, out_scores, confidence)
  tpr_low = 1.0 - fnr_high
  useful = tpr_low > delta
  if not np.any(useful):
    return 0.0
  return max(0.0, float(np.max(np.log(tpr_low[useful] - delta) - np.log(fpr_high[useful]))))


def gdp_fit_epsilon(in_scores, out_scores, delta: float, confidence: float) -> float:
  """The GDP fit of the scores (Nasr et al. 2023, "Tight auditing of differentially private
  machine learning", arXiv:2302.07956): a μ-GDP mechanism's errors satisfy FNR ≥ Φ(Φ⁻¹(1 − FPR)
  − μ) at every threshold (Dong, Roth & Su 2022, Def. 2.7), so with the `error_rate_limits`,
  μ ≥ max over thresholds of Φ⁻¹(1 − FPR_hi) − Φ⁻¹(FNR_hi); returned as the ε at `delta` of that
  μ. Valid for canaries that are independent trials of a mechanism whose tradeoff curve is
  Gaussian (white-box canaries after many noisy steps)."""
  fpr_high, fnr_high = error_rate_limits(in_scores, out_scores, confidence)
  mu = float(np.max(special.ndtri(1.0 - fpr_high) - special.ndtri(fnr_high)))
  return gdp_epsilon(mu, delta) if mu > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class SubsampledGaussian:
  """A claim that each canary's inclusion is `steps` Poisson-subsampled (rate `sampling_rate`)
  Gaussian steps at `noise_multiplier`: how DP-SGD, DP-FEST and DP-AdaFEST are accounted."""
  sampling_rate: float
  steps: int
  noise_multiplier: float

  def with_noise(self, noise_multiplier):
    return dataclasses.replace(self, noise_multiplier=noise_multiplier)

  def privacy_loss(self, pessimistic=True, discretization=1e-2):
    """dp_accounting's privacy loss distribution of the claim: `pessimistic` over-states δ(ε)
    (the claim read more weakly), else under-states it."""
    return dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        self.noise_multiplier, sampling_prob=self.sampling_rate,
        pessimistic_estimate=pessimistic,
        value_discretization_interval=discretization).self_compose(self.steps)

  def epsilon(self, delta):
    """The claim's ε at `delta`, from below (an optimistic, finely discretised PLD)."""
    return float(self.privacy_loss(False, 1e-3).get_epsilon_for_delta(delta))

  def tradeoff(self, alpha):
    """f(α), the tradeoff curve implied by the claim's privacy profile δ(ε) (Dong, Roth & Su
    2022, Prop. 2.12): max(0, sup over ε ≥ 0 of 1 − δ(ε) − e^ε·α and e^−ε·(1 − δ(ε) − α)), on a
    grid of ε (a sup over fewer ε is lower: the claim read more weakly, never more strongly)."""
    deltas = np.asarray(self.privacy_loss().get_delta_for_epsilon(_EPSILON_GRID))[None, :]
    growth = np.exp(_EPSILON_GRID)[None, :]
    alpha = np.asarray(alpha, np.float64)
    curve = np.empty_like(alpha)
    for start in range(0, alpha.size, 8192):  # bounded memory: 8192 × grid at a time
      block = alpha[start:start + 8192, None]
      curve[start:start + 8192] = np.max(np.maximum(1.0 - deltas - growth * block,
                                                    (1.0 - deltas - block) / growth), axis=1)
    return np.clip(curve, 0.0, 1.0)


_EPSILON_GRID = np.concatenate([np.linspace(0.0, 2.0, 40, endpoint=False),
                                np.linspace(2.0, 40.0, 153)])


def family_fit_epsilon(in_scores, out_scores, delta: float, confidence: float,
                       claim: SubsampledGaussian, iterations: int = 12) -> float:
  """The fit of the scores within the claim's own family (the GDP fit's argument with the
  tradeoff curve of `claim` at another noise multiplier σ' in place of G_μ): σ' is refuted when
  some threshold's `error_rate_limits` fall below its curve, FNR_hi < f_σ'(FPR_hi); refutation
  grows with σ', so bisection (on log σ', `iterations` halvings between claim σ/4 and 4σ) finds
  the least private refuted σ', and its ε at `delta` (dp_accounting, from below) is returned (0
  if even 4σ stands). Valid for canaries that are independent trials of a mechanism whose
  tradeoff curve is one of the family's; at a small sampling rate, where few steps sample each
  canary and the curve is far from Gaussian, it is much tighter than the GDP fit."""
  fpr_high, fnr_high = error_rate_limits(in_scores, out_scores, confidence)
  keep = (fpr_high < 1.0) & (fnr_high < 1.0)
  fpr_high, fnr_high = fpr_high[keep], fnr_high[keep]

  def refuted(noise_multiplier):
    return bool(np.any(fnr_high < claim.with_noise(noise_multiplier).tradeoff(fpr_high)))

  low, high = claim.noise_multiplier / 4.0, claim.noise_multiplier * 4.0
  if not fpr_high.size or not refuted(high):
    return 0.0
  if refuted(low):
    high = low  # the cap: the weakest claim tried is refuted too
  for _ in range(iterations if high > low else 0):
    middle = math.sqrt(low * high)
    low, high = (low, middle) if refuted(middle) else (middle, high)
  return claim.with_noise(high).epsilon(delta)


MIN_GUESSES = 16  # the fewest "in" guesses tried


def guess_counts(canaries: int):
  """The numbers of "in" guesses tried: m/2, m/4, ... down to `MIN_GUESSES` (or m/2 if fewer)."""
  counts = [canaries >> j for j in range(1, canaries.bit_length()) if canaries >> j >= MIN_GUESSES]
  return counts or [max(1, canaries // 2)]


@dataclasses.dataclass
class Bound:
  """One analysis' bound: ε, the score and guesses that gave it, and the ceiling (the bound if
  every guess were right, best over the guess counts tried)."""
  epsilon: float
  ceiling: float
  score: Optional[str] = None
  guesses: int = 0
  correct: int = 0


def best_bounds(scores: Dict[str, np.ndarray], included, delta: float, confidence: float,
                rng: np.random.Generator,
                claim: Optional[SubsampledGaussian] = None) -> Dict[str, Bound]:
  """Every estimator's best bound over the scores, each valid at `confidence`: "gdp"
  (Mahloujifar et al.'s one-run f-DP) and "steinke" (Steinke et al.'s one-run) from "in" guesses
  on the k highest scores for every k in `guess_counts`; "gdp_fit" (Nasr et al.) and
  "clopper_pearson" (the counting bound) from the in and out canaries' scores at every threshold,
  and with a `claim`, "family_fit" (`family_fit_epsilon`) from the same.
  Each estimator tests its H hypotheses (scores × guess counts, or scores × thresholds) at
  (1 − confidence)/H (Bonferroni), so its best is valid at `confidence`; the estimators are
  alternatives, each reported, not a maximum taken over them."""
  included = np.asarray(included, bool)
  m = included.size
  counts = guess_counts(m)
  level = 1.0 - (1.0 - confidence) / (len(scores) * len(counts))
  analyses = {"gdp": lambda k, c: gdp_epsilon_lower_bound(m, k, c, delta, level),
              "steinke": lambda k, c: epsilon_lower_bound(m, k, c, delta, level)}
  result = {}
  for name, bound_of in analyses.items():
    best = Bound(0.0, max(bound_of(k, k) for k in counts))
    for score, values in scores.items():
      for k in counts:
        _, correct = guess_membership(values, included, k, 0, rng)
        epsilon = bound_of(k, correct)
        if epsilon > best.epsilon:
          best = Bound(epsilon, best.ceiling, score, k, correct)
    result[name] = best
  level = 1.0 - (1.0 - confidence) / len(scores)
  estimators = [("gdp_fit", gdp_fit_epsilon), ("clopper_pearson", clopper_pearson_epsilon)]
  if claim is not None:
    estimators.append(("family_fit", lambda *args: family_fit_epsilon(*args, claim)))
  for name, estimator in estimators:
    best = Bound(0.0, estimator(np.ones(included.sum()), np.zeros(m - included.sum()), delta,
                                level))
    for score, values in scores.items():
      values = np.asarray(values, np.float64)
      epsilon = estimator(values[included], values[~included], delta, level)
      if epsilon > best.epsilon:
        best = Bound(epsilon, best.ceiling, score)
    result[name] = best
  return result
