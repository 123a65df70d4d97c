"""Clipped sums plus Gaussian noise, sparse where the algorithm allows it (Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models", arXiv:2311.08357,
Algorithm 1 line 9).

DP-FEST / DP-AdaFEST: an embedding table's noisy gradient is a `tf.IndexedSlices` over the kept
rows only — N(0, (σ2·C2)²) on every coordinate of every kept row (false positives get pure
noise), exactly zero elsewhere. DP-SGD: the same clipped sum with noise on all V×d coordinates.
Dense variables always get dense noise. With a `dprec.privacy.secure_noise.SecureNoise`
generator (secure mode) the same tensors get the rounded Gaussian mechanism sampled exactly.
"""
import collections

import numpy as np
import tensorflow as tf

from dprec.privacy import secure_noise
from dprec.sparse import gaussian
from dprec.sparse.selection import find_sorted


# The tables a stacked variable holds (`dprec.layers.embedding.DPStackedEmbedding`): `rows` [F]
# (consecutive from row 0) and `widths` [F] (each ≤ the variable's; the rest is padding, which
# gets no noise). Their noise is drawn table by table in row order, as for unstacked tables.
RowWidths = collections.namedtuple("RowWidths", ["rows", "widths"])


class DistinctRows(tf.IndexedSlices):
  """An IndexedSlices whose indices are distinct (a DP step's noised rows): dprec's optimizers
  apply it as it is, without Keras' sum over duplicate indices (`dprec.optimizers.sparse`)."""


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


def noisy_sparse_rows(kept_rows, pair_rows, pair_values, noise_std, generator, table_shapes,
                      row_widths=None):
  """One IndexedSlices per table, over its sorted unique `kept_rows[f]` [K_f]: the per-pair
  clipped values `pair_values[f]` [P_f, d_f] summed into their rows (pairs whose row is not
  kept must carry zero values or rows outside `kept_rows[f]`; they are dropped), plus noise on
  all K_f rows. The noise of all tables is one draw sized by the kept rows alone: it does not
  wait for the clipped sums (nor, through them, for the backward pass), so it is drawn while
  they are computed instead of table by table after them. `row_widths[f]`: a `RowWidths` for a
  stacked variable (None: one table filling it), whose padding columns get no noise, so the
  draw's values land on the same (table, row, column) as for the tables unstacked."""
  row_widths = row_widths or [None] * len(kept_rows)
  sums = []
  for rows, row, values in zip(kept_rows, pair_rows, pair_values):
    slot, _ = find_sorted(rows, row)  # rows not kept: slot K, an extra one, dropped
    sums.append(tf.math.unsorted_segment_sum(values, slot,
                                             tf.size(rows, out_type=tf.int64) + 1)[:-1])
  if noise_std != 0 and not secure_noise.is_secure(generator):
    noise = _row_noise(kept_rows, [shape[1] for shape in table_shapes], row_widths, noise_std,
                       generator, sums[0].dtype if sums else tf.float32)
    sums = [values + part for values, part in zip(sums, noise)]
  else:
    sums = [_maybe_add_noise(values, noise_std, generator) for values in sums]
    sums = [values if layout is None else values * _column_mask(rows, layout, shape[1],
                                                                 values.dtype)
            for values, rows, layout, shape in zip(sums, kept_rows, row_widths, table_shapes)]
  return [DistinctRows(values, rows, tf.constant(shape, tf.int64))
          for values, rows, shape in zip(sums, kept_rows, table_shapes)]


def _widths_of(rows, layout):
  """The width of each of a stacked variable's `rows` [K] (sorted variable-local ids)."""
  starts = tf.constant(np.cumsum(layout.rows)[:-1], tf.int64)
  table = tf.searchsorted(starts, rows, side="right", out_type=tf.int64)
  return tf.gather(tf.constant(layout.widths, tf.int64), table)


def _column_mask(rows, layout, width, dtype):
  """1 on the columns of `rows` [K] that belong to their table, 0 on padding: [K, width]."""
  return tf.cast(tf.range(width, dtype=tf.int64) < _widths_of(rows, layout)[:, tf.newaxis],
                 dtype)


def _row_noise(kept_rows, widths, row_widths, noise_std, generator, dtype):
  """N(0, noise_std²) blocks [K_f, d_f] for the K_f = |`kept_rows[f]`| rows of table f, one
  draw whose values fill the rows' columns in order; for a stacked variable (`row_widths[f]`)
  only each row's own table's columns, zeros on padding."""
  if not kept_rows:
    return []
  per_row = [None if layout is None else _widths_of(rows, layout)
             for rows, layout in zip(kept_rows, row_widths)]
  sizes = tf.stack([tf.size(rows, out_type=tf.int64) * width if row_width is None
                    else tf.reduce_sum(row_width)
                    for rows, width, row_width in zip(kept_rows, widths, per_row)])
  flat = gaussian.normal(generator, tf.reduce_sum(sizes, keepdims=True), noise_std, dtype)
  parts = tf.split(flat, sizes, num=len(widths))
  blocks = []
  for part, width, row_width in zip(parts, widths, per_row):
    if row_width is None:
      blocks.append(tf.reshape(part, [-1, width]))
      continue
    columns = tf.range(width, dtype=tf.int64)
    inside = columns < row_width[:, tf.newaxis]
    index = tf.math.cumsum(row_width, exclusive=True)[:, tf.newaxis] + columns
    padded = tf.concat([part, tf.zeros([1], dtype)], axis=0)  # index size: a zero
    blocks.append(tf.gather(padded, tf.where(inside, index, tf.size(part, out_type=tf.int64))))
  return blocks


def noisy_dense_rows(pair_row, pair_values, noise_std, generator, table_shape, normaliser,
                     row_widths=None):
  """DP-SGD's embedding gradient: (per-pair clipped values scattered into a dense [V, d]
  tensor + noise on every coordinate) / normaliser — the O(V·d) baseline, built with a single
  V×d allocation (the scatter updates the noise buffer in place; secure mode: noise on the
  scattered sum). `row_widths`: a stacked variable's `RowWidths`: its noise is drawn table by
  table, as for unstacked tables, padding columns zero (one more V×d buffer to assemble it)."""
  if secure_noise.is_secure(generator):
    dense = tf.tensor_scatter_nd_add(tf.zeros(table_shape, pair_values.dtype),
                                     pair_row[:, tf.newaxis], pair_values)
    dense = _maybe_add_noise(dense, noise_std, generator)
    if row_widths is not None:
      dense *= _column_mask(tf.range(table_shape[0], dtype=tf.int64), row_widths, table_shape[1],
                            dense.dtype)
    return dense / normaliser
  if noise_std == 0:
    dense = tf.zeros(table_shape, pair_values.dtype)
  elif row_widths is not None:
    dense = tf.concat([
        tf.pad(gaussian.normal(generator, (rows, width), noise_std / normaliser,
                               pair_values.dtype), [[0, 0], [0, table_shape[1] - width]])
        for rows, width in zip(row_widths.rows, row_widths.widths)], axis=0)
  else:
    dense = gaussian.normal(generator, table_shape, noise_std / normaliser, pair_values.dtype)
  return tf.tensor_scatter_nd_add(dense, pair_row[:, tf.newaxis], pair_values / normaliser)
