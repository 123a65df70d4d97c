"""DP top-k bucket selection for DP-FEST (Ghazi et al., "Sparsity-Preserving Differentially
Private Training of Large Embedding Models", arXiv:2311.08357, §2.1, Algorithm 2, after Durfee and
Rogers, "One-shot DP top-k mechanisms", differentialprivacy.org/one-shot-top-k, 2021), charged
honestly.

Adding Gumbel noise of scale b to every count and keeping the k largest is distributed exactly as
k successive exponential-mechanism draws without replacement with P(i) ∝ exp(h_i / b). Counts are
monotone with sensitivity 1 when each example adds at most one to one bucket per feature, so each
draw is (1/b)-DP and the k draws cost k/b by basic composition, not 1/b as the paper charged.
Each draw is also (1/b)-bounded-range, hence (1/b)²/8-zCDP [Cesar & Rogers 2021], so k draws are
k/(8b²)-zCDP: for large k far cheaper at a small δ (Ghazi et al. 2023, §3.1: ρ ≈ 4.8e-4, ε ≈ 0.18 at
δ=1e-7 where basic composition gives 10). The candidate set (every bucket of the feature, counted or
not) must not depend on the data.
"""
import dataclasses
import math
from typing import List, Sequence, Union

import numpy as np

from dprec.errors import DprecError


def zcdp_of_draws(k, epsilon_per_draw):
  """ρ of k exponential-mechanism draws: each ε-bounded-range draw is ε²/8-zCDP."""
  return k * epsilon_per_draw ** 2 / 8.0


def zcdp_to_dp(rho, delta):
  """ε at δ of a ρ-zCDP mechanism: ρ + 2·sqrt(ρ·ln(1/δ)) [Bun & Steinke 2016, Prop. 1.3]."""
  if not 0 < delta < 1:
    raise DprecError(f"delta must be in (0, 1), got {delta}")
  return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_budget(epsilon, delta):
  """Largest ρ with zcdp_to_dp(ρ, δ) <= ε: (sqrt(ln(1/δ) + ε) − sqrt(ln(1/δ)))²."""
  log_term = math.log(1.0 / delta)
  return (math.sqrt(log_term + epsilon) - math.sqrt(log_term)) ** 2


def top_k_selection_cost(k, epsilon_per_draw, delta=0.0):
  """ε of k exponential-mechanism draws at ε_draw each.

  δ = 0: pure ε by basic composition, k·ε_draw. δ > 0: the smaller of that and the zCDP
  bound converted at δ (the charge is then (ε, δ)-DP).
  """
  if k < 0 or epsilon_per_draw < 0:
    raise DprecError(f"k and epsilon per draw must be >= 0, got {k} and {epsilon_per_draw}")
  basic = k * epsilon_per_draw
  if delta == 0 or basic == 0:
    return basic
  return min(basic, zcdp_to_dp(zcdp_of_draws(k, epsilon_per_draw), delta))


ABSENT = -1  # a slot won by a candidate outside `counts` (see `gumbel_top_k`'s `domain`)


def gumbel_top_k(counts, k, epsilon, rng: np.random.Generator, domain=None):
  """Indices of k buckets chosen by one-shot Gumbel top-k, best first; total cost `epsilon`.

  Each of the k draws gets ε/k, i.e. Gumbel scale k/ε. `domain` (≥ len(counts)): the candidates
  are `domain` buckets, the `domain − len(counts)` not in `counts` counting 0, so that the
  candidate set does not depend on which buckets the data touched (a data-dependent candidate set
  would let one example make its bucket selectable). Their k largest noisy counts are the k
  largest of that many iid Gumbels, drawn exactly from the order statistics of exponentials
  (Gumbel = −scale·log Exp(1); Rényi's representation): no domain-sized array. A slot one of
  them wins is `ABSENT` in the result.
  """
  counts = np.asarray(counts, dtype=np.float64)
  if counts.ndim != 1:
    raise DprecError(f"counts must be one-dimensional, got shape {counts.shape}")
  domain = counts.size if domain is None else int(domain)
  if domain < counts.size:
    raise DprecError(f"domain {domain} is smaller than the {counts.size} counted buckets")
  if not 1 <= k <= domain:
    raise DprecError(f"k must be in [1, {domain}] (the number of buckets), got {k}")
  if not epsilon > 0:
    raise DprecError(f"selection epsilon must be > 0, got {epsilon}")
  scale = k / epsilon
  noisy = counts + rng.gumbel(scale=scale, size=counts.size)
  absent = domain - counts.size
  if absent:
    draws = min(k, absent)
    smallest = np.cumsum(rng.exponential(size=draws) / (absent - np.arange(draws)))
    noisy = np.concatenate([noisy, -scale * np.log(smallest)])
  top = np.argpartition(-noisy, k - 1)[:k]
  top = top[np.argsort(-noisy[top], kind="stable")]
  return np.where(top < counts.size, top, ABSENT)


