"""The item-to-item score as a fixed prior on a sequential model's next-item logits.

After a history ending in h_1 (most recent), h_2, ..., item j scores

    f(h)_j + w · Σ_{k ≤ R} ρ^(k−1) · S̃[h_k, j],

where f(h) are the model's logits (e.g. the DP transformer's) and S̃ the released pair matrix
of `dprec.models.item2item` (`Item2ItemModel.transition_scores`: the same recent items R and
decay ρ). The prior is fixed: it is not trained, and it reads only the released matrix, so
adding it is post-processing of released values. w = 0 is the model alone, a large w ranks the
items a released pair reaches by the prior and orders the rest by the model.

`TrainingPriorConfig` puts the same term w·prior in the logits the model is trained with
(`dprec.models.seqrec.SeqRecConfig.training_prior`), so the model learns the residual of the
prior; `recent_pair_scores` computes it in the graph from the released matrix packed by
`packed_pairs` (still post-processing of released values).
"""
import dataclasses

import numpy as np
import scipy.sparse
import tensorflow as tf

from dprec.errors import DprecError
from dprec.models import ranking_metrics
from dprec.models.item2item import Item2ItemModel


class LogitPrior:
  """`score_items(histories)` of the module docstring for one weight, `score_weights` for
  several at once (the model run once)."""

  def __init__(self, model, prior: Item2ItemModel, weight=0.0):
    if not weight >= 0:
      raise DprecError(f"the prior weight must be >= 0, got {weight}")
    self.model_scores = ranking_metrics.scorer(model)
    self.prior, self.weight = prior, float(weight)

  def score_weights(self, histories, weights):
    """[float32 [b, M] per weight]: the model's logits plus each weight times the prior."""
    logits = np.asarray(self.model_scores(histories), np.float32)
    if not any(weights):
      return [logits for _ in weights]
    prior = self.prior.transition_scores(histories)
    return [logits + np.float32(weight) * prior for weight in weights]

  def score_items(self, histories):
    """float32 [b, M]: the scores of items 1..M after each left-padded history."""
    return self.score_weights(histories, [self.weight])[0]


@dataclasses.dataclass(frozen=True)
class TrainingPriorConfig:
  """The prior as a term of the logits the transformer is trained with (residual learning:
  the blocks fit what w·prior leaves): `weight` w, the released matrix's rows and columns packed
  into `items` K slots (the pair release's item set), over the `recent` R items with decay ρ."""
  weight: float
  items: int = 1000
  recent: int = 3
  decay: float = 0.5

  def __post_init__(self):
    if not (self.weight > 0 and self.items >= 1 and self.recent >= 1
            and 0 < self.decay <= 1):
      raise ValueError(f"the training prior needs weight > 0, items >= 1, recent >= 1 and "
                       f"decay in (0, 1], got {self}")


def packed_pairs(matrix, capacity):
  """(slot int32 [M + 1], packed float32 [K + 1, K + 1]) of a released pair matrix csr
  [M + 1, M + 1] whose nonzero rows and columns are at most K = `capacity` items: item i's
  slot (0: no released pair, padding too), S̃ between slots (slot 0's row and column 0)."""
  matrix = scipy.sparse.csr_matrix(matrix, dtype=np.float32)
  touched = np.union1d(np.flatnonzero(matrix.getnnz(axis=1)),
                       np.flatnonzero(matrix.getnnz(axis=0)))
  if len(touched) > capacity:
    raise DprecError(f"the released pairs touch {len(touched)} items, more than the training "
                     f"prior's {capacity} slots")
  slot = np.zeros(matrix.shape[0], np.int32)
  slot[touched] = np.arange(1, len(touched) + 1)
  packed = np.zeros((capacity + 1, capacity + 1), np.float32)
  packed[1:len(touched) + 1, 1:len(touched) + 1] = matrix[touched][:, touched].toarray()
  return slot, packed


def recent_pair_scores(items, slot, packed, config: TrainingPriorConfig):
  """float32 [B, M]: Σ_{k ≤ R} ρ^(k−1)·S̃[h_k, j] (`Item2ItemModel.transition_scores`) of
  left-padded item ids [B, L] from `packed_pairs`' tables, in TensorFlow."""
  recent = tf.reverse(items[:, -config.recent:], axis=[1])
  decay = config.decay ** tf.range(tf.shape(recent)[1], dtype=tf.float32)
  rows = tf.gather(packed, tf.gather(slot, recent))  # [B, R, K + 1]
  by_slot = tf.einsum("brk,r->bk", rows, decay)
  return tf.gather(by_slot, slot[1:], axis=1)
