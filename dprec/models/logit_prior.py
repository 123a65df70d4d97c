"""The item-to-item score as a fixed prior on a sequential model's next-item logits.

After a history ending in h_1 (most recent), h_2, ..., item j scores

    f(h)_j + w · Σ_{k ≤ R} ρ^(k−1) · S̃[h_k, j],

where f(h) are the model's logits (e.g. the DP transformer's) and S̃ the released pair matrix
of `dprec.models.item2item` (`Item2ItemModel.transition_scores`: the same recent items R and
decay ρ). The prior is fixed: it is not trained, and it reads only the released matrix, so
adding it is post-processing of released values. w = 0 is the model alone, a large w ranks the
items a released pair reaches by the prior and orders the rest by the model.
"""
import numpy as np

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
