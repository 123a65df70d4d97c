"""`DPModel`: a Keras model whose `train_step` is the sparse DP step.

    model = DPModel(inputs, outputs)            # functional, or subclass DPModel
    model.compile(optimizer=DPOptimizer(DPAdaFEST(...), inner=SparseAdagrad(0.05),
                                        expected_batch_size=q * N),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True), metrics=[...])
    model.fit(dataset)                          # batches may vary in size (Poisson sampling)

One step, with one forward pass:
1. `DPEmbedding` layers record their lookups; every layer whose class is in the model's layer
   registry (`DPModel.layer_registry`, default `dprec.clipping.layer_norms.make_layer_registry`,
   whose docstring lists its layers) runs through its norm function (`dprec.clipping.registry`).
2. Kept rows (`dprec.sparse.kept_rows`): all (DP-SGD), the DP-FEST set, or the rows a DP-AdaFEST
   contribution map selects, false positives included.
3. Per-example squared norms from one backward pass to the recorded tensors: registry layers,
   embeddings restricted to kept rows, and the `extra_squared_norms` hook; clip factor
   c_i = min(1, C2/‖g_i‖) over all of them jointly, except for an `ExtraNorms` with a
   `norm_share` F: its variables are clipped on their own to C2·√F and the rest to
   C2·√(1 − ΣF) (per-group clipping, McMahan et al. 2018), so the sensitivity stays C2.
4. Clipped sum book-kept from that pass for layers registered with a clipped-gradient function
   (Dense: a_iᵀ·c_i·g_i) and embedding rows
   (c_i times the per-(example, row) gradients of kept rows); other variables by a second
   backward pass of Σ c_i·L_i, or of the book-kept scalar of `ExtraNorms.clipped_loss_fn`.
5. Noise σ2·C2 on dense variables and kept rows only (`dprec.sparse.noise`), divided by the
   expected batch size; the inner optimizer applies IndexedSlices row-sparsely (an optimizer
   with a `noise_variance` variable, `AdamBC`, is told (σ2·C2/B)²).
Under a `tf.distribute` strategy (`dprec.distribute`) each replica clips its examples, the clipped
sums and DP-AdaFEST contribution maps are summed over the replicas, and every draw is made once on
the global sums: the step equals the one-device step on the global batch.
The non-private configuration is the ordinary Keras step (sparse embedding gradients).
Models with `DPEmbedding` tables log `gradient_size` (nonzero embedding-gradient coordinates after
noise, mean over the epoch) and `gradient_size_reduction` (Σ V·d of the DP tables divided by it;
Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357, §5.4).
"""
import collections
import contextlib
import functools
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from dprec.clipping import embedding as embedding_norms
from dprec.clipping import layer_norms
from dprec.clipping import registry as registry_lib
from dprec.distribute import replicas as replicas_lib
from dprec.errors import DprecError
from dprec.layers.embedding import DPEmbedding
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.sparse import kept_rows as kept_rows_lib
from dprec.sparse import noise as noise_lib


