"""The Keras 3 binding (TensorFlow backend): what of the DP step touches Keras 3 — finding the
layers, reading the weights, the layer classes of the norm registry, the loss per example,
`compile` and `train_step` — around the step's mathematics, which is written once
(`dprec.models.dp_step.DPStep`, the norm functions of `dprec.clipping.layer_norms`, selection
and noise in `dprec.sparse`).

    model = dp_model(keras.Model(inputs, outputs))     # in place: a Keras3DPModel
    model.compile(DPOptimizer(DPSGD(1.0, σ), keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(dataset)                                 # one DP step a batch

`keras.layers.Dense`, `EinsumDense` (so `MultiHeadAttention`) and `LayerNormalization` go
through the norm registry, every trainable `keras.layers.Embedding` is a DP table (`DPTable`:
the rows of DP-SGD, DP-FEST or DP-AdaFEST, noise on kept rows only); Keras 3's SGD and Adagrad
update only an IndexedSlices gradient's rows already, its Adam does not (`LazyAdam` here does).
`dprec.make_private` uses it for Keras 3 models (`dprec.workflows.private_keras3`).
"""
import sys

import keras
import tensorflow as tf

from dprec.clipping import layer_norms
from dprec.errors import DprecError
from dprec.layers import embedding as embedding_lib
from dprec.models import dp_step
from dprec.optimizers import sparse as sparse_optimizers
from dprec.optimizers.dp_optimizer import DPOptimizer

# Keras 3 options of the twins that change their weights or their computation.
_UNSHARED = {"lora_enabled": "LoRA (lora_rank)", "quantization_mode": "quantization",
             "rms_scaling": "RMS scaling"}


def keras3():
  """The process's Keras 3 module (`import keras` on TensorFlow ≥ 2.16), or None."""
  keras = sys.modules.get("keras")
  if keras is None or int(keras.__version__.split(".")[0]) < 3:
    return None
  return keras


def is_keras3_model(model) -> bool:
  keras = keras3()
  return keras is not None and isinstance(model, keras.Model)


def check_backend():
  """Refuses a Keras 3 whose backend is not TensorFlow (the DP step is TensorFlow code)."""
  backend = keras3().backend.backend()
  if backend != "tensorflow":
    raise DprecError(f"dprec trains Keras 3 models on the TensorFlow backend, not {backend}: "
                     "set KERAS_BACKEND=tensorflow before keras is imported")


def make_layer_registry():
  """`dprec.clipping.layer_norms`' registrations for the Keras 3 classes of their names."""
  return layer_norms.make_layer_registry(keras3().layers)


def layers(model):
  """Every layer inside `model`, nested ones included, each once (Keras 3 has no public
  recursive listing; `_flatten_layers` is what its own `Model.summary` uses). Refuses what
  Keras 3 adds to a twin and the shared norm functions do not compute (`_UNSHARED`)."""
  found = list(model._flatten_layers(include_self=False, recursive=True))
  for layer in found:
    for attribute, what in _UNSHARED.items():
      if getattr(layer, attribute, None):
        raise DprecError(f"layer {layer.name!r} ({type(layer).__name__}) uses {what}, which "
                         "dprec's per-example norms do not cover yet: build it without")
  return found


def per_example_losses(loss, y, y_pred):
  """Per-example losses [batch] of a Keras 3 loss (object, name or function) without its
  reduction; trailing axes averaged."""
  loss = keras3().losses.get(loss)
  if isinstance(loss, keras3().losses.Loss):
    config = loss.get_config()
    config["reduction"] = None
    loss = type(loss).from_config(config)
  losses = tf.convert_to_tensor(loss(y, y_pred))
  if losses.shape.rank == 0:
    raise DprecError("the loss returns one value per batch, not one per example: DP clipping "
                     "needs per-example losses")
  if losses.shape.rank > 1:
    losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
  return losses


class LazyAdam(keras.optimizers.Adam):
  """Keras 3's Adam whose IndexedSlices update touches only the gradient's rows of m, v and the
  variable (`dprec.optimizers.sparse.lazy_adam_rows`, as tf.keras' `LazyAdam`); Keras 3's own
  Adam moves every row its moments hold, so a DP-AdaFEST row keeps moving on later steps that did
  not keep it."""

  def update_step(self, gradient, variable, learning_rate):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable, learning_rate)
    index = self._get_variable_index(variable)
    return sparse_optimizers.lazy_adam_rows(
        self, gradient, _tf_variable(variable), _tf_variable(self._momentums[index]),
        _tf_variable(self._velocities[index]), learning_rate)


