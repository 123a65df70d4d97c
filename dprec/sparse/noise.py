"""Clipped sums plus Gaussian noise, sparse where the algorithm allows it (seed 001 Algorithm 1
line 9; DESIGN §4 step 5).

DP-FEST / DP-AdaFEST: an embedding table's noisy gradient is a `tf.IndexedSlices` over the kept
rows only — N(0, (σ2·C2)²) on every coordinate of every kept row (false positives get pure
noise), exactly zero elsewhere. DP-SGD: the same clipped sum with noise on all V×d coordinates.
Dense variables always get dense noise. With a `dprec.privacy.secure_noise.SecureNoise`
generator (secure mode) the same tensors get the rounded Gaussian mechanism sampled exactly.
"""
import tensorflow as tf

from dprec.privacy import secure_noise
from dprec.sparse import gaussian
from dprec.sparse.selection import find_sorted


def _maybe_add_noise(values, noise_std, generator):
  if noise_std == 0:
    return values
  if secure_noise.is_secure(generator):
    return generator.add_noise(values, noise_std)
  return values + gaussian.normal(generator, tf.shape(values), noise_std, values.dtype)


def noisy_dense(gradient, noise_std, generator):
  """A dense variable's clipped-sum gradient plus N(0, noise_std²) per coordinate."""
  if isinstance(gradient, tf.IndexedSlices):
    gradient = tf.convert_to_tensor(gradient)
  return _maybe_add_noise(gradient, noise_std, generator)


def noisy_sparse_rows(kept_rows, pair_row, pair_values, noise_std, generator, table_shape):
  """IndexedSlices over sorted unique `kept_rows` [K]: the per-pair clipped values [P, d] summed
  into their rows (pairs whose row is not kept must carry zero values or rows outside
  `kept_rows`; they are dropped), plus noise on all K rows."""
  slot, _ = find_sorted(kept_rows, pair_row)  # rows not kept: slot K, an extra one, dropped
  values = tf.math.unsorted_segment_sum(pair_values, slot,
                                        tf.size(kept_rows, out_type=tf.int64) + 1)[:-1]
  values = _maybe_add_noise(values, noise_std, generator)
  return tf.IndexedSlices(values, kept_rows, tf.constant(table_shape, tf.int64))


def noisy_dense_rows(pair_row, pair_values, noise_std, generator, table_shape, normaliser):
  """DP-SGD's embedding gradient: (per-pair clipped values scattered into a dense [V, d]
  tensor + noise on every coordinate) / normaliser — the O(V·d) baseline, built with a single
  V×d allocation (the scatter updates the noise buffer in place; secure mode: noise on the
  scattered sum)."""
  if secure_noise.is_secure(generator):
    dense = tf.tensor_scatter_nd_add(tf.zeros(table_shape, pair_values.dtype),
                                     pair_row[:, tf.newaxis], pair_values)
    return _maybe_add_noise(dense, noise_std, generator) / normaliser
  if noise_std == 0:
    dense = tf.zeros(table_shape, pair_values.dtype)
  else:
    dense = gaussian.normal(generator, table_shape, noise_std / normaliser, pair_values.dtype)
  return tf.tensor_scatter_nd_add(dense, pair_row[:, tf.newaxis], pair_values / normaliser)