class ExtraNorms(collections.namedtuple("ExtraNorms",
                                        ["variables", "watched", "squared_norm_fn",
                                         "clipped_loss_fn", "norm_share",
                                         "clipped_gradient_fn"], defaults=[None, None, None])):
  """What `DPModel.extra_squared_norms` returns for variables it handles itself.

  variables: the `tf.Variable`s covered (excluded from the registry and DP-embedding paths;
    they get dense noise and their clipped gradient from the backward pass of Σ c_i·L_i).
  watched: (nested) tensors computed in this step's forward pass, e.g. a tied embedding's
    lookup output and the input of its output projection.
  squared_norm_fn: maps the summed-loss gradients of `watched` (same structure) to the
    per-example squared gradient norms [batch] of all of `variables` together.
  clipped_loss_fn: optional book-keeping (Bu et al., Li et al., "Large Language Models Can Be Strong
  Differentially Private Learners", arXiv:2110.05679): maps (the gradients of
    `watched`, clip factors c [batch]) to a scalar whose gradient w.r.t. every variable not
    book-kept elsewhere (registry Dense layers, `DPEmbedding`) equals that of Σ c_i·L_i,
    e.g. Σ ⟨stop_gradient(c-weighted gradient), t⟩ over tensors t through which alone the
    loss depends on those variables. The second backward pass then starts there instead of
    re-running the backward pass of the layers between t and the loss (for DPFormer, the
    P×M softmax). Called inside the step's tape; at most one `ExtraNorms` of a model may set it.
  norm_share: optional F in (0, 1): `variables` form their own clipping group with F of C² (the
    rest of the model gets 1 − F); needs `clipped_gradient_fn`.
  clipped_gradient_fn: maps (the gradients of `watched`, the group's clip factors c [batch]) to
    Σ_i c_i·g_i for each of `variables` (book-kept, like the registry's Dense layers).
  The functions run inside the DP step's own code, which AutoGraph does not convert: conditions
  on tensors need `tf.cond` / `tf.where`, not Python `if`.
  """
  variables: Sequence[tf.Variable]
  watched: Any
  squared_norm_fn: Callable[[Any], tf.Tensor]
  clipped_loss_fn: Optional[Callable[[Any, tf.Tensor], tf.Tensor]]
  norm_share: Optional[float]
  clipped_gradient_fn: Optional[Callable[[Any, tf.Tensor], Sequence[tf.Tensor]]]


_Forward = collections.namedtuple(
    "_Forward", ["tape", "y_pred", "losses", "squared", "group_squared", "tables", "pairs",
                 "pair_grads", "kept", "records", "record_grads", "extras", "extra_grads"])


def _rest_share(group_squared):
  """The share of C² left to the variables outside the `norm_share` groups."""
  shares = [extra.norm_share for extra, _, _ in group_squared]
  if any(extra.clipped_gradient_fn is None for extra, _, _ in group_squared):
    raise DprecError("an ExtraNorms with norm_share needs clipped_gradient_fn")
  if not all(0 < share < 1 for share in shares) or sum(shares) >= 1:
    raise DprecError(f"norm shares must be in (0, 1) and sum to less than 1, got {shares}")
  return 1.0 - sum(shares)


def unique_by_identity(items):
  """`items` without repeats (by object identity), in first-seen order."""
  seen, result = set(), []
  for item in items:
    if id(item) not in seen:
      seen.add(id(item))
      result.append(item)
  return result


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


def _table_variable_ids(tables):
  """ids of the tables' variables: each table's, or the shards of a table partitioned by rows
  across parameter servers (a `ShardedVariable`, `dprec.distribute.parameter_server`)."""
  return {id(v) for t in tables
          for v in [t.embeddings, *getattr(t.embeddings, "variables", [])]}


def _shard_gradients(gradient, table):
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
  return [(tf.IndexedSlices(gradient.values[bounds[s]:bounds[s + 1]],
                            gradient.indices[bounds[s]:bounds[s + 1]] - starts[s],
                            tf.constant(shard.shape.as_list(), tf.int64)), shard)
          for s, shard in enumerate(table.variables)]


def _row_widths(table):
  """A stacked table's `noise.RowWidths` (None for one table filling its variable)."""
  if len(table.sub_tables) == 1 and not table.padded:
    return None
  return noise_lib.RowWidths([rows for _, rows, _ in table.sub_tables],
                             [width for _, _, width in table.sub_tables])