def feature_counts(ids, vocab_sizes):
  """Per-feature bucket counts from ids[n, p] (one bucket per example per feature:
  sensitivity 1)."""
  ids = np.asarray(ids)
  if ids.ndim != 2 or ids.shape[1] != len(vocab_sizes):
    raise DprecError(f"ids must have shape [n, {len(vocab_sizes)}], got {ids.shape}")
  counts = []
  for feature, size in enumerate(vocab_sizes):
    column = ids[:, feature]
    if column.size and (column.min() < 0 or column.max() >= size):
      raise DprecError(f"feature {feature}: ids must be in [0, {size}), got "
                       f"[{column.min()}, {column.max()}]")
    counts.append(np.bincount(column, minlength=size))
  return counts


@dataclasses.dataclass
class Selection:
  """Buckets kept per feature, and what choosing them cost: (epsilon, delta)-DP."""
  indices: List[np.ndarray]
  k_per_feature: List[int]
  epsilon: float
  delta: float
  epsilon_per_draw: List[float]
  accounting: str

  def summary(self):
    return {"epsilon": self.epsilon, "delta": self.delta, "accounting": self.accounting,
            "k_per_feature": self.k_per_feature, "epsilon_per_draw": self.epsilon_per_draw,
            "selected": int(sum(len(i) for i in self.indices))}


def split_selection_budget(ks: Sequence[int], epsilon, delta=0.0):
  """(ε per draw of each feature, total ε charged) for k_f draws on each of p features.

  One example touches every feature. δ = 0: pure, ε/p per feature, ε/(p·k_f) per draw (basic
  composition). δ > 0: every one of the K = Σ k_f draws gets sqrt(8ρ/K), ρ the zCDP budget of
  (ε, δ).
  """
  p = len(ks)
  if delta == 0:
    per_draw = [epsilon / p / kf for kf in ks]
    return per_draw, sum(top_k_selection_cost(kf, e) for kf, e in zip(ks, per_draw))
  per_draw = [math.sqrt(8.0 * zcdp_budget(epsilon, delta) / sum(ks))] * p
  return per_draw, zcdp_to_dp(sum(zcdp_of_draws(kf, e) for kf, e in zip(ks, per_draw)), delta)


def select_top_k_per_feature(counts: Sequence[np.ndarray], k: Union[int, Sequence[int]], epsilon,
                             rng: np.random.Generator, delta=0.0, domain=None):
  """Gumbel top-k on each of p features within a total (ε, δ): one example touches all p.

  `k` is a total split equally, int(k/p) per feature (Ghazi et al. 2023, §3.1), or a list per
  feature; the budget is split by `split_selection_budget`. `domain`: candidates per feature beyond
  the counted ones (`gumbel_top_k`); slots they win are `ABSENT`.
  """
  p = len(counts)
  if p == 0:
    raise DprecError("need counts for at least one feature")
  ks = [int(k) // p] * p if np.isscalar(k) else [int(x) for x in k]
  if len(ks) != p or min(ks) < 1:
    raise DprecError(f"need k >= 1 for each of the {p} features, got {ks}")
  if not epsilon > 0:
    raise DprecError(f"selection epsilon must be > 0, got {epsilon}")
  if not 0 <= delta < 1:
    raise DprecError(f"selection delta must be in [0, 1), got {delta}")
  ks = [min(kf, len(c) if domain is None else domain) for c, kf in zip(counts, ks)]
  per_draw, cost = split_selection_budget(ks, epsilon, delta)
  indices = [gumbel_top_k(c, kf, kf * e, rng, domain) for c, kf, e in zip(counts, ks, per_draw)]
  return Selection(indices=indices, k_per_feature=ks, epsilon=cost, delta=delta,
                   epsilon_per_draw=per_draw, accounting="zcdp" if delta else "basic")
