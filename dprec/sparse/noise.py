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


def noisy_sparse_rows(kept_rows, pair_rows, pair_values, noise_std, generator, table_shapes):
  """One IndexedSlices per table, over its sorted unique `kept_rows[f]` [K_f]: the per-pair
  clipped values `pair_values[f]` [P_f, d_f] summed into their rows (pairs whose row is not
  kept must carry zero values or rows outside `kept_rows[f]`; they are dropped), plus noise on
  all K_f rows. The noise of all tables is one draw sized by the kept rows alone: it does not
  wait for the clipped sums (nor, through them, for the backward pass), so it is drawn while
  they are computed instead of table by table after them."""
  sums = []
  for rows, row, values in zip(kept_rows, pair_rows, pair_values):
    slot, _ = find_sorted(rows, row)  # rows not kept: slot K, an extra one, dropped
    sums.append(tf.math.unsorted_segment_sum(values, slot,
                                             tf.size(rows, out_type=tf.int64) + 1)[:-1])
  if noise_std != 0 and not secure_noise.is_secure(generator):
    noise = _row_noise([tf.size(rows, out_type=tf.int64) for rows in kept_rows],
                       [shape[1] for shape in table_shapes], noise_std, generator,
                       sums[0].dtype if sums else tf.float32)
    sums = [values + part for values, part in zip(sums, noise)]
  else:
    sums = [_maybe_add_noise(values, noise_std, generator) for values in sums]
  return [tf.IndexedSlices(values, rows, tf.constant(shape, tf.int64))
          for values, rows, shape in zip(sums, kept_rows, table_shapes)]


def _row_noise(row_counts, widths, noise_std, generator, dtype):
  """N(0, noise_std²) blocks [K_f, d_f] for K_f = `row_counts[f]` rows of width d_f, one draw."""
  if not row_counts:
    return []
  sizes = tf.stack([count * width for count, width in zip(row_counts, widths)])
  flat = gaussian.normal(generator, tf.reduce_sum(sizes, keepdims=True), noise_std, dtype)
  parts = tf.split(flat, sizes, num=len(widths))
  return [tf.reshape(part, [-1, width]) for part, width in zip(parts, widths)]


def noisy_dense_rows(pair_row, pair_values, noise_std, generator, table_shape, normaliser,
                     row_blocks=None):
  """DP-SGD's embedding gradient: (per-pair clipped values scattered into a dense [V, d]
  tensor + noise on every coordinate) / normaliser — the O(V·d) baseline, built with a single
  V×d allocation (the scatter updates the noise buffer in place; secure mode: noise on the
  scattered sum). `row_blocks`: the rows of the tables a stacked variable holds; their noise is
  drawn table by table, as for unstacked tables (one more V×d buffer for the concatenation)."""
  if secure_noise.is_secure(generator):
    dense = tf.tensor_scatter_nd_add(tf.zeros(table_shape, pair_values.dtype),
                                     pair_row[:, tf.newaxis], pair_values)
    return _maybe_add_noise(dense, noise_std, generator) / normaliser
  if noise_std == 0:
    dense = tf.zeros(table_shape, pair_values.dtype)
  elif row_blocks is not None and len(row_blocks) > 1:
    dense = tf.concat([gaussian.normal(generator, (rows,) + tuple(table_shape[1:]),
                                       noise_std / normaliser, pair_values.dtype)
                       for rows in row_blocks], axis=0)
  else:
    dense = gaussian.normal(generator, table_shape, noise_std / normaliser, pair_values.dtype)
  return tf.tensor_scatter_nd_add(dense, pair_row[:, tf.newaxis], pair_values / normaliser)