def per_example_losses(loss, y, y_pred, sample_weight=None):
  """Per-example losses [batch] (weighted) of a Keras loss (object, class name or function),
  without its reduction; trailing axes are averaged, as Keras' reduction does. Refuses a loss
  that returns one value per batch."""
  loss = tf.keras.losses.get(loss)
  if isinstance(y, tf.Tensor) and isinstance(y_pred, tf.Tensor) and y.shape.rank == 1:
    # Keras reduces a loss's last axis, which for labels [n] would be the batch axis.
    y = y[:, tf.newaxis]
    if y_pred.shape.rank == 1:
      y_pred = y_pred[:, tf.newaxis]
  if isinstance(loss, tf.keras.losses.Loss):
    config = loss.get_config()
    config["reduction"] = tf.keras.losses.Reduction.NONE
    losses = type(loss).from_config(config)(y, y_pred, sample_weight)
  else:
    losses = loss(y, y_pred)
    if sample_weight is not None:
      losses *= tf.reshape(tf.cast(sample_weight, losses.dtype), tf.shape(losses))
  if losses.shape.rank == 0:
    raise DprecError(f"the loss {getattr(loss, '__name__', type(loss).__name__)} returns one "
                     "value per batch, not one per example: DP clipping needs per-example "
                     "losses (a Keras loss, or a function returning a loss per example)")
  if losses.shape.rank > 1:
    losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
  return losses


def registry_of(model):
  """`model.layer_registry`, or the default `layer_norms.make_layer_registry()`."""
  return getattr(model, "layer_registry", None) or layer_norms.make_layer_registry()


_FUNCTIONAL_VARIANTS = {}


_VARIABLE_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


@contextlib.contextmanager
def refusing_variable_updates():
  """Refuses a training forward pass that writes variables (BatchNormalization's moving
  statistics, a layer's `assign` or `add_update`): their new values would come from the batch
  with neither clipping nor noise. Checked in the traced step's graph (eager steps: unchecked)."""
  if tf.executing_eagerly():
    yield
    return
  graph = tf.compat.v1.get_default_graph()
  start = len(graph.get_operations())
  yield
  writes = [op.name for op in graph.get_operations()[start:]
            if op.type in _VARIABLE_WRITES or op.type.startswith("ResourceScatter")]
  if writes:
    layers = sorted({name.split("/")[0] for name in writes})
    raise DprecError(
        f"the training forward pass updates variables from the batch in layer(s) "
        f"{', '.join(layers)} ({writes[0]}): such updates are neither clipped nor noised, so a DP "
        "model cannot have them; freeze the layer (trainable=False, e.g. a BatchNormalization "
        "with fixed statistics) or remove it (LayerNormalization needs no batch statistics)")


@functools.lru_cache(maxsize=None)
def _functional_class():
  """Keras 2's functional-model class, which it does not export: the type of a functional
  model built through the public API."""
  inputs = tf.keras.Input((1,))
  return type(tf.keras.Model(inputs, inputs))


def _is_functional_init(args, kwargs):
  """Whether Model(...) was called with inputs and outputs (Keras 2's functional signature)."""
  return (len(args) == 2 or (len(args) == 1 and "outputs" in kwargs)
          or ("inputs" in kwargs and "outputs" in kwargs))


