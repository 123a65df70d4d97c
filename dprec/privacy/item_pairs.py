"""DP item-to-item statistics: per-user weighted (item, later item) pairs, released once with
Gaussian noise and thresholded (after McSherry & Mironov 2009, a DP item covariance for the
Netflix prize; the threshold as DP-AdaFEST's selection, Ghazi et al., "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1, on
pairs).

Statistic. A user's sequence s_1..s_n (its last `max_items` items) contributes, for every gap
g = 1..W, the directed pair (s_t, s_{t+g}) with weight γ^(g−1) (self-pairs dropped); equal pairs
add up; the user's vector c_u of distinct pairs is then scaled to ‖c_u‖₂ = 1. The clean matrix is
S = Σ_u c_u, so adding or removing one user moves S by exactly c_u: L2 sensitivity 1, whatever
the user's length (without the scaling a long user moves S by up to √(Σ counts²)).

Release. Every off-diagonal cell (i, j) of the M×M matrix gets N(0, σ²), and only cells whose
noisy value reaches τ are released (the rest read 0): the Gaussian mechanism with noise
multiplier σ (`accounting.gaussian_mechanism_period`), then post-processing. The untouched cells
are never materialised: their number above τ is Binomial(U, Ψ(τ/σ)) (U untouched cells), their
places uniform without replacement among the untouched cells and their values the normal's tail
above τ, which is exactly the distribution of thresholding the full noisy matrix.

Dense release (`noisy_dense`, `thresholded`): the same mechanism over a small item set with
every cell's noisy value kept, so that two releases of the same cells can be combined by
inverse-variance weighting (`combine`, `train seqrec --model auto`'s top-up) before the
threshold; thresholding the dense noisy matrix is the distribution `release` samples.

The noise must come from the run's secret randomness: callers pass a numpy `Generator` from the
run's key, never a public seed.
"""
import dataclasses
import math

import numpy as np
import scipy.sparse
import scipy.stats

from dprec.errors import DprecError

SENSITIVITY = 1.0


def _check_items(sequence, num_items):
  sequence = np.asarray(sequence, np.int64)
  if sequence.ndim != 1 or (sequence.size and (sequence.min() < 1
                                                or sequence.max() > num_items)):
    raise DprecError(f"a sequence must hold item ids in 1..{num_items}, got {sequence[:10]}")
  return sequence


def pair_weights(sequence, window, decay):
  """(rows, cols, weights) of one sequence's distinct directed pairs (s_t, s_{t+g}), g ≤ W,
  each occurrence weighing decay^(g−1), before the user's scaling (self-pairs dropped)."""
  sequence = np.asarray(sequence, np.int64)
  gaps = range(1, min(window, len(sequence) - 1) + 1)
  if not gaps:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
  rows = np.concatenate([sequence[:-g] for g in gaps])
  cols = np.concatenate([sequence[g:] for g in gaps])
  weights = np.concatenate([np.full(len(sequence) - g, decay ** (g - 1)) for g in gaps])
  other = rows != cols
  key = rows[other] * (int(sequence.max()) + 1) + cols[other]
  distinct, inverse = np.unique(key, return_inverse=True)
  return (distinct // (int(sequence.max()) + 1), distinct % (int(sequence.max()) + 1),
          np.bincount(inverse, weights=weights[other]))


def user_contribution(sequence, window, decay):
  """`pair_weights` scaled to L2 norm 1 (empty for a user without a pair)."""
  rows, cols, weights = pair_weights(sequence, window, decay)
  if weights.size:
    weights = weights / np.linalg.norm(weights)
  return rows, cols, weights


def pair_statistics(sequences, num_items, window=2, decay=0.5, max_items=None):
  """csr float64 [M + 1, M + 1] (0: padding, empty): S = Σ_u `user_contribution` of each user's
  last `max_items` items (None: all). Sensitivity 1 under adding or removing a user."""
  if window < 1 or not 0 < decay <= 1:
    raise DprecError(f"the pair window must be >= 1 and the decay in (0, 1], got {window}, "
                     f"{decay}")
  parts = [user_contribution(_check_items(s, num_items)[-max_items if max_items else 0:],
                             window, decay) for s in sequences]
  rows, cols, weights = (np.concatenate([p[k] for p in parts] + [np.zeros(0, d)])
                         for k, d in ((0, np.int64), (1, np.int64), (2, np.float64)))
  return scipy.sparse.csr_matrix((weights, (rows, cols)), shape=(num_items + 1, num_items + 1))


