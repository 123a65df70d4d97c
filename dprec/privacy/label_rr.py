"""Randomized response with a prior for next-item labels (Du et al., "DP-Forward: Fine-tuning and
Inference on Language Models with Differential Privacy in Forward Pass", arXiv:2309.06746; Ghazi et
al. 2021).

Plain K-ary randomized response keeps the label with probability e^ε/(e^ε + K − 1): useless for
K = 10^4–10^7 items. RR-with-prior answers only among the k labels the (public) prior p rates
highest, with k chosen to maximise the chance of the true label being returned,
k* = argmax_k e^ε/(e^ε + k − 1)·Σ_{top k} p. A label inside the top k* is kept with probability
e^ε/(e^ε + k* − 1) and otherwise replaced by one of the other k* − 1 uniformly; a label outside
is replaced by a uniform draw from the top k*. Every output has probability between
1/(e^ε + k* − 1) and e^ε/(e^ε + k* − 1) (or 1/k*) for any input, so it is ε-LDP.

The prior must be public (or private by other means): a prior computed from the labels it hides
is not covered.
"""
import dataclasses
import math
import secrets

import numpy as np

from dprec.errors import DprecError


@dataclasses.dataclass(frozen=True)
class RRWithPrior:
  """The answer set (top k* items of the prior) and the keep probability for one ε."""
  epsilon: float
  candidates: np.ndarray  # int64 [k*], item ids
  keep_probability: float

  @property
  def k(self):
    return len(self.candidates)

  def output_probabilities(self, label):
    """P[output = candidate j | label] over the candidates (for tests and audits)."""
    k = self.k
    if label in self.candidates:
      if k == 1:
        return np.ones(1)
      probabilities = np.full(k, (1 - self.keep_probability) / (k - 1))
      probabilities[self.candidates == label] = self.keep_probability
      return probabilities
    return np.full(k, 1.0 / k)

  def apply(self, labels, rng=None):
    """Randomises int labels (any shape; values ≤ 0 mean 'no label' and pass unchanged).
    `rng`: a numpy Generator; by default one keyed from the OS CSPRNG (secret)."""
    rng = rng or np.random.default_rng(secrets.randbits(128))
    labels = np.asarray(labels)
    out = labels.copy()
    real = labels > 0
    flat = labels[real]
    k = self.k
    positions = np.full(flat.shape, -1)
    lookup = {int(item): index for index, item in enumerate(self.candidates)}
    inside = np.array([int(y) in lookup for y in flat], bool)
    positions[inside] = [lookup[int(y)] for y in flat[inside]]
    uniform = rng.integers(0, k, size=flat.shape)
    if k > 1:
      # Another candidate than the true one, uniformly: shift a draw from k − 1 past it.
      other = rng.integers(0, k - 1, size=flat.shape)
      other = other + (other >= positions)
      keep = rng.random(flat.shape) < self.keep_probability
      chosen = np.where(inside, np.where(keep, positions, other), uniform)
    else:
      chosen = uniform
    out[real] = self.candidates[chosen]
    return out


def rr_with_prior(prior, epsilon):
  """RR-with-prior for a prior over items 1..M (`prior[m]` for item m; `prior[0]` unused)."""
  if not epsilon > 0 or not math.isfinite(epsilon):
    raise DprecError(f"label epsilon must be positive and finite, got {epsilon}")
  prior = np.asarray(prior, np.float64)[1:]
  if prior.ndim != 1 or not len(prior) or (prior < 0).any() or not prior.sum() > 0:
    raise DprecError("the label prior must be a non-negative vector over items with a "
                     "positive sum")
  order = np.argsort(-prior, kind="stable")
  mass = np.cumsum(prior[order]) / prior.sum()
  k = np.arange(1, len(prior) + 1)
  keep = math.exp(epsilon) / (math.exp(epsilon) + k - 1)
  best = int(np.argmax(keep * mass))
  return RRWithPrior(float(epsilon), order[:best + 1].astype(np.int64) + 1, float(keep[best]))
