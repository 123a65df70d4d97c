"""DP-AdaFEST row selection without a vocabulary-sized tensor (Ghazi et al., "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1 lines 5–6,
App. B.2 with Ghazi et al. 2023, App. B.2's correction).

Rows live in a *universe*: all global rows [0, V) (DP-AdaFEST) or a sorted set of rows
(the DP-FEST set inside DP-AdaFEST+). A row is selected when its noisy contribution
V̂[j] + N(0, (σ1·C1)²) reaches τ. Touched rows (V̂[j] > 0, at most the batch's lookups) get their
noise drawn explicitly; each of the c' untouched rows is selected independently with
p = Ψ(τ/(σ1·C1)) (std σ1·C1, not the paper's σ1²C1²), sampled as the positions of the ones of
a Bernoulli(p) sequence whose gaps are Geom(p), in time linear in the number selected.
Secure mode (a `SecureNoise` generator): the noisy counts are the rounded Gaussian mechanism and
the gaps exact geometric draws at the exact rate of an untouched row (`dprec.privacy.secure_noise`).
"""
import math

import tensorflow as tf

from dprec.privacy import secure_noise
from dprec.sparse import gaussian


def gaussian_survival(x):
  """Ψ(x) = Pr[Z >= x] for Z ~ N(0, 1)."""
  return 0.5 * math.erfc(x / math.sqrt(2.0))


def false_positive_rate(threshold, noise_std):
  """Pr[an untouched row is selected] = Ψ(τ / (σ1·C1)); 0 without noise (τ > 0)."""
  if noise_std == 0:
    return 0.0
  return gaussian_survival(threshold / noise_std)


def find_sorted(sorted_rows, rows):
  """(slot, found) of int64 `rows` in sorted unique int64 `sorted_rows`: the index of each row
  and whether it is there (slot = len(sorted_rows) when it is not)."""
  size = tf.size(sorted_rows, out_type=tf.int64)
  slot = tf.searchsorted(sorted_rows, rows, side="left", out_type=tf.int64)
  padded = tf.concat([sorted_rows, tf.constant([-1], tf.int64)], axis=0)
  found = tf.equal(tf.gather(padded, slot), rows)
  return tf.where(found, slot, size), found


class RowUniverse:
  """The rows a selection ranges over: [0, size) or the sorted global ids `rows` (int64)."""

  def __init__(self, size=None, rows=None):
    if (size is None) == (rows is None):
      raise ValueError("give exactly one of size and rows")
    self._rows = None if rows is None else tf.constant(rows, dtype=tf.int64)
    self.size = int(size) if rows is None else int(rows.shape[0])

  def positions(self, global_rows):
    """(position in the universe, inside mask) of int64 `global_rows`."""
    if self._rows is None:
      return global_rows, tf.ones_like(global_rows, dtype=tf.bool)
    return find_sorted(self._rows, global_rows)

  def rows(self, positions):
    """Global row ids of universe `positions`."""
    return positions if self._rows is None else tf.gather(self._rows, positions)


def sample_untouched(touched, universe_size, rate, generator):
  """Positions in [0, universe_size) outside sorted `touched`, each included independently
  with probability `rate`, drawn by geometric gaps (App. B.2) in sorted order. Secure mode:
  `rate` may be an exact `Rate` (`secure_noise.tail_rate`); a float is taken as exact."""
  touched = tf.cast(touched, tf.int64)
  untouched_count = tf.cast(universe_size, tf.int64) - tf.size(touched, out_type=tf.int64)
  if float(rate) <= 0.0:
    return tf.zeros([0], tf.int64)
  if float(rate) >= 1.0:
    picked = tf.range(untouched_count)
  elif secure_noise.is_secure(generator):
    picked = generator.positions_op(untouched_count, rate)
  else:
    picked = _bernoulli_positions(untouched_count, rate, generator)
  # The k-th untouched row is k plus the number of touched rows at or before it: with
  # s_m = touched[m] − m (untouched rows before touched[m]), that count is #{m : s_m <= k}.
  before = touched - tf.range(tf.size(touched, out_type=tf.int64))
  return picked + tf.searchsorted(before, picked, side="right", out_type=tf.int64)


def _bernoulli_positions(length, rate, generator):
  """Sorted positions of the ones in `length` i.i.d. Bernoulli(rate) bits, from Geom(rate)
  gaps drawn in chunks until they pass the end."""
  log_keep = math.log1p(-rate)
  mean = tf.cast(length, tf.float64) * rate
  chunk = tf.cast(tf.math.ceil(mean + 6.0 * tf.sqrt(mean) + 16.0), tf.int64)
  limit = tf.cast(length, tf.float64) + 1.0

  def body(last, found):
    uniform = generator.uniform([chunk], minval=0.0, maxval=1.0, dtype=tf.float64)
    uniform = tf.maximum(uniform, 1e-300)  # log(0) guard; Pr ≈ 0
    gaps = tf.minimum(tf.math.floor(tf.math.log(uniform) / log_keep), limit)
    positions = last + tf.math.cumsum(tf.cast(gaps, tf.int64) + 1)
    return positions[-1], found.write(found.size(), positions[positions < length])

  found = tf.TensorArray(tf.int64, size=0, dynamic_size=True, infer_shape=False,
                         element_shape=tf.TensorShape([None]))
  _, found = tf.while_loop(lambda last, _: last < length - 1, body,
                           (tf.constant(-1, tf.int64), found))
  return tf.cond(found.size() > 0, found.concat, lambda: tf.zeros([0], tf.int64))


def select_rows(touched, contributions, universe, threshold, noise_std, generator):
  """Algorithm 1 line 6 + B.2: returns (keep [T] bool for the sorted touched universe
  positions `touched`, false-positive universe positions [F] sorted)."""
  rate = false_positive_rate(threshold, noise_std)
  if secure_noise.is_secure(generator) and noise_std > 0:
    keep = generator.add_passes(contributions, noise_std, threshold)
    rate = secure_noise.tail_rate(threshold, noise_std)
  elif noise_std > 0:
    keep = contributions + gaussian.normal(
        generator, tf.shape(contributions), noise_std, contributions.dtype) >= threshold
  else:
    keep = contributions >= threshold
  return keep, sample_untouched(touched, universe.size, rate, generator)
