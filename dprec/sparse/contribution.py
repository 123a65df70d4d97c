"""Clipped gradient-contribution maps from input ids alone (Ghazi et al., "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1 lines
5–6).

Example i's map v_i is 1 on every distinct row it touches across all tables (global row ids),
so ‖v_i‖₂ = √k_i for k_i distinct rows; clipping to C1 weights each of its rows by
min(1, C1/√k_i). The batch map V̂ = Σ_i [v_i]_{C1} is a segment sum over touched rows only:
adding or removing one example moves it by at most C1 in ℓ2.

At user level (`dprec.clipping.units`) the pairs are the distinct (unit, row) pairs, so a unit's
map is 1 on every distinct row any of its rows touches, clipped to C1 as one: removing a user
(all its rows) moves V̂ by at most C1. A 0/1 map rather than the unit's row counts: as within an
example, a repeated id counts once, so the noisy threshold counts the users who touch a row and
one user's repetitions cannot stand in for many users; and ‖v_u‖ = √k_u is at most the norm of
the counts, so the clipping scales a heavy user's rows down no more than counts would.
"""
import collections

import tensorflow as tf

# `rows` [T]: sorted distinct touched positions; `values` [T]: V̂ on them; `pair_slot` [P]:
# index into `rows` of each (example, position) pair.
ContributionMap = collections.namedtuple("ContributionMap", ["rows", "values", "pair_slot"])


def example_weights(pair_example, batch_size, clip):
  """min(1, C1/√k_i) for each example (unit), k_i = its number of distinct rows (pairs)."""
  counts = tf.math.unsorted_segment_sum(
      tf.ones_like(pair_example, dtype=tf.float32), pair_example, batch_size)
  if clip == float("inf"):
    return tf.ones_like(counts)
  return tf.minimum(1.0, clip * tf.math.rsqrt(tf.maximum(counts, 1.0)))


def contribution_map(pair_example, pair_row, batch_size, clip):
  """V̂ over the distinct (example, row) pairs of a batch (rows: positions in a universe)."""
  rows, slot = tf.unique(pair_row, out_idx=tf.int64)
  order = tf.argsort(rows)
  sorted_rows = tf.gather(rows, order)
  pair_slot = tf.cast(tf.gather(tf.math.invert_permutation(order), slot), tf.int64)
  weights = tf.gather(example_weights(pair_example, batch_size, clip), pair_example)
  values = tf.math.unsorted_segment_sum(weights, pair_slot, tf.size(rows, out_type=tf.int64))
  return ContributionMap(sorted_rows, values, pair_slot)


def sum_maps(rows, values):
  """One map from the entries (row [T], value [T]) of several, rows possibly repeated (e.g. the
  maps of all replicas of a distributed step): (sorted distinct rows, summed values)."""
  distinct, slot = tf.unique(rows, out_idx=tf.int64)
  totals = tf.math.unsorted_segment_sum(values, slot, tf.size(distinct, out_type=tf.int64))
  order = tf.argsort(distinct)
  return tf.gather(distinct, order), tf.gather(totals, order)
