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

from dprec.errors import DprecError
from dprec.layers.embedding import DPEmbedding
from dprec.models import dp_step
from dprec.models.dp_step import refusing_variable_updates
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer


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


def unique_by_identity(items):
  """`items` without repeats (by object identity), in first-seen order."""
  seen, result = set(), []
  for item in items:
    if id(item) not in seen:
      seen.add(id(item))
      result.append(item)
  return result


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


_FUNCTIONAL_VARIANTS = {}


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


class DPModel(tf.keras.Model, dp_step.DPStep):
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

  # Lazy noise (`config.DPSGDLazy`): the weights are flushed before they leave `fit`, and before
  # every evaluation, prediction and save (checkpoints: `training.callbacks.CheckpointCallback`).
  flushes_pending_noise = True

  def fit(self, *args, **kwargs):
    try:
      return super().fit(*args, **kwargs)
    finally:
      self.materialise_pending()

  def evaluate(self, *args, **kwargs):
    self.materialise_pending()
    return super().evaluate(*args, **kwargs)

  def predict(self, *args, **kwargs):
    self.materialise_pending()
    return super().predict(*args, **kwargs)

  def save(self, *args, **kwargs):
    self.materialise_pending()
    return super().save(*args, **kwargs)

  def save_weights(self, *args, **kwargs):
    self.materialise_pending()
    return super().save_weights(*args, **kwargs)

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

  def train_step(self, data):
    x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
    y_pred = self.apply_step(x, y, sample_weight)
    if config_lib.is_private(self.dp_optimizer.config):
      self.compute_loss(x, y, y_pred, sample_weight)  # reported loss: the unclipped mean
    logs = self.compute_metrics(x, y, y_pred, sample_weight)
    return dict(logs, **self.step_logs())

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
    if self.dp_tables:
      self.gradient_size_tracker.update_state(self.gradient_size(config, grads_and_vars))
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

  def step_layers(self):
    """Every Keras layer inside the model (`DPStep`'s hook)."""
    return [m for m in self.submodules if isinstance(m, tf.keras.layers.Layer)]
