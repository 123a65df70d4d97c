"""The DP step's mathematics (`dprec.models.dp_model` walks through its steps 1–5), written once
for every Keras version: `DPStep` holds it, a binding supplies what touches a Keras version.

A class using `DPStep` provides `trainable_variables`, `losses` (regularisation losses: refused),
`optimizer` (the inner one), `dp_optimizer` (a `DPOptimizer`: algorithm, clip, expected batch
size), `_dp_generator`, `layer_registry` (None: the default), `dp_step_tables` (`DPEmbedding`
layers, by increasing width), `step_layers()` (every layer, nested ones included),
`forward_losses(x, y, sample_weight)` and `extra_squared_norms()`: `dprec.models.dp_model.DPModel`
for tf.keras, `dprec.models.keras3.Keras3DPModel` for Keras 3.

User level (either binding): a batch whose features (a dict) hold `dprec.clipping.units.UNIT_KEY`
(each row's unit index) has it popped before the forward pass and clips each unit's summed
gradient as one: the norms below are then per unit, c_u = min(1, C2/‖Σ_{i∈u} g_i‖) weights every
row of u, the DP-AdaFEST contribution map is one 0/1 map per unit (`dprec.sparse.contribution`),
and `DPOptimizer.expected_batch_size` counts units (q·users under user-level Poisson sampling).
"""
import collections
import contextlib

import tensorflow as tf

from dprec.clipping import embedding as embedding_norms
from dprec.clipping import layer_norms
from dprec.clipping import registry as registry_lib
from dprec.clipping import units as units_lib
from dprec.distribute import replicas as replicas_lib
from dprec.errors import DprecError
from dprec.optimizers import config as config_lib
from dprec.optimizers import sparse as sparse_optimizers
from dprec.privacy import secure_noise as secure_noise_lib
from dprec.sparse import kept_rows as kept_rows_lib
from dprec.sparse import lazy as lazy_lib
from dprec.sparse import noise as noise_lib


_Forward = collections.namedtuple(
    "_Forward", ["tape", "y_pred", "losses", "squared", "group_squared", "tables", "pairs",
                 "pair_grads", "kept", "records", "record_grads", "extras", "extra_grads",
                 "units"])


def _rest_share(group_squared):
  """The share of C² left to the variables outside the `norm_share` groups."""
  shares = [extra.norm_share for extra, _, _ in group_squared]
  if any(extra.clipped_gradient_fn is None for extra, _, _ in group_squared):
    raise DprecError("an ExtraNorms with norm_share needs clipped_gradient_fn")
  if not all(0 < share < 1 for share in shares) or sum(shares) >= 1:
    raise DprecError(f"norm shares must be in (0, 1) and sum to less than 1, got {shares}")
  return 1.0 - sum(shares)


def table_variable_ids(tables):
  """ids of the tables' variables: each table's, or the shards of a table partitioned by rows
  across parameter servers (a `ShardedVariable`, `dprec.distribute.parameter_server`)."""
  return {id(v) for t in tables
          for v in [t.embeddings, *getattr(t.embeddings, "variables", [])]}


def shard_gradients(gradient, table):
  """(gradient, variable) pairs of a table's gradient (dense, or IndexedSlices over sorted rows):
  one pair for an ordinary table; for a `ShardedVariable` one per shard, the rows falling in it
  (shard-local ids), so each parameter server receives, reads and updates only its kept rows."""
  if not isinstance(table, tf.__internal__.distribute.ShardedVariable):
    return [(gradient, table)]
  sizes = [shard.shape[0] for shard in table.variables]
  if not isinstance(gradient, tf.IndexedSlices):
    return list(zip(tf.split(gradient, sizes), table.variables))
  starts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
  bounds = tf.searchsorted(gradient.indices, tf.constant(starts, gradient.indices.dtype))
  return [(type(gradient)(gradient.values[bounds[s]:bounds[s + 1]],  # DistinctRows stay so
                          gradient.indices[bounds[s]:bounds[s + 1]] - starts[s],
                          tf.constant(shard.shape.as_list(), tf.int64)), shard)
          for s, shard in enumerate(table.variables)]


