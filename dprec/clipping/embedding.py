"""Per-example gradient norms of a DP embedding table, restricted to kept rows.

For example i the gradient of table W is a sparse matrix whose row j is Σ_k g_{i,k} over the
lookup positions k of example i with id j (Li et al., "Large Language Models Can Be Strong
Differentially Private Learners", arXiv:2110.05679, §4.2 footnote 4: (a_i a_iᵀ)_{k1,k2} = 1[x_{i,k1}
= x_{i,k2}]). Aggregating per distinct (example, row) pair before squaring makes the norm exact for
repeated ids and multi-valued features; rows dropped by the selection are zeroed before the norm
(Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357, Algorithm 1 line 8). Cost O(lookups × d), never O(vocabulary).

At user level (`dprec.clipping.units`) the pairs are (unit, row) pairs: the gradients of every
position of the unit's rows with that id add up, so the same segment sums give the norm of each
unit's summed table gradient, again without per-example or per-unit copies of the table.
"""
import collections

import tensorflow as tf

# The distinct (example, row) pairs of one table in one batch: `example` [P] (the unit at user
# level), `row` [P] (local row ids), and `position_pair` [Q] mapping each valid lookup position
# (in the order of `valid_positions`) to its pair (None: position q is pair q,
# `one_id_per_example`).
Pairs = collections.namedtuple("Pairs", ["example", "row", "position_pair"])


def valid_positions(lookups):
  """Flattened (example index, row id) of every non-pad lookup position over all calls."""
  examples, rows = [], []
  for lookup in lookups:
    shape = tf.shape(lookup.ids, out_type=tf.int64)
    example = tf.broadcast_to(tf.range(shape[0])[:, tf.newaxis], shape)
    examples.append(tf.boolean_mask(example, lookup.valid))
    rows.append(tf.boolean_mask(lookup.ids, lookup.valid))
  return tf.concat(examples, axis=0), tf.concat(rows, axis=0)


def one_id_per_example(lookups):
  """Whether the table is looked up once with one id per example (a single-valued feature),
  or once with columns that cannot share a row (stacked tables): then every valid position is
  its own (example, row) pair (statically known)."""
  return len(lookups) == 1 and (lookups[0].ids.shape[1] == 1 or lookups[0].distinct_columns)


def distinct_pairs(lookups, vocab_size, units=None):
  """The distinct (example, row) pairs of a table's lookups (from the input ids alone), in the
  order of their first position; with `units` (`dprec.clipping.units.Units`), the distinct
  (unit, row) pairs."""
  example, row = valid_positions(lookups)
  if units is not None:
    example = units.of(example)
  elif one_id_per_example(lookups):  # positions are distinct pairs: no unique pass
    return Pairs(example, row, None)
  key = example * vocab_size + row
  unique_keys, position_pair = tf.unique(key, out_idx=tf.int64)
  return Pairs(unique_keys // vocab_size, unique_keys % vocab_size, position_pair)


def pair_gradients(pairs, lookups, row_grads):
  """Per-(example, row) gradient [P, d]: the summed-loss gradients of the gathered rows
  (`row_grads`, one [n, L, d] tensor per lookup) added up over the pair's positions."""
  flat = tf.concat([tf.boolean_mask(grad, lookup.valid)
                    for lookup, grad in zip(lookups, row_grads)], axis=0)
  if pairs.position_pair is None:  # one position per pair
    return flat
  return tf.math.unsorted_segment_sum(flat, pairs.position_pair,
                                      tf.shape(pairs.example, out_type=tf.int64)[0])


def squared_norms(pairs, pair_grads, kept, batch_size):
  """‖g_i‖² of the tables for each example (each unit: `batch_size` is then U), counting only
  pairs whose row is `kept`: lists with one entry per table ([P_f] pairs, [P_f, d_f] gradients,
  [P_f] masks), one segment sum."""
  per_pair = [tf.reduce_sum(tf.square(g), axis=1) * tf.cast(k, g.dtype)
              for g, k in zip(pair_grads, kept)]
  return tf.math.unsorted_segment_sum(tf.concat(per_pair, axis=0),
                                      tf.concat([p.example for p in pairs], axis=0), batch_size)