@dataclasses.dataclass
class ReleasedPairs:
  """The thresholded noisy matrix [M + 1, M + 1] (csr) and how it was released (public)."""
  matrix: scipy.sparse.csr_matrix
  noise_multiplier: float
  threshold: float
  false_positive_rate: float

  def summary(self):
    return {"released_pairs": int(self.matrix.nnz), "noise_multiplier": self.noise_multiplier,
            "threshold": self.threshold, "false_positive_rate": self.false_positive_rate,
            "sensitivity": SENSITIVITY}


def _untouched_cells(touched, count, cells, rng):
  """`count` distinct cell indices of [0, cells) outside the sorted unique `touched`, uniform."""
  picked = np.sort(rng.choice(cells - touched.size, size=count, replace=False))
  # The k-th untouched cell is k plus the number of touched cells at or before it.
  before = touched - np.arange(touched.size)
  return picked + np.searchsorted(before, picked, side="right")


def release(statistics, noise_multiplier, threshold, rng: np.random.Generator) -> ReleasedPairs:
  """`statistics` (from `pair_statistics`) with N(0, σ²) on every off-diagonal cell of items
  1..M, keeping the cells whose noisy value is ≥ `threshold` (module docstring); σ·SENSITIVITY
  is the noise's std."""
  if not noise_multiplier > 0:
    raise DprecError(f"the pair release's noise multiplier must be > 0, got {noise_multiplier}")
  num_items = statistics.shape[0] - 1
  std = noise_multiplier * SENSITIVITY
  clean = statistics.tocoo()
  # Cell index over the M·(M − 1) off-diagonal cells of items 1..M, row-major.
  rows, cols = clean.row.astype(np.int64) - 1, clean.col.astype(np.int64) - 1
  touched = np.sort(rows * (num_items - 1) + cols - (cols > rows))
  order = np.argsort(rows * (num_items - 1) + cols - (cols > rows))
  noisy = clean.data[order] + rng.normal(0.0, std, clean.nnz)
  rate = 0.5 * math.erfc(threshold / std / math.sqrt(2.0))
  cells = num_items * (num_items - 1)
  extra = int(rng.binomial(cells - touched.size, rate))
  false_cells = _untouched_cells(touched, extra, cells, rng)
  false_values = scipy.stats.truncnorm.rvs(threshold / std, np.inf, scale=std, size=extra,
                                           random_state=rng)
  kept = noisy >= threshold
  index = np.concatenate([touched[kept], false_cells])
  row = index // (num_items - 1)
  col = index % (num_items - 1)
  col = col + (col >= row)
  matrix = scipy.sparse.csr_matrix(
      (np.concatenate([noisy[kept], false_values]), (row + 1, col + 1)),
      shape=statistics.shape)
  return ReleasedPairs(matrix, float(noise_multiplier), float(threshold), rate)


def noisy_dense(statistics, noise_multiplier, rng: np.random.Generator):
  """float64 [K + 1, K + 1]: `statistics` (csr over ids 0..K, 0 the padding) plus N(0, σ²) on
  every off-diagonal cell of items 1..K (the padding row and column and the diagonal stay 0)."""
  if not noise_multiplier > 0:
    raise DprecError(f"the pair release's noise multiplier must be > 0, got {noise_multiplier}")
  noisy = statistics.toarray().astype(np.float64)
  size = noisy.shape[0] - 1
  noise = rng.normal(0.0, noise_multiplier * SENSITIVITY, (size, size))
  np.fill_diagonal(noise, 0.0)
  noisy[1:, 1:] += noise
  return noisy


def combine(releases):
  """(values, σ) of the inverse-variance weighted mean of [(values, σ_k)], releases of the same
  query: Σ_k w_k·values_k with w_k ∝ 1/σ_k², whose noise has 1/σ² = Σ_k 1/σ_k² (one Gaussian
  release at that σ: the Gaussian mechanisms' μ = 1/σ compose as √(Σ μ_k²))."""
  precisions = np.array([1.0 / sigma ** 2 for _, sigma in releases])
  values = sum(p * np.asarray(v, np.float64) for p, (v, _) in zip(precisions, releases))
  return values / precisions.sum(), float(1.0 / math.sqrt(precisions.sum()))


def thresholded(noisy, noise_multiplier, threshold) -> ReleasedPairs:
  """The cells of a dense noisy matrix (`noisy_dense`, `combine`) at or above `threshold`
  (post-processing), as a `ReleasedPairs` of the same shape."""
  kept = np.where(noisy >= threshold, noisy, 0.0)
  kept[0, :] = kept[:, 0] = 0.0
  np.fill_diagonal(kept, 0.0)
  rate = 0.5 * math.erfc(threshold / (noise_multiplier * SENSITIVITY) / math.sqrt(2.0))
  return ReleasedPairs(scipy.sparse.csr_matrix(kept), float(noise_multiplier),
                       float(threshold), rate)