def _row_widths(table):
  """A stacked table's `noise.RowWidths` (None for one table filling its variable)."""
  if len(table.sub_tables) == 1 and not table.padded:
    return None
  return noise_lib.RowWidths([rows for _, rows, _ in table.sub_tables],
                             [width for _, _, width in table.sub_tables])


def _refuse_what_user_level_cannot_clip(records, extras, registry):
  """Refuses, in one line, what gives no per-unit norm: a registry layer whose function is
  not `per_unit`, `ExtraNorms` (per-example only), and replicas, which could split a unit."""
  problems = [f"layer {r.layer.name!r} ({type(r.layer).__name__}) has a per-example norm "
              "function only (register one per_unit)" for r in records
              if not registry.per_unit(r.layer)]
  if extras:
    problems.append("extra_squared_norms gives per-example norms only")
  if replicas_lib.Replicas().count > 1:
    problems.append("replicas could split a unit's rows (one replica only)")
  if problems:
    raise DprecError(f"user-level DP (the feature {units_lib.UNIT_KEY!r}) cannot clip per "
                     "unit here: " + "; ".join(problems))


def registry_of(model):
  """`model.layer_registry`, or the default `layer_norms.make_layer_registry()`."""
  return getattr(model, "layer_registry", None) or layer_norms.make_layer_registry()


def _gradient_size(gradient, noised):
  """Nonzero coordinates of a (possibly IndexedSlices, possibly duplicated) gradient. A gradient
  with Gaussian noise on every coordinate (dense, or the DP step's IndexedSlices over distinct
  kept rows) counts as full (nonzero with probability 1), sparing a V×d pass that
  `count_nonzero` would make with an int64 copy, and the sparse path's unique and sum."""
  if noised:
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    return tf.size(values, out_type=tf.int64)
  if isinstance(gradient, tf.IndexedSlices):
    rows, slot = tf.unique(gradient.indices)
    gradient = tf.math.unsorted_segment_sum(gradient.values, slot, tf.size(rows))
  return tf.math.count_nonzero(gradient, dtype=tf.int64)


_VARIABLE_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


@contextlib.contextmanager
def refusing_variable_updates(allowed=()):
  """Refuses a training forward pass that writes variables (BatchNormalization's moving
  statistics, a layer's `assign` or `add_update`): their new values would come from the batch
  with neither clipping nor noise. Checked in the traced step's graph (eager steps: unchecked).
  `allowed`: variables whose writes do not read the batch (Keras 3's dropout seed states)."""
  if tf.executing_eagerly():
    yield
    return
  graph = tf.compat.v1.get_default_graph()
  start = len(graph.get_operations())
  yield
  handles = {id(v.handle) for v in allowed}
  allowed_inputs = {inner.name for outer, inner in getattr(graph, "captures", ())
                    if id(outer) in handles}
  writes = [op.name for op in graph.get_operations()[start:]
            if (op.type in _VARIABLE_WRITES or op.type.startswith("ResourceScatter"))
            and op.inputs[0].name not in allowed_inputs]
  if writes:
    layers = sorted({name.split("/")[0] for name in writes})
    raise DprecError(
        f"the training forward pass updates variables from the batch in layer(s) "
        f"{', '.join(layers)} ({writes[0]}): such updates are neither clipped nor noised, so a DP "
        "model cannot have them; freeze the layer (trainable=False, e.g. a BatchNormalization "
        "with fixed statistics) or remove it (LayerNormalization needs no batch statistics)")


