"""Which embedding rows a DP step may update, per algorithm.

All tables of a model share one global row-id space (table f's local row r is global row
offset_f + r), so the DP-AdaFEST contribution map of an example is clipped jointly across tables
(Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357, Fig. 2). The result, per variable, is the mask of the batch's (example, row) pairs
whose row is kept (the others are zeroed before clipping, Algorithm 1 line 8) and the sorted local
ids of all kept rows, false positives included (None: every row, DP-SGD's dense update).
"""
import collections

import numpy as np
import tensorflow as tf

from dprec.distribute import replicas as replicas_lib
from dprec.sparse import contribution as contribution_lib
from dprec.sparse import selection

KeptRows = collections.namedtuple("KeptRows", ["pair_kept", "rows"])


class TableLayout:
  """Global row ids of named tables laid out one after another, held in variables of one or
  more consecutive tables each (a stacked variable, `dprec.layers.embedding.DPStackedEmbedding`,
  holds several tables of one width; an ordinary `DPEmbedding` one). Pairs, kept rows and
  gradients are per variable (row ids local to the variable); DP-FEST sets are per table."""

  def __init__(self, names, vocab_sizes, variable_sizes=None):
    if len(set(names)) != len(names):
      raise ValueError(f"embedding table names must be unique, got {list(names)}")
    self.names = list(names)
    self.vocab_sizes = [int(v) for v in vocab_sizes]
    self.offsets = np.concatenate([[0], np.cumsum(self.vocab_sizes)[:-1]]).astype(np.int64)
    self.total_rows = int(sum(self.vocab_sizes))
    sizes = self.vocab_sizes if variable_sizes is None else [int(v) for v in variable_sizes]
    if sum(sizes) != self.total_rows or not set(np.cumsum(sizes)) <= set(
        np.cumsum(self.vocab_sizes)):
      raise ValueError(f"variables of {sizes} rows do not hold whole tables of {self.vocab_sizes}")
    self.variable_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

  def local_sets(self, selected_rows):
    """DP-FEST sets as sorted local ids per table (empty for tables not listed), validated."""
    unknown = sorted(set(selected_rows) - set(self.names))
    if unknown:
      raise ValueError(f"selected_rows names unknown embedding tables {unknown}; "
                       f"the model's tables are {self.names}")
    sets = []
    for name, size in zip(self.names, self.vocab_sizes):
      rows = np.asarray(selected_rows.get(name, np.zeros([0], np.int64)), dtype=np.int64)
      if rows.size and rows[-1] >= size:
        raise ValueError(f"selected_rows[{name!r}] has row {rows[-1]} >= vocabulary {size}")
      sets.append(rows)
    return sets

  def global_set(self, local_sets):
    return np.concatenate([rows + offset for rows, offset in zip(local_sets, self.offsets)])

  def variable_sets(self, local_sets):
    """Per-table sorted local ids as sorted ids local to each variable."""
    rows = self.global_set(local_sets)
    bounds = np.searchsorted(rows, np.append(self.variable_offsets, self.total_rows))
    return [rows[bounds[v]:bounds[v + 1]] - offset
            for v, offset in enumerate(self.variable_offsets)]

  def split_sorted(self, global_rows):
    """Splits sorted global ids into sorted ids local to each variable."""
    bounds = tf.searchsorted(global_rows, tf.constant(
        np.append(self.variable_offsets, self.total_rows), tf.int64), side="left")
    return [global_rows[bounds[v]:bounds[v + 1]] - offset
            for v, offset in enumerate(self.variable_offsets)]


def select_kept_rows(config, layout, pairs, batch_size, generator, replicas=None):
  """`pairs[v]`: distinct (example, row) pairs of variable v (`dprec.clipping.embedding.Pairs`,
  rows local to the variable). The algorithm `config` (`dprec.optimizers.config`) chooses the
  rows (`kept_rows`: one of the functions below).
  `replicas` (`dprec.distribute.replicas.Replicas`; default: those of the step being traced):
  under `tf.distribute` the contribution maps of all replicas are summed before the threshold,
  whose draws are made once, so every replica keeps the same rows. Returns one `KeptRows` per
  variable."""
  return config.kept_rows(layout, pairs, batch_size, generator, replicas)


def all_rows(pairs):
  """Every row (DP-SGD, non-private training): every pair kept, rows None (noise on all)."""
  return [KeptRows(tf.ones_like(p.row, dtype=tf.bool), None) for p in pairs]


def touched_rows(pairs):
  """Every pair kept; rows: the sorted distinct rows the batch touched (lazy DP-SGD)."""
  return [KeptRows(tf.ones_like(p.row, dtype=tf.bool), tf.sort(tf.unique(p.row)[0]))
          for p in pairs]


def fixed_set_rows(layout, selected_rows, pairs):
  """DP-FEST: the rows of the fixed set `selected_rows` ({table name: sorted row ids})."""
  variable_sets = [tf.constant(rows, tf.int64)
                   for rows in layout.variable_sets(layout.local_sets(selected_rows))]
  return [KeptRows(selection.find_sorted(rows, p.row)[1], rows)
          for p, rows in zip(pairs, variable_sets)]


def contribution_map_rows(layout, pairs, batch_size, generator, replicas, contribution_clip,
                          contribution_std, threshold, selected_rows=None):
  """DP-AdaFEST: the rows whose contribution count (each example's 0/1 map over all tables
  clipped to `contribution_clip` C1, summed) plus N(0, `contribution_std`²) passes `threshold`,
  and the untouched rows whose noise alone does (false positives); within the DP-FEST set
  `selected_rows` (DP-AdaFEST+), whose outside pairs take no part, if given."""
  local_sets = layout.local_sets(selected_rows) if selected_rows is not None else None
  if local_sets is None:
    universe = selection.RowUniverse(size=layout.total_rows)
  else:
    universe = selection.RowUniverse(rows=layout.global_set(local_sets))
  example = tf.concat([p.example for p in pairs], axis=0)
  position, inside = universe.positions(
      tf.concat([p.row + offset for p, offset in zip(pairs, layout.variable_offsets)], axis=0))
  if local_sets is not None:  # pairs outside the DP-FEST set take no part
    inside_index = tf.where(inside)
    example, position = tf.boolean_mask(example, inside), tf.boolean_mask(position, inside)
  cmap = contribution_lib.contribution_map(example, position, batch_size, contribution_clip)
  touched, counts, pair_slot = cmap.rows, cmap.values, cmap.pair_slot
  replicas = replicas or replicas_lib.Replicas()
  if replicas.count > 1:  # the global map V̂ = Σ over all replicas
    touched, counts = contribution_lib.sum_maps(*replicas.sum_rows(cmap.rows, cmap.values))
    pair_slot = tf.gather(selection.find_sorted(touched, cmap.rows)[0], cmap.pair_slot)
  keep, false_positives = replicas.once(
      selection.select_rows, touched, counts, universe, threshold, contribution_std, generator)
  pair_kept = tf.gather(keep, pair_slot)
  if local_sets is not None:
    pair_kept = tf.scatter_nd(inside_index, tf.cast(pair_kept, tf.int8),
                              tf.shape(inside, out_type=tf.int64)) > 0
  kept_global = tf.sort(tf.concat([universe.rows(tf.boolean_mask(touched, keep)),
                                   universe.rows(false_positives)], axis=0))
  pair_kept = tf.split(pair_kept, [tf.size(p.row) for p in pairs])
  return [KeptRows(mask, rows)
          for mask, rows in zip(pair_kept, layout.split_sorted(kept_global))]