def _tf_variable(variable):
  """The `tf.Variable` behind a Keras 3 variable (the optimizer may hand over either)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


def _seed_states(model):
  """The `tf.Variable` states of the model's `keras.random.SeedGenerator`s (a Dropout's): a
  step advances them whatever the batch holds."""
  return [_tf_variable(value.state) for layer in [model, *layers(model)]
          for value in vars(layer).values() if isinstance(value, keras.random.SeedGenerator)]


class DPTable:
  """A Keras 3 `keras.layers.Embedding` as a DP table of the step: the recording protocol of
  `dprec.layers.embedding.DPEmbedding` (whose lookup it runs, ids of rank 1 or 2, pads -1
  giving zero rows, as a converted tf.keras table), with the layer's `call` routed through it
  while the step records."""

  padded = False
  combiner = None
  pad_id = -1
  _ids_only = False  # lazy noise's look ahead does not run on Keras 3
  _gather = embedding_lib.DPEmbedding._gather

  def __init__(self, layer):
    try:
      embedding_lib.refuse_untabled_options(layer)
    except ValueError as error:
      raise DprecError(str(error)) from None
    self.layer, self.table_name = layer, layer.name
    self.vocab_size, self.output_dim = int(layer.input_dim), int(layer.output_dim)
    self.sub_tables = [(self.table_name, self.vocab_size, self.output_dim)]
    self._recording = None

  @property
  def embeddings(self):
    return self.layer.embeddings

  @property
  def input_shape(self):
    """The shape of the ids a functional model feeds the table (AttributeError otherwise)."""
    return tuple(self.layer.input.shape)

  def start_recording(self):
    self._recording = []
    lookup = embedding_lib.DPEmbedding.call
    object.__setattr__(self.layer, "call", lambda inputs, *_, **__: lookup(self, inputs))

  def stop_recording(self):
    object.__delattr__(self.layer, "call")
    lookups, self._recording = self._recording, None
    return lookups


class Keras3DPModel(dp_step.DPStep):
  """The DP step of a Keras 3 model: mixed into the model's class (`dp_model`), before it, as
  `dprec.models.dp_model.DPModel` is a tf.keras model. `compile` takes a `DPOptimizer` (its
  inner optimizer a Keras 3 one) and the loss; `fit` runs `train_step`, one DP step a batch."""

  def compile(self, optimizer, loss=None, metrics=None, **kwargs):
    """As `keras.Model.compile`, with a `DPOptimizer`. XLA is off: the step's shapes vary from
    batch to batch."""
    if not isinstance(optimizer, DPOptimizer):
      raise DprecError(f"a Keras 3 DP model compiles with a DPOptimizer, got "
                       f"{type(optimizer).__name__}")
    check_backend()
    kwargs["jit_compile"] = False
    super().compile(optimizer=optimizer.inner, loss=loss, metrics=metrics, **kwargs)
    # Plain attributes, not tracked: saving never holds the generator (it would reveal the key).
    object.__setattr__(self, "dp_optimizer", optimizer)
    object.__setattr__(self, "_dp_generator", optimizer.generator)
    if self.dp_step_tables and getattr(self, "gradient_size_tracker", None) is None:
      # Once (recompiling keeps it): a metric of the model, reset every epoch, in the logs.
      self.gradient_size_tracker = keras.metrics.Mean(name="gradient_size")

  def get_compile_config(self):
    """Keras' compile config, with `LazyAdam` saved as the `keras.optimizers.Adam` it updates
    like (same hyperparameters and slots): a saved model loads without dprec."""
    config = super().get_compile_config()
    if isinstance(self.optimizer, LazyAdam):
      config["optimizer"] = keras.saving.serialize_keras_object(
          keras.optimizers.Adam.from_config(self.optimizer.get_config()))
    return config

  @property
  def layer_registry(self):
    return make_layer_registry()

  @property
  def dp_step_tables(self):
    """Every trainable `keras.layers.Embedding` as a `DPTable` (as make_private converts
    tf.keras ones), by increasing width: the step's order."""
    embedding = keras.layers.Embedding
    return sorted([DPTable(layer) for layer in layers(self)
                   if type(layer) is embedding and layer.trainable],
                  key=lambda t: t.output_dim)

  def step_layers(self):
    """The model's layers but its DP tables (their lookups are recorded, not routed)."""
    tabled = {id(table.layer) for table in self.dp_step_tables}
    return [layer for layer in layers(self) if id(layer) not in tabled]

  def extra_squared_norms(self):
    return []

  def forward_losses(self, x, y, sample_weight=None):
    if sample_weight is not None:
      raise DprecError("the Keras 3 binding takes no sample weights")
    with dp_step.refusing_variable_updates(_seed_states(self)):
      y_pred = self(x, training=True)
    return y_pred, per_example_losses(self.loss, y, y_pred)

  def apply_step(self, x, y):
    """One DP step on the batch (x, y), applied by the inner optimizer; returns predictions."""
    config = self.dp_optimizer.config
    grads_and_vars, y_pred = self._dp_gradients(config, x, y, None)
    if self.dp_step_tables:
      self.gradient_size_tracker.update_state(self.gradient_size(config, grads_and_vars))
    self.optimizer.apply_gradients(grads_and_vars)
    return y_pred

  def train_step(self, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = self.apply_step(x, y)
    # The reported loss: the unclipped mean (Keras' own train_step tracks it so).
    self._loss_tracker.update_state(self.compute_loss(x, y, y_pred, sample_weight),
                                    sample_weight=tf.shape(y_pred)[0])
    return dict(self.compute_metrics(x, y, y_pred, sample_weight), **self.step_logs())


def dp_model(model):
  """Makes the Keras 3 `model` a `Keras3DPModel` in place (`dp_step.mixed_class`); returns it."""
  if not is_keras3_model(model):
    raise DprecError(f"a Keras 3 DP model needs a Keras 3 model, got {type(model).__name__}")
  check_backend()
  model.__class__ = dp_step.mixed_class(Keras3DPModel, type(model))
  return model