def mixed_class(mixin, cls):
  """`mixin` mixed into the model class `cls`, before it, under `cls`'s name and module: a saved
  model records (and loads as) the original class. One class per pair."""
  if (mixin, cls) not in _MIXED_CLASSES:
    _MIXED_CLASSES[mixin, cls] = type(cls.__name__, (mixin, cls), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
  return _MIXED_CLASSES[mixin, cls]


_MIXED_CLASSES = {}
ROW_STEP_PURPOSE = "row-step noise"  # `NoiseKey.derive` label of `per_step_noise`'s seed


def _row_step_seed(dp_optimizer):
  """The (int, int) seed of `per_step_noise` draws, from the run's noise key."""
  if dp_optimizer.noise_key is None:
    raise DprecError("per_step_noise needs the DPOptimizer's noise_key (or insecure seed)")
  entropy = dp_optimizer.noise_key.entropy(ROW_STEP_PURPOSE)
  return (entropy % 2 ** 63, (entropy >> 64) % 2 ** 63)


class DPStep:
  """The DP step (steps 1–5 of `dprec.models.dp_model`) on the attributes the module docstring
  lists."""

  @property
  def dense_embedding_size(self):
    """Σ V·d over the DP tables: the size of DP-SGD's dense embedding gradient."""
    return sum(rows * width for t in self.dp_step_tables for _, rows, width in t.sub_tables)

  def clip_logs(self):
    """{"l2_norm_clip": C2 after the step} under quantile clipping (a DP release), else {}."""
    clip = self.dp_optimizer.clip
    return {} if clip is None else {"l2_norm_clip": tf.convert_to_tensor(clip)}

  def step_logs(self):
    """`clip_logs`, and with DP tables "gradient_size_reduction": Σ V·d over the epoch's mean
    gradient size (`gradient_size_tracker`, a Keras Mean metric of the binding's)."""
    logs = self.clip_logs()
    if self.dp_step_tables:
      logs["gradient_size_reduction"] = (
          self.dense_embedding_size / tf.maximum(self.gradient_size_tracker.result(), 1.0))
    return logs

  def gradient_size(self, config, grads_and_vars):
    """Nonzero coordinates of the step's DP-table gradients (float32; `_gradient_size`)."""
    tables = self.dp_step_tables
    table_vars = table_variable_ids(tables)
    # Padding columns of a stack get neither gradient nor noise: count what is nonzero.
    padded = table_variable_ids([t for t in tables if t.padded])
    noised = config_lib.is_private(config) and config.noise_multiplier > 0
    sizes = [_gradient_size(g, noised and id(v) not in padded)
             for g, v in grads_and_vars if id(v) in table_vars]
    return tf.cast(tf.add_n(sizes) if sizes else 0, tf.float32)

  def per_example_squared_norms(self, x, y, sample_weight=None, by_group=False):
    """‖g_i‖² per example (per unit at user level) as the compiled DP configuration clips it
    (kept rows only); with `by_group`, [rest, then each `ExtraNorms` with a `norm_share`]
    separately."""
    forward = self._dp_forward(self.dp_optimizer.config, x, y, sample_weight)
    if by_group:
      return [forward.squared] + [squared for _, _, squared in forward.group_squared]
    return tf.add_n([forward.squared] + [squared for _, _, squared in forward.group_squared])

  def dp_gradients(self, x, y, sample_weight=None):
    """The (gradient, variable) pairs one DP step applies: clipped, noised, normalised."""
    return self._dp_gradients(self.dp_optimizer.config, x, y, sample_weight)[0]

  def _dp_forward(self, config, x, y, sample_weight):
    """Step 1, the forward pass (AutoGraph converts it as in any Keras step) of `x` without its
    `UNIT_KEY`, recording what steps 2–3 (`_norms`) need."""
    x, units = units_lib.split_units(x)
    tables = self.dp_step_tables
    layers = self.step_layers()  # the DP tables are in no registry: the recorder skips them
    tape = tf.GradientTape(persistent=True)
    with tape:
      for table in tables:
        table.start_recording()
      try:
        with registry_lib.RegistryRecorder(layers, registry_of(self), tape) as recorder:
          y_pred, losses = self.forward_losses(x, y, sample_weight)
      finally:
        lookups = [table.stop_recording() for table in tables]
      summed_loss = tf.reduce_sum(losses)
      extras = list(self.extra_squared_norms())
    return self._norms(config, tape, tables, lookups, recorder.records, extras, y_pred, losses,
                       summed_loss, units)

  # The DP step's own code (steps 2–5 and the update) has no Python control flow on tensors, and
  # AutoGraph's conversion of it took about half of the step's trace time (13.2–14.5 → 6.7–7.9
  # CPU-s for the 26-table pCTR model, the same graph): it runs unconverted. The `ExtraNorms`
  # functions run inside it.
  @tf.autograph.experimental.do_not_convert
  def _norms(self, config, tape, tables, lookups, records, extras, y_pred, losses, summed_loss,
             units):
    """Steps 2–3: kept rows, per-example squared norms (per unit with `units`)."""
    sub_tables = [sub for t in tables for sub in t.sub_tables]
    layout = kept_rows_lib.TableLayout([name for name, _, _ in sub_tables],
                                       [rows for _, rows, _ in sub_tables],
                                       [t.vocab_size for t in tables])
    self._check_coverage(tables, records, extras)
    if self.losses:
      raise DprecError("regularisation losses (model.losses) are not part of the per-example "
                       "losses the DP step clips; remove the regularizers or add them to "
                       "per_example_loss")
    batch_size = tf.shape(losses, out_type=tf.int64)[0]
    unit_args = ()
    if units is not None:  # the "examples" below are the units
      _refuse_what_user_level_cannot_clip(records, extras, registry_of(self))
      batch_size, unit_args = units.count, (units,)

    # One backward pass to every recorded tensor.
    record_grads, row_grads, extra_grads = tape.gradient(
        summed_loss,
        ([r.watched for r in records], [[l.rows for l in ls] for ls in lookups],
         [e.watched for e in extras]),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    squared, group_squared = tf.zeros([batch_size], losses.dtype), []
    for record, grads in zip(records, record_grads):
      squared += record.squared_norm_fn(grads, *unit_args)
    for extra, grads in zip(extras, extra_grads):
      if extra.norm_share is None:
        squared += extra.squared_norm_fn(grads)
      else:
        group_squared.append((extra, grads, extra.squared_norm_fn(grads)))
    used = [f for f, ls in enumerate(lookups) if ls]
    pairs = {f: embedding_norms.distinct_pairs(lookups[f], tables[f].vocab_size, units)
             for f in used}
    pair_grads = {f: embedding_norms.pair_gradients(pairs[f], lookups[f], row_grads[f])
                  for f in used}
    kept = self._kept_rows(config, layout, tables, pairs, batch_size)
    if used:
      squared += embedding_norms.squared_norms([pairs[f] for f in used],
                                               [pair_grads[f] for f in used],
                                               [kept[f].pair_kept for f in used], batch_size)
    return _Forward(tape, y_pred, losses, squared, group_squared, tables, pairs, pair_grads,
                    kept, records, record_grads, extras, extra_grads, units)

  def _dp_gradients(self, config, x, y, sample_weight):
    """Noisy, normalised gradients of one DP step (module docstring, steps 1–5)."""
    if isinstance(config, config_lib.DPSGDLazy):  # the rows x reads, brought up to date first
      lazy = self._lazy_noise(config)
      upto = tf.cast(self.optimizer.iterations, tf.int64)
      for f, rows in enumerate(self._rows_read(x)):
        lazy.materialise(f, rows, upto, read=True)  # step t's own noise stays pending
    return self._clipped_noisy_gradients(config, self._dp_forward(config, x, y, sample_weight))

  # A binding whose `evaluate`, `predict`, saves and checkpoints call `materialise_pending`
  # first sets this (`DPModel`); lazy noise is refused elsewhere.
  flushes_pending_noise = False

  def lookup_pass(self, x):
    """Hook: runs (at least) every DP-table lookup the training forward pass of `x` makes, for
    lazy noise to know the rows a step reads before it reads them. Default: the inference pass."""
    self(x, training=False)

  def _rows_read(self, x):
    """Per DP table, the distinct local rows `x`'s forward pass reads (`lookup_pass` of `x`
    without its `UNIT_KEY`)."""
    tables = self.dp_step_tables
    for table in tables:
      table.start_recording(ids_only=True)
    try:
      self.lookup_pass(units_lib.split_units(x)[0])
    finally:
      lookups = [table.stop_recording() for table in tables]
    return [tf.unique(tf.concat([tf.reshape(l.ids, [-1]) for l in ls], 0))[0] if ls
            else tf.zeros([0], tf.int64) for ls in lookups]

  def _lazy_noise(self, config):
    """The run's `dprec.sparse.lazy.LazyNoise` (made at the first trace), refusing what lazy
    noise cannot be: a table split over parameter servers, replicas, an optimizer that is not
    SGD on the tables, a normaliser that is not fixed, a binding that does not flush, padding
    columns (which must get no noise)."""
    lazy = getattr(self, "_lazy", None)
    if lazy is not None:
      return lazy
    self.refuse_what_lazy_noise_cannot_run()
    dp = self.dp_optimizer
    seed = _row_step_seed(dp) if config.per_step_noise else None
    lazy = lazy_lib.LazyNoise([t.embeddings for t in self.dp_step_tables], self.optimizer,
                              config_lib.noise_std(config.l2_norm_clip, config.noise_multiplier)
                              / dp.expected_batch_size, self._dp_generator, seed)
    object.__setattr__(self, "_lazy", lazy)
    return lazy

  def refuse_what_lazy_noise_cannot_run(self):
    """Raises a DprecError naming each reason lazy noise cannot run on this compiled model
    (`_lazy_noise`; a workflow calls it before paying for the run)."""
    inner, dp = self.optimizer, self.dp_optimizer
    problems = [
        (not self.flushes_pending_noise, "this Keras binding does not flush pending noise"),
        (not isinstance(inner, (sparse_optimizers.SparseSGD, sparse_optimizers.TableSGD)),
         f"the optimizer is {type(inner).__name__}, not SparseSGD or TableSGD (the noise must "
         "enter the tables linearly)"),
        (isinstance(inner, sparse_optimizers.TableSGD)
         and not all(inner.trains_with_sgd(t.embeddings) for t in self.dp_step_tables),
         "TableSGD was not given the DP tables (`train_tables`): it would run Adam on them"),
        (dp.expected_batch_size is None, "no expected_batch_size (the normaliser must be fixed)"),
        (tf.distribute.has_strategy(), "a tf.distribute strategy (one device only)"),
        (secure_noise_lib.is_secure(self._dp_generator), "secure_noise"),
        (any(t.padded for t in self.dp_step_tables), "stacked tables with padding columns "
         "(stack them at exact widths: --stack-tables 1, `stack_tables=1`)")]
    refused = [reason for bad, reason in problems if bad]
    if refused:
      raise DprecError("dp_sgd_lazy cannot run here: " + "; ".join(refused))

  def materialise_pending(self):
    """Adds every row's pending lazy noise (`DPSGDLazy`): before any release of the weights."""
    lazy = getattr(self, "_lazy", None)
    if lazy is not None:
      lazy.flush()

  @tf.autograph.experimental.do_not_convert  # as `_norms`
  def _clipped_noisy_gradients(self, config, forward):
    """Steps 4–5 after `_dp_forward`: (gradient, variable) pairs and the predictions."""
    tape, y_pred, losses, tables = forward.tape, forward.y_pred, forward.losses, forward.tables
    pairs, pair_grads, kept = forward.pairs, forward.pair_grads, forward.kept
    # Step 4: the clipped sum: book-kept where the layer allows, else a second backward pass.
    # Under quantile clipping C2 is this step's value of `DPOptimizer.clip`.
    adaptive = self.dp_optimizer.clip
    clip = tf.convert_to_tensor(adaptive) if adaptive is not None else None
    clip_factors = tf.stop_gradient(config.clip_factors(
        forward.squared, _rest_share(forward.group_squared), clip=clip))
    units = forward.units  # with units, clip_factors are per unit: every row takes its unit's
    row_factors = clip_factors if units is None else units.of_rows(clip_factors)
    clipped = {}
    for extra, grads, squared in forward.group_squared:
      factors = tf.stop_gradient(config.clip_factors(squared, extra.norm_share, clip=clip))
      clipped.update(zip(map(id, extra.variables), extra.clipped_gradient_fn(grads, factors)))
    for record, grads in zip(forward.records, forward.record_grads):
      if record.clipped_gradient_fn is not None:
        clipped.update(zip(map(id, record.layer.trainable_weights), record.clipped_gradient_fn(
            record.layer, record.args, grads, row_factors)))
    table_vars = table_variable_ids(tables)
    dense_vars = [v for v in self.trainable_variables if id(v) not in table_vars]
    remaining = [v for v in dense_vars if id(v) not in clipped]
    if remaining:
      with tape:
        weighted_loss = self._clipped_loss(forward, row_factors)
      clipped.update(zip(map(id, remaining), tape.gradient(
          weighted_loss, remaining, unconnected_gradients=tf.UnconnectedGradients.ZERO)))
    dense_grads = [clipped[id(v)] for v in dense_vars]
    if clip is not None:
      total_squared = tf.add_n([forward.squared] + [sq for _, _, sq in forward.group_squared])
      centered_count = config.quantile_clipping.centered_count(total_squared, clip)
    del tape, forward

    # Step 5: the clipped sums over all replicas (one outside tf.distribute), then one noise
    # draw on them (`dprec.distribute.replicas`), normalisation.
    replicas = replicas_lib.Replicas()
    table_sums = []
    for f, table in enumerate(tables):
      if f in pairs:
        # A pair whose row is not kept has a row outside the kept rows (kept touched rows are
        # those of kept pairs; false positives are untouched): the noise step drops it.
        values = pair_grads[f] * tf.gather(clip_factors, pairs[f].example)[:, tf.newaxis]
        table_sums.append(replicas.sum_rows(pairs[f].row, values, kept[f].pair_kept))
      else:
        table_sums.append((tf.zeros([0], tf.int64),
                           tf.zeros([0, table.output_dim], losses.dtype)))
    count = tf.shape(losses)[0] if units is None else units.count
    normaliser = (self.dp_optimizer.expected_batch_size
                  or replicas.sum(tf.cast(count, losses.dtype)))
    grads = replicas.once(self._noisy_gradients, config, replicas.sum(dense_grads), table_sums,
                          [k.rows for k in kept], normaliser, clip)
    if clip is not None:  # after the gradient's noise, which used this step's C2
      replicas.once(self._update_clip, config.quantile_clipping, replicas.sum(centered_count),
                    normaliser)
    grads_and_vars = list(zip(grads[:len(dense_vars)], dense_vars))
    for table, grad in zip(tables, grads[len(dense_vars):]):
      grads_and_vars += shard_gradients(grad, table.embeddings)
    return grads_and_vars, y_pred

  def _noisy_gradients(self, config, dense_sums, table_sums, kept_rows, normaliser, clip=None):
    """Step 5 on the clipped sums (dense, and (row, value) pairs per table): noise σ2·C2 on
    dense variables and kept rows (`kept_rows` None: every row), divided by `normaliser`.
    `clip`: this step's adaptive C2 (a tensor); the sums are noised in its units, (S/C2 +
    N(0, σ2²))·C2, so every noise draw keeps a constant standard deviation."""
    generator = self._dp_generator
    std = config_lib.noise_std(config.l2_norm_clip if clip is None else 1.0,
                               config.noise_multiplier)
    if clip is not None:
      dense_sums = [g / clip for g in dense_sums]
      table_sums = [(row, values / clip) for row, values in table_sums]
      normaliser = normaliser / clip
    # An optimizer that corrects for the noise (DP-AdamBC) learns its per-coordinate variance;
    # the rows it falls on are those of each IndexedSlices below (every kept row is noised).
    if isinstance(getattr(self.optimizer, "noise_variance", None), tf.Variable):
      self.optimizer.noise_variance.assign(tf.square(std / normaliser))
    grads = [noise_lib.noisy_dense(g, std, generator) / normaliser for g in dense_sums]
    tables = self.dp_step_tables
    shapes = [(table.vocab_size, table.output_dim) for table in tables]
    table_std = 0.0 if isinstance(config, config_lib.DPSGDLazy) else std  # lazy: pending
    if getattr(config, "per_step_noise", False) and table_std:
      return grads + self._row_step_gradients(std, table_sums, kept_rows, shapes, normaliser)
    sparse = [f for f, rows in enumerate(kept_rows) if rows is not None]
    table_grads = dict(zip(sparse, noise_lib.noisy_sparse_rows(
        [kept_rows[f] for f in sparse], [table_sums[f][0] for f in sparse],
        [table_sums[f][1] for f in sparse], table_std, generator, [shapes[f] for f in sparse],
        [_row_widths(tables[f]) for f in sparse])))
    for f, (row, values) in enumerate(table_sums):
      if f in table_grads:
        grad = table_grads[f]
        grads.append(noise_lib.DistinctRows(grad.values / normaliser, grad.indices,
                                            grad.dense_shape))
      else:
        grads.append(noise_lib.noisy_dense_rows(row, values, std, generator, shapes[f],
                                                normaliser, _row_widths(tables[f])))
    return grads

  def _row_step_gradients(self, std, table_sums, kept_rows, shapes, normaliser):
    """The tables' gradients with `per_step_noise`: this step's keyed draw of every table
    (`dprec.sparse.lazy.row_step_noise`), on all rows (None) or on `kept_rows[f]`."""
    seed, step = _row_step_seed(self.dp_optimizer), self.optimizer.iterations + 1
    grads = []
    for f, ((row, values), rows, shape) in enumerate(zip(table_sums, kept_rows, shapes)):
      noise = lazy_lib.row_step_noise(seed, f, step, shape, std, values.dtype)
      total = tf.tensor_scatter_nd_add(noise, row[:, tf.newaxis], values) / normaliser
      grads.append(total if rows is None else noise_lib.DistinctRows(
          tf.gather(total, rows), rows, tf.constant(shape, tf.int64)))
    return grads

  def _update_clip(self, quantile_clipping, centered_count, normaliser):
    """Quantile clipping's update of `DPOptimizer.clip` from the noisy count (N(0, σ_b²) from
    the step's generator; `dprec.optimizers.config.QuantileClipping`)."""
    noisy = noise_lib.noisy_dense(centered_count, quantile_clipping.count_noise_multiplier,
                                  self._dp_generator)
    clip = self.dp_optimizer.clip
    clip.assign(quantile_clipping.next_clip(clip.read_value(), noisy,
                                            tf.cast(normaliser, clip.dtype)))

  @staticmethod
  def _clipped_loss(forward, clip_factors):
    """Σ c_i·L_i, or the scalar of an `ExtraNorms.clipped_loss_fn` with the same gradient."""
    book_kept = [(extra.clipped_loss_fn, grads)
                 for extra, grads in zip(forward.extras, forward.extra_grads)
                 if extra.clipped_loss_fn is not None]
    if len(book_kept) > 1:
      raise DprecError("at most one ExtraNorms may set clipped_loss_fn: each stands for the "
                       "whole Σ c_i·L_i")
    if book_kept:
      clipped_loss_fn, grads = book_kept[0]
      return clipped_loss_fn(grads, clip_factors)
    return tf.reduce_sum(clip_factors * forward.losses)

  def _kept_rows(self, config, layout, tables, pairs, batch_size):
    """Per-table kept rows; unused tables get empty pair sets."""
    empty = embedding_norms.Pairs(tf.zeros([0], tf.int64), tf.zeros([0], tf.int64),
                                  tf.zeros([0], tf.int64))
    return kept_rows_lib.select_kept_rows(
        config, layout, [pairs.get(f, empty) for f in range(len(tables))], batch_size,
        self._dp_generator)

  def _check_coverage(self, tables, records, extras):
    """Every trainable variable needs a per-example norm; refuse silently unclipped ones."""
    covered = table_variable_ids(tables)
    for record in records:
      covered.update(id(w) for w in record.layer.trainable_weights)
    for extra in extras:
      covered.update(id(v) for v in extra.variables)
    registry_lib.refuse_uncovered(self.step_layers(), self.trainable_variables, covered,
                                  registry_of(self), "the DP step")
