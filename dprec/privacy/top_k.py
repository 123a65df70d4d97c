"""DP top-k bucket selection for DP-FEST (note 001 §2.1, Algorithm 2 after [DR21]), charged honestly.

Adding Gumbel noise of scale b to every count and keeping the k largest is distributed exactly as
k successive exponential-mechanism draws without replacement with P(i) ∝ exp(h_i / b). Counts are
monotone with sensitivity 1 when each example adds at most one to one bucket per feature, so each
draw is (1/b)-DP and the k draws cost k/b by basic composition, not 1/b as the paper charged.
The candidate set (every bucket of the feature, counted or not) must not depend on the data.
"""
import dataclasses
from typing import List, Sequence, Union

import numpy as np

from dprec.errors import DprecError


def top_k_selection_cost(k, epsilon_per_draw):
  """Pure ε of k exponential-mechanism draws at ε_draw each (basic composition): k·ε_draw."""
  if k < 0 or epsilon_per_draw < 0:
    raise DprecError(f"k and epsilon per draw must be >= 0, got {k} and {epsilon_per_draw}")
  return k * epsilon_per_draw


def gumbel_top_k(counts, k, epsilon, rng: np.random.Generator):
  """Indices of k buckets chosen by one-shot Gumbel top-k, best first; total cost `epsilon`.

  Each of the k draws gets ε/k, i.e. Gumbel scale k/ε.
  """
  counts = np.asarray(counts, dtype=np.float64)
  if counts.ndim != 1:
    raise DprecError(f"counts must be one-dimensional, got shape {counts.shape}")
  if not 1 <= k <= counts.size:
    raise DprecError(f"k must be in [1, {counts.size}] (the number of buckets), got {k}")
  if not epsilon > 0:
    raise DprecError(f"selection epsilon must be > 0, got {epsilon}")
  noisy = counts + rng.gumbel(scale=k / epsilon, size=counts.size)
  top = np.argpartition(-noisy, k - 1)[:k]
  return top[np.argsort(-noisy[top], kind="stable")]


def feature_counts(ids, vocab_sizes):
  """Per-feature bucket counts from ids[n, p] (one bucket per example per feature: sensitivity 1)."""
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
  """Buckets kept per feature, and what choosing them cost."""
  indices: List[np.ndarray]
  k_per_feature: List[int]
  epsilon: float
  epsilon_per_feature: float
  epsilon_per_draw: List[float]

  def summary(self):
    return {"epsilon": self.epsilon, "epsilon_per_feature": self.epsilon_per_feature,
            "k_per_feature": self.k_per_feature, "epsilon_per_draw": self.epsilon_per_draw,
            "selected": int(sum(len(i) for i in self.indices))}


def select_top_k_per_feature(counts: Sequence[np.ndarray], k: Union[int, Sequence[int]], epsilon,
                             rng: np.random.Generator):
  """Gumbel top-k on each of p features with ε/p each: total ε, as one example touches all p.

  `k` is a total split equally, int(k/p) per feature (note 001 §2.1), or a list per feature.
  """
  p = len(counts)
  if p == 0:
    raise DprecError("need counts for at least one feature")
  ks = [int(k) // p] * p if np.isscalar(k) else [int(x) for x in k]
  if len(ks) != p or min(ks) < 1:
    raise DprecError(f"need k >= 1 for each of the {p} features, got {ks}")
  if not epsilon > 0:
    raise DprecError(f"selection epsilon must be > 0, got {epsilon}")
  per_feature = epsilon / p
  indices = [gumbel_top_k(c, min(kf, len(c)), per_feature, rng) for c, kf in zip(counts, ks)]
  ks = [len(i) for i in indices]
  per_draw = [per_feature / kf for kf in ks]
  total = sum(top_k_selection_cost(kf, e) for kf, e in zip(ks, per_draw))
  return Selection(indices=indices, k_per_feature=ks, epsilon=total,
                   epsilon_per_feature=per_feature, epsilon_per_draw=per_draw)
