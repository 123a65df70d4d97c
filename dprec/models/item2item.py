"""The item-to-item recommender: next-item scores from released item-to-item statistics.

Given a released pair matrix S̃ [M + 1, M + 1] (`dprec.privacy.item_pairs`: S̃[i, j] ≈ how much
users went from i to j) and item popularities n̂ [M + 1] (the DP histogram of users per item),
the score of item j after a history ending in h_1 (most recent), h_2, ... is

    score(j) = Σ_{k ≤ R} ρ^(k−1) · S̃[h_k, j] / max(n̂_j, 1)^α  +  λ · n̂_j / max n̂,

an item-kNN / transition score over the R most recent items (decay ρ), normalised for popularity
by α (0: raw co-counts, which favour popular items), with the popularity term λ ordering the items
no released pair reaches (λ small: it only breaks ties). Reads only released values.
"""
import dataclasses

import numpy as np
import scipy.sparse
import scipy.sparse.linalg

from dprec.errors import DprecError


@dataclasses.dataclass(frozen=True)
class Item2ItemConfig:
  """Scoring settings (defaults selected on Amazon Games' validation items,
  docs/experiments/seqrec_item2item.md)."""
  recent: int = 3
  recent_decay: float = 0.5
  popularity_exponent: float = 0.0
  popularity_weight: float = 1e-3

  def __post_init__(self):
    if self.recent < 1 or not 0 < self.recent_decay <= 1 or self.popularity_exponent < 0 \
        or self.popularity_weight < 0:
      raise DprecError(f"item2item scoring needs recent >= 1, decay in (0, 1], exponent >= 0 "
                       f"and popularity weight >= 0, got {self}")


class Item2ItemModel:
  """`score_items(histories)` of the module docstring; `matrix` csr [M + 1, M + 1] and
  `popularity` [M + 1] are released values only."""

  def __init__(self, matrix, popularity, config: Item2ItemConfig = Item2ItemConfig()):
    matrix = scipy.sparse.csr_matrix(matrix, dtype=np.float32)
    popularity = np.asarray(popularity, np.float64)
    if matrix.shape != (len(popularity), len(popularity)):
      raise DprecError(f"the pair matrix {matrix.shape} and the {len(popularity)} popularities "
                       "must both cover items 0..M")
    self.config, self.matrix = config, matrix
    floored = np.maximum(popularity, 1.0)
    self.column_scale = (floored ** -config.popularity_exponent).astype(np.float32)[1:]
    self.popularity_score = (config.popularity_weight * np.maximum(popularity, 0.0)
                             / max(popularity.max(), 1e-12)).astype(np.float32)[1:]

  @property
  def num_items(self):
    return self.matrix.shape[0] - 1

  def history_weights(self, histories):
    """csr [b, M + 1]: ρ^(k−1) on each user's k-th most recent item (k ≤ R; padding 0 skipped,
    a repeated item adds up)."""
    histories = np.asarray(histories, np.int64)
    recent = histories[:, ::-1][:, :self.config.recent]
    users, slots = np.nonzero(recent > 0)
    return scipy.sparse.csr_matrix(
        (self.config.recent_decay ** slots.astype(np.float32), (users, recent[users, slots])),
        shape=(len(histories), self.num_items + 1))

  def transition_scores(self, histories):
    """float32 [b, M]: Σ_k ρ^(k−1)·S̃[h_k, j] for items 1..M (no normalisation, no prior)."""
    return (self.history_weights(histories) @ self.matrix)[:, 1:].toarray()

  def score_items(self, histories):
    """float32 [b, M]: the scores of items 1..M after each left-padded history."""
    return self.transition_scores(histories) * self.column_scale + self.popularity_score

  def item_factors(self, dim):
    """float32 [M + 1, d]: U_d·√Σ_d of the truncated SVD of (S̃ + S̃ᵀ)/2 (the released
    co-occurrences, symmetrised), rows of items no released pair touches (and padding) 0."""
    symmetric = ((self.matrix + self.matrix.T) * 0.5).astype(np.float64)
    factors = np.zeros((self.num_items + 1, dim), np.float32)
    touched = np.flatnonzero(symmetric.getnnz(axis=1))
    rank = min(dim, len(touched) - 1)
    if rank < 1:
      return factors
    # A public start for ARPACK (post-processing); a Generator, which scipy accepts with
    # numpy 1.26 (the legacy leg) as well as 2.x, unlike an int seed there.
    left, values, _ = scipy.sparse.linalg.svds(symmetric[touched][:, touched], k=rank,
                                               random_state=np.random.default_rng(0))
    factors[touched, :rank] = left * np.sqrt(values)
    return factors
