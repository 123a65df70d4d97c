"""The Keras 3 binding (TensorFlow backend): what of the DP step touches Keras 3 — finding the
layers, reading the weights, the layer classes of the norm registry, the loss per example —
around the step's mathematics, which is written once (`dprec.models.dp_step.DPStep`, the norm
functions of `dprec.clipping.layer_norms`, selection and noise in `dprec.sparse`).

    step = Keras3DPStep(model, DPOptimizer(DPSGD(1.0, σ), keras.optimizers.SGD(0.1)), "mse")
    step.apply_step(x, y)          # one DP step on a batch: clipped, noised, applied

A start: `keras.layers.Dense`, `EinsumDense` (so `MultiHeadAttention`) and `LayerNormalization`
through the norm registry, every `keras.layers.Embedding` as a DP table (`DPTable`: the rows of
DP-SGD, DP-FEST or DP-AdaFEST, noise on kept rows only); Keras 3's SGD and Adagrad update only
an IndexedSlices gradient's rows already, its Adam does not (`LazyAdam` here does).
`dprec.make_private` still refuses Keras 3 models until the binding covers what it promises
(`compile`/`fit` through a private model class, Poisson batches, the ledger, the output bias,
saving).
"""
import sys

import keras
import tensorflow as tf

from dprec.clipping import layer_norms
from dprec.errors import DprecError
from dprec.layers import embedding as embedding_lib
from dprec.models import dp_step
from dprec.optimizers import sparse as sparse_optimizers

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
  found = list(model._flatten_layers(include_self=False, recursive=True))  # pylint: disable=protected-access
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


class DPTable:
  """A Keras 3 `keras.layers.Embedding` as a DP table of the step: the recording protocol of
  `dprec.layers.embedding.DPEmbedding` (whose lookup it runs, ids of rank 1 or 2, pads -1
  giving zero rows, as a converted tf.keras table), with the layer's `call` routed through it
  while the step records."""

  padded = False
  combiner = None
  pad_id = -1

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

  def start_recording(self):
    self._recording = []
    lookup = embedding_lib.DPEmbedding.call
    object.__setattr__(self.layer, "call", lambda inputs, *_, **__: lookup(self, inputs))

  def stop_recording(self):
    object.__delattr__(self.layer, "call")
    lookups, self._recording = self._recording, None
    return lookups


class Keras3DPStep(dp_step.DPStep):
  """The DP step of a Keras 3 `model` with the algorithm, noise key and inner optimizer (a Keras
  3 optimizer) of `dp_optimizer`, and `loss` (per example)."""

  def __init__(self, model, dp_optimizer, loss):
    if not is_keras3_model(model):
      raise DprecError(f"Keras3DPStep needs a Keras 3 model, got {type(model).__name__}")
    check_backend()
    self.model, self.dp_optimizer, self.loss = model, dp_optimizer, loss
    self.optimizer = dp_optimizer.inner
    self._dp_generator = dp_optimizer.generator
    self.layer_registry = make_layer_registry()
    # Every trainable Embedding is a DP table (as make_private converts tf.keras ones), in the
    # step's order: by increasing width.
    embedding = keras3().layers.Embedding
    self.dp_step_tables = sorted(
        [DPTable(layer) for layer in layers(model)
         if type(layer) is embedding and layer.trainable], key=lambda t: t.output_dim)  # pylint: disable=unidiomatic-typecheck

  @property
  def trainable_variables(self):
    return self.model.trainable_variables

  @property
  def losses(self):
    return self.model.losses

  def step_layers(self):
    """The model's layers but its DP tables (their lookups are recorded, not routed)."""
    tabled = {id(table.layer) for table in self.dp_step_tables}
    return [layer for layer in layers(self.model) if id(layer) not in tabled]

  def extra_squared_norms(self):
    return []

  def forward_losses(self, x, y, sample_weight=None):
    if sample_weight is not None:
      raise DprecError("the Keras 3 binding takes no sample weights yet")
    with dp_step.refusing_variable_updates():
      y_pred = self.model(x, training=True)
    return y_pred, per_example_losses(self.loss, y, y_pred)

  def apply_step(self, x, y):
    """One DP step on the batch (x, y), applied by the inner optimizer; returns predictions."""
    grads_and_vars, y_pred = self._dp_gradients(self.dp_optimizer.config, x, y, None)
    self.optimizer.apply_gradients(grads_and_vars)
    return y_pred