class DPModel(tf.keras.Model):
  """A `tf.keras.Model` trained by the DP step of the `DPOptimizer` given to `compile`.

  Build it functionally, `DPModel(inputs, outputs)`, or subclass it. (Keras 2 turns a Model
  subclass called with inputs/outputs into a functional model by rewriting the class's bases
  for good, which would break every later subclass; a functional DPModel is instead an
  instance of a separate `(cls, Functional)` class.)
  """

  def __new__(cls, *args, **kwargs):
    functional = _functional_class()
    if _is_functional_init(args, kwargs) and not issubclass(cls, functional):
      if cls not in _FUNCTIONAL_VARIANTS:
        _FUNCTIONAL_VARIANTS[cls] = type(cls.__name__, (cls, functional),
                                         {"__module__": cls.__module__})
      cls = _FUNCTIONAL_VARIANTS[cls]
    return super().__new__(cls, *args, **kwargs)

  def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
    """As `tf.keras.Model.compile`; `optimizer` may be a `DPOptimizer` (a plain optimizer means
    `NonPrivate`). XLA is off: the step's shapes vary from batch to batch."""
    if not isinstance(optimizer, DPOptimizer):
      optimizer = DPOptimizer(config_lib.NonPrivate(), optimizer)
    kwargs["jit_compile"] = False
    super().compile(optimizer=optimizer.inner, loss=loss, metrics=metrics, **kwargs)
    # Plain attributes, not tracked weights: get_weights(), save_weights() and checkpoints never
    # hold the generator (its state would reveal the noise key).
    object.__setattr__(self, "dp_optimizer", optimizer)
    object.__setattr__(self, "_dp_generator", optimizer.generator)
    if self.dp_tables and getattr(self, "gradient_size_tracker", None) is None:
      # Once: recompiling keeps one. Models without DP tables log no gradient size.
      self.gradient_size_tracker = tf.keras.metrics.Mean(name="gradient_size")
    if self.dp_tables:
      self.gradient_size_tracker.reset_state()

  # ---------------------------------------------------------------- hooks for subclasses
  layer_registry = None  # a dprec.clipping.LayerRegistry; None: layer_norms.make_layer_registry()

  def per_example_loss(self, y, y_pred, sample_weight=None):
    """Per-example losses [batch] (weighted); the compiled loss without reduction by default
    (`per_example_losses`)."""
    return per_example_losses(self.loss, y, y_pred, sample_weight)

  def forward_losses(self, x, y, sample_weight=None):
    """Hook: the training forward pass of a DP step, (predictions, per-example losses [batch]).
    Default: `self(x, training=True)` (refusing variable updates) and `per_example_loss`."""
    with refusing_variable_updates():
      y_pred = self(x, training=True)
    return y_pred, self.per_example_loss(y, y_pred, sample_weight)

  def extra_squared_norms(self):
    """Hook: per-example squared norms of variables neither the layer registry nor
    `DPEmbedding` handles (e.g. a tied embedding used twice, whose norm is not a sum of
    per-use norms). Called after the forward pass, inside the step's tape; return a list of
    `ExtraNorms`. Default: none."""
    return []

  # ---------------------------------------------------------------- the step
  @property
  def dp_tables(self):
    """The model's trainable `DPEmbedding` layers, in a fixed order: those the DP step trains.
    A frozen one (`trainable=False`) is a plain lookup of public weights: no norm, no noise, no
    update, not part of the gradient size."""
    return unique_by_identity(m for m in self.submodules
                              if isinstance(m, DPEmbedding) and m.trainable)

  @property
  def dp_step_tables(self):
    """`dp_tables` by increasing width (model order among equal widths): the order of the DP
    step's global row ids and of its noise draws. A model whose tables are stacked
    (`DPMultiEmbedding(stack_tables=...)`) holds them in this order, so it draws the same noise
    for the same rows as its unstacked twin."""
    return sorted(self.dp_tables, key=lambda t: t.output_dim)

  @property
  def dense_embedding_size(self):
    """Σ V·d over the DP tables: the size of DP-SGD's dense embedding gradient."""
    return sum(rows * width for t in self.dp_tables for _, rows, width in t.sub_tables)

  def train_step(self, data):
    x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
    y_pred = self.apply_step(x, y, sample_weight)
    if config_lib.is_private(self.dp_optimizer.config):
      self.compute_loss(x, y, y_pred, sample_weight)  # reported loss: the unclipped mean
    logs = self.compute_metrics(x, y, y_pred, sample_weight)
    if self.dp_tables:
      logs["gradient_size_reduction"] = (
          self.dense_embedding_size / tf.maximum(self.gradient_size_tracker.result(), 1.0))
    return dict(logs, **self.clip_logs())

  def clip_logs(self):
    """{"l2_norm_clip": C2 after the step} under quantile clipping (a DP release), else {}."""
    clip = self.dp_optimizer.clip
    return {} if clip is None else {"l2_norm_clip": tf.convert_to_tensor(clip)}

  def apply_step(self, x, y, sample_weight=None):
    """One training step on a batch (DP or not, as compiled); returns the predictions (what
    `forward_losses` returned as such in a DP step)."""
    config = self.dp_optimizer.config
    if config_lib.is_private(config):
      grads_and_vars, y_pred = self._dp_gradients(config, x, y, sample_weight)
    else:
      with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight)
      grads_and_vars = list(zip(tape.gradient(loss, self.trainable_variables),
                                self.trainable_variables))
    self._apply_gradients(config, grads_and_vars)
    return y_pred

  @tf.autograph.experimental.do_not_convert  # as `_norms`
  def _apply_gradients(self, config, grads_and_vars):
    """The gradient-size metric, and the inner optimizer's update."""
    tables = self.dp_tables
    if tables:
      table_vars = _table_variable_ids(tables)
      # Padding columns of a stack get neither gradient nor noise: count what is nonzero.
      padded = _table_variable_ids([t for t in tables if t.padded])
      noised = config_lib.is_private(config) and config.noise_multiplier > 0
      sizes = [_gradient_size(g, noised and id(v) not in padded)
               for g, v in grads_and_vars if id(v) in table_vars]
      self.gradient_size_tracker.update_state(
          tf.cast(tf.add_n(sizes) if sizes else 0, tf.float32))
    deferred = getattr(self, "_deferred_updates", None)
    if deferred is not None:  # the caller applies them (`deferring_updates`)
      deferred.extend(grads_and_vars)
      return
    # A DP step's gradients are already summed over the replicas (`_dp_gradients`).
    self.optimizer.apply_gradients(
        grads_and_vars, experimental_aggregate_gradients=not config_lib.is_private(config))

  @contextlib.contextmanager
  def deferring_updates(self):
    """While open (around the tracing of `train_step`), the step records its (gradient,
    variable) pairs in the yielded list instead of applying them, for a caller that applies
    each step's update itself, exactly once (a parameter-server chief:
    `dprec.distribute.parameter_server`)."""
    recorded = []
    object.__setattr__(self, "_deferred_updates", recorded)
    try:
      yield recorded
    finally:
      object.__setattr__(self, "_deferred_updates", None)

  def per_example_squared_norms(self, x, y, sample_weight=None, by_group=False):
    """‖g_i‖² per example as the compiled DP configuration clips it (kept rows only); with
    `by_group`, [rest, then each `ExtraNorms` with a `norm_share`] separately."""
    forward = self._dp_forward(self.dp_optimizer.config, x, y, sample_weight)
    if by_group:
      return [forward.squared] + [squared for _, _, squared in forward.group_squared]
    return tf.add_n([forward.squared] + [squared for _, _, squared in forward.group_squared])

  def dp_gradients(self, x, y, sample_weight=None):
    """The (gradient, variable) pairs one DP step applies: clipped, noised, normalised."""
    return self._dp_gradients(self.dp_optimizer.config, x, y, sample_weight)[0]

  def _dp_forward(self, config, x, y, sample_weight):
    """Step 1, the forward pass (AutoGraph converts it as in any Keras step), recording what
    steps 2–3 (`_norms`) need."""
    tables = self.dp_step_tables
    layers = [m for m in self.submodules
              if isinstance(m, tf.keras.layers.Layer) and not isinstance(m, DPEmbedding)]
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
                       summed_loss)

  # The DP step's own code (steps 2–5 and the update) has no Python control flow on tensors, and
  # AutoGraph's conversion of it took about half of the step's trace time (13.2–14.5 → 6.7–7.9
  # CPU-s for the 26-table pCTR model, the same graph): it runs unconverted. The `ExtraNorms`
  # functions run inside it.
  @tf.autograph.experimental.do_not_convert
  def _norms(self, config, tape, tables, lookups, records, extras, y_pred, losses, summed_loss):
    """Steps 2–3: kept rows, per-example squared norms."""
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

    # One backward pass to every recorded tensor.
    record_grads, row_grads, extra_grads = tape.gradient(
        summed_loss,
        ([r.watched for r in records], [[l.rows for l in ls] for ls in lookups],
         [e.watched for e in extras]),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    squared, group_squared = tf.zeros([batch_size], losses.dtype), []
    for record, grads in zip(records, record_grads):
      squared += record.squared_norm_fn(grads)
    for extra, grads in zip(extras, extra_grads):
      if extra.norm_share is None:
        squared += extra.squared_norm_fn(grads)
      else:
        group_squared.append((extra, grads, extra.squared_norm_fn(grads)))
    used = [f for f, ls in enumerate(lookups) if ls]
    pairs = {f: embedding_norms.distinct_pairs(lookups[f], tables[f].vocab_size) for f in used}
    pair_grads = {f: embedding_norms.pair_gradients(pairs[f], lookups[f], row_grads[f])
                  for f in used}
    kept = self._kept_rows(config, layout, tables, pairs, batch_size)
    if used:
      squared += embedding_norms.squared_norms([pairs[f] for f in used],
                                               [pair_grads[f] for f in used],
                                               [kept[f].pair_kept for f in used], batch_size)
    return _Forward(tape, y_pred, losses, squared, group_squared, tables, pairs, pair_grads,
                    kept, records, record_grads, extras, extra_grads)

  def _dp_gradients(self, config, x, y, sample_weight):
    """Noisy, normalised gradients of one DP step (module docstring, steps 1–5)."""
    return self._clipped_noisy_gradients(config, self._dp_forward(config, x, y, sample_weight))

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
    clipped = {}
    for extra, grads, squared in forward.group_squared:
      factors = tf.stop_gradient(config.clip_factors(squared, extra.norm_share, clip=clip))
      clipped.update(zip(map(id, extra.variables), extra.clipped_gradient_fn(grads, factors)))
    for record, grads in zip(forward.records, forward.record_grads):
      if record.clipped_gradient_fn is not None:
        clipped.update(zip(map(id, record.layer.trainable_weights), record.clipped_gradient_fn(
            record.layer, record.args, grads, clip_factors)))
    table_vars = _table_variable_ids(tables)
    dense_vars = [v for v in self.trainable_variables if id(v) not in table_vars]
    remaining = [v for v in dense_vars if id(v) not in clipped]
    if remaining:
      with tape:
        weighted_loss = self._clipped_loss(forward, clip_factors)
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
    normaliser = (self.dp_optimizer.expected_batch_size
                  or replicas.sum(tf.cast(tf.shape(losses)[0], losses.dtype)))
    grads = replicas.once(self._noisy_gradients, config, replicas.sum(dense_grads), table_sums,
                          [k.rows for k in kept], normaliser, clip)
    if clip is not None:  # after the gradient's noise, which used this step's C2
      replicas.once(self._update_clip, config.quantile_clipping, replicas.sum(centered_count),
                    normaliser)
    grads_and_vars = list(zip(grads[:len(dense_vars)], dense_vars))
    for table, grad in zip(tables, grads[len(dense_vars):]):
      grads_and_vars += _shard_gradients(grad, table.embeddings)
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
    sparse = [f for f, rows in enumerate(kept_rows) if rows is not None]
    table_grads = dict(zip(sparse, noise_lib.noisy_sparse_rows(
        [kept_rows[f] for f in sparse], [table_sums[f][0] for f in sparse],
        [table_sums[f][1] for f in sparse], std, generator, [shapes[f] for f in sparse],
        [_row_widths(tables[f]) for f in sparse])))
    for f, (row, values) in enumerate(table_sums):
      if f in table_grads:
        grad = table_grads[f]
        grads.append(tf.IndexedSlices(grad.values / normaliser, grad.indices, grad.dense_shape))
      else:
        grads.append(noise_lib.noisy_dense_rows(row, values, std, generator, shapes[f],
                                                normaliser, _row_widths(tables[f])))
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
    covered = _table_variable_ids(tables)
    for record in records:
      covered.update(id(w) for w in record.layer.trainable_weights)
    for extra in extras:
      covered.update(id(v) for v in extra.variables)
    registry_lib.refuse_uncovered(self, covered, registry_of(self), "the DP step")
