"""DP statistics of training labels, for initialising a model's output layer.

Each is one Gaussian mechanism on a sum whose L2 sensitivity, for adding or removing one
example, is stated beside it; the number of examples N is public. `rng` (a numpy Generator) must
be secret in a private run (the run's key). A caller releasing k of them at one planned noise
multiplier σ gives each σ·√k: k Gaussian mechanisms at σ·√k compose to exactly one at σ
(Gaussian DP, Dong, Roth & Su 2019, Cor. 3.3), the σ it plans and charges.
"""
import math
from typing import Tuple

import numpy as np

from dprec.errors import DprecError

# A signed power-of-two bucket per label: (2^(k−1), 2^k] for k in this range, their negatives,
# and 0. Labels beyond ±2^MAX_EXPONENT fall in the outermost buckets.
MIN_EXPONENT, MAX_EXPONENT = -8, 40
# A bucket counts as present when its noisy count exceeds this many noise standard deviations:
# with 2·49 + 1 buckets an empty one passes with probability ≈ 1e-5 each.
PRESENCE_STDS = 4.3


def _check(labels, noise_multiplier):
  labels = np.asarray(labels, np.float64).reshape(-1)
  if not labels.size:
    raise DprecError("need at least one label")
  if not noise_multiplier >= 0:
    raise DprecError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
  return labels


def dp_mean(labels, label_range: Tuple[float, float], noise_multiplier, rng) -> float:
  """The mean of labels clipped to [lo, hi]: Σ (clip(y) − c) with c = (lo + hi)/2 has
  sensitivity (hi − lo)/2; noise N(0, (σ·(hi − lo)/2)²), then /N + c, clipped to [lo, hi]."""
  labels = _check(labels, noise_multiplier)
  lo, hi = _label_range(label_range)
  return dp_mean_of_sum(float(np.sum(np.clip(labels, lo, hi))), labels.size, label_range,
                        noise_multiplier, rng)


def dp_mean_of_sum(total, n, label_range: Tuple[float, float], noise_multiplier, rng) -> float:
  """`dp_mean` from the sum `total` of n labels already clipped to `label_range` (e.g. summed in
  a streaming pass): the same release."""
  if not noise_multiplier >= 0 or not n > 0:
    raise DprecError(f"need noise_multiplier >= 0 and n > 0, got {noise_multiplier}, {n}")
  lo, hi = _label_range(label_range)
  center, half = (lo + hi) / 2, (hi - lo) / 2
  total = float(total) - n * center
  total += noise_multiplier * half * rng.normal() if noise_multiplier else 0.0
  return float(np.clip(center + total / n, lo, hi))


def _label_range(label_range):
  lo, hi = map(float, label_range)
  if not hi > lo:
    raise DprecError(f"label range must have lo < hi, got {label_range}")
  return lo, hi


def dp_class_counts(labels, num_classes: int, noise_multiplier, rng) -> np.ndarray:
  """Noisy counts of integer class labels 0..K−1 (one-hot sum: sensitivity 1), floored at 1."""
  labels = _check(labels, noise_multiplier).astype(np.int64)
  if labels.min() < 0 or labels.max() >= num_classes:
    raise DprecError(f"class labels must be in [0, {num_classes}), got [{labels.min()}, "
                     f"{labels.max()}]")
  counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
  if noise_multiplier:
    counts += noise_multiplier * rng.normal(size=num_classes)
  return np.maximum(counts, 1.0)


def _bucket_edges():
  exponents = np.arange(MIN_EXPONENT, MAX_EXPONENT + 1)
  upper = 2.0 ** exponents
  # bucket j covers (edges[j], edges[j+1]]: negatives, the zero bucket (−2^MIN, 2^MIN], positives
  return np.concatenate([-upper[::-1], upper])


def dp_label_range(labels, noise_multiplier, rng) -> Tuple[float, float]:
  """A range holding the labels, found under DP: a histogram of signed power-of-two buckets
  (each label in one bucket: sensitivity 1) with noise N(0, σ²) per bucket; the range runs from
  the lowest to the highest bucket whose noisy count exceeds `PRESENCE_STDS`·σ (the bucket with
  the largest noisy count if none does). Buckets with few labels may be missed: they are clipped
  by whatever uses the range."""
  labels = _check(labels, noise_multiplier)
  edges = _bucket_edges()
  buckets = np.clip(np.searchsorted(edges, labels, side="left") - 1, 0, edges.size - 2)
  counts = np.bincount(buckets, minlength=edges.size - 1).astype(np.float64)
  if noise_multiplier:
    counts += noise_multiplier * rng.normal(size=counts.size)
  present = np.flatnonzero(counts > PRESENCE_STDS * noise_multiplier)
  if not present.size:
    present = np.array([int(np.argmax(counts))])
  lo, hi = float(edges[present.min()]), float(edges[present.max() + 1])
  return (0.0 if math.isclose(lo, -(2.0 ** MIN_EXPONENT)) else lo), hi
