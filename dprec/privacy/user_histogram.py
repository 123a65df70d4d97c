"""A DP histogram of users per item: Re-Attention's p_i without exact counts (Ding et al.,
"DPFormer: Learning Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633 Remark
A.2).

Each user adds 1 to each distinct item among their at most L items (after truncation), so adding
or removing one user moves the clean histogram by a 0/1 vector with at most L ones: L2
sensitivity √L. The Gaussian mechanism adds N(0, (σ·√L)²) to every item's count, and
p_i = clip(count_i/N, 1/N, 1) (N, the number of users, is public). Its privacy is one Gaussian
mechanism with noise multiplier σ (`accounting.gaussian_mechanism_period`), composed with training
in the same accountant (`calibration.plan_training(gaussian_mechanisms=...)`).

The noise must come from the run's secret randomness: callers pass the generator (a numpy
`Generator` or a `tf.random.Generator`), never a public seed.
"""
import math

import numpy as np

from dprec.errors import DprecError


def users_per_item(item_rows, num_items):
  """int64[M + 1]: how many rows (users) hold each item 1..M at least once (0 = padding, 0)."""
  rows = np.asarray(item_rows)
  if rows.ndim != 2:
    raise DprecError(f"item rows must be [users, L], got shape {rows.shape}")
  if rows.size and (rows.min() < 0 or rows.max() > num_items):
    raise DprecError(f"item ids must be in 0..{num_items} (0 = padding)")
  distinct = np.sort(rows, axis=1)
  first = np.ones_like(distinct, bool)
  first[:, 1:] = distinct[:, 1:] != distinct[:, :-1]
  counts = np.bincount(distinct[first & (distinct > 0)], minlength=num_items + 1)
  return counts.astype(np.int64)


def sensitivity(max_items):
  """L2 sensitivity √L of `users_per_item` under adding or removing one user with ≤ L items."""
  if max_items < 1:
    raise DprecError(f"each user needs room for at least one item, got L = {max_items}")
  return math.sqrt(max_items)


def _normal(generator, stddev, size):
  if isinstance(generator, np.random.Generator):
    return generator.normal(0.0, stddev, size)
  return np.asarray(generator.normal([size], stddev=stddev, dtype="float64"))  # tf.random


def noisy_users_per_item(item_rows, num_items, noise_multiplier, generator):
  """float64[M + 1]: `users_per_item` plus N(0, (σ·√L)²) per item (index 0 stays 0);
  L = the rows' width."""
  if not noise_multiplier > 0:
    raise DprecError(f"the histogram's noise multiplier must be > 0, got {noise_multiplier}")
  counts = users_per_item(item_rows, num_items).astype(np.float64)
  stddev = noise_multiplier * sensitivity(np.asarray(item_rows).shape[1])
  counts[1:] += _normal(generator, stddev, num_items)
  return counts


def dp_item_frequencies(item_rows, num_items, noise_multiplier, generator):
  """float64[M + 1]: p_i = noisy users-per-item / N clamped to [1/N, 1] (p_0 = 0), N = rows."""
  return frequencies_of(noisy_users_per_item(item_rows, num_items, noise_multiplier, generator),
                        len(item_rows))


def frequencies_of(counts, num_users):
  """float64[M + 1]: p_i = `counts` [M + 1] (noisy users per item) / N clamped to [1/N, 1]
  (p_0 = 0): post-processing of the release."""
  if num_users < 1:
    raise DprecError("item frequencies need at least one user")
  frequencies = np.clip(np.asarray(counts, np.float64) / num_users, 1.0 / num_users, 1.0)
  frequencies[0] = 0.0
  return frequencies
