"""The replicas of a data-parallel DP step (`tf.distribute`): sums over replicas, and random
draws made once for all of them.

Each replica clips its own examples (clipping is per example, so local), then
  - dense clipped sums are all-reduced (`sum`);
  - per-row clipped sums travel as (row, value) pairs, summed per row locally and all-gathered
    (`sum_rows`), never as a dense vocabulary-sized tensor;
  - DP-AdaFEST contribution maps are summed the same way before the noisy threshold;
  - every draw of the privacy proof (contribution noise, false positives, gradient noise) is made
    once, in cross-replica context (`once`), on the global sums, from the step's generator, and
    the same result is handed to every replica. The generator is keyed by the run's secret key
    and the step (`dprec.privacy.noise_key`); each worker process holds the same key, so a
    multi-worker step draws identical noise on every worker.
The global noise is therefore one draw of N(0, σ²C²) on the global clipped sum, as on one
device, not one per replica (R× the variance); Opacus adds it on rank 0 only, to the same effect.
Outside a strategy (or in cross-replica context) all of this is the identity and adds no op.
"""
import tensorflow as tf


class Replicas:
  """The replicas of the step being traced (one outside any `tf.distribute` strategy)."""

  def __init__(self):
    self._context = (tf.distribute.get_replica_context() if tf.distribute.has_strategy()
                     else None)
    self.count = self._context.num_replicas_in_sync if self._context is not None else 1

  @property
  def distributed(self) -> bool:
    """Inside a strategy's replica function (draws must go through `once`)."""
    return self._context is not None

  def sum(self, tensors):
    """Element-wise sums over the replicas of a (nested) structure of dense tensors."""
    if self.count == 1:
      return tensors
    return self._context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)

  def sum_rows(self, rows, values, mask=None):
    """The per-row sums of (row [P], value [P, d]) pairs over all replicas, as pairs: each
    replica sums its pairs per distinct row (dropping those `mask` excludes), then the pairs
    are all-gathered (rows may repeat across replicas; consumers sum them). Never densified."""
    if self.count == 1:
      return rows, values
    if mask is not None:
      rows, values = tf.boolean_mask(rows, mask), tf.boolean_mask(values, mask)
    distinct, slot = tf.unique(rows, out_idx=tf.int64)
    values = tf.math.unsorted_segment_sum(values, slot, tf.size(distinct, out_type=tf.int64))
    # One padding pair (row −1, value 0) each: a collective on an empty tensor crashes
    # MultiWorkerMirroredStrategy's workers (TF 2.21), and a replica may have no pairs.
    distinct = tf.concat([distinct, [-1]], axis=0)
    values = tf.concat([values, tf.zeros(tf.concat([[1], tf.shape(values)[1:]], axis=0),
                                         values.dtype)], axis=0)
    rows = self._context.all_gather(distinct, axis=0)
    values = self._context.all_gather(values, axis=0)
    real = rows >= 0
    return tf.boolean_mask(rows, real), tf.boolean_mask(values, real)

  def once(self, fn, *args):
    """`fn(*args)` evaluated once for all replicas (in cross-replica context, through
    `merge_call`), its result given to every replica. `args` must be the same on every replica
    (e.g. results of `sum`); random draws inside `fn` then happen once, as on one device."""
    if not self.distributed:
      return fn(*args)

    def merged(strategy, *per_replica):
      first = tf.nest.map_structure(lambda value: strategy.experimental_local_results(value)[0],
                                    per_replica)
      return fn(*first)

    return self._context.merge_call(merged, args=args)
