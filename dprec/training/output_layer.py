"""A model's output layer under DP: the loss-aware levers that make a private model useful, on
any Keras model whose output comes from a Dense layer.

- `initial_bias`: the output bias the constant predictor of the (DP) labels has (the label mean
  for MSE, its logit for binary cross-entropy, log class frequencies for softmax cross-entropy).
  A clipped gradient moves the bias by at most lr·C2 per step, so a loss that starts far from
  its target (ratings around 3.5 predicted as 0) spends the run getting there
  (docs/experiments/make_private.md).
- `recalibrate`: after training, the affine map of the output (Platt scaling of the logit for
  binary cross-entropy, least squares for MSE) fitted under DP, folded into the output layer.

The statistics are released by `dprec.privacy` at the caller's noise multiplier and secret rng.
"""
import contextlib
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.errors import DprecError

MSE, BCE, SOFTMAX = "mse", "bce", "softmax"
_LOSS_KINDS = {
    "mse": MSE, "mean_squared_error": MSE, "MeanSquaredError": MSE,
    "binary_crossentropy": BCE, "BinaryCrossentropy": BCE,
    "sparse_categorical_crossentropy": SOFTMAX, "SparseCategoricalCrossentropy": SOFTMAX,
}
LOGIT_BOUND = 1e-6  # BCE base rates are clipped to [1e-6, 1 − 1e-6] before the logit


def loss_kind(loss) -> Optional[str]:
  """MSE, BCE or SOFTMAX (sparse categorical cross-entropy) for a Keras loss object, class or
  name; None for any other loss (no initialisation or recalibration is then offered)."""
  if isinstance(loss, str):
    return _LOSS_KINDS.get(loss)
  name = getattr(loss, "__name__", None) or type(loss).__name__
  return _LOSS_KINDS.get(name)


def from_logits(loss) -> bool:
  """Whether a cross-entropy loss object reads logits (a string loss reads probabilities)."""
  return bool(getattr(loss, "get_config", dict)().get("from_logits", False))


@contextlib.contextmanager
def _recording_dense_calls(dense, calls):
  for layer in dense:
    original = type(layer).call.__get__(layer)

    def call(*args, _layer=layer, _original=original, **kwargs):
      calls.append(_layer)
      return _original(*args, **kwargs)

    object.__setattr__(layer, "call", call)
  try:
    yield
  finally:
    for layer in dense:
      object.__delattr__(layer, "call")


def output_dense(model, x, layers=None, dense=None):
  """The Dense layer whose pre-activation is the model's output (or its logits): the last
  Dense layer a forward pass on the (public-shaped) batch `x` calls, checked to have as many
  units as the output has columns and a bias. (A forward pass, not the layer list: subclassed
  models call their layers in any order.) `layers`: the model's layers (default its tf.keras
  submodules), `dense`: the Dense class of its Keras (default tf.keras')."""
  dense = dense or tf.keras.layers.Dense
  layers = model.submodules if layers is None else layers
  calls = []
  with _recording_dense_calls([m for m in layers if type(m) is dense], calls):
    output = model(x, training=False)
  if not calls:
    raise DprecError("the model's output does not come from a Dense layer: no output layer "
                     "to initialise or recalibrate")
  layer = calls[-1]
  columns = 1 if output.shape.rank < 2 else output.shape[-1]
  if layer.units != columns or not layer.use_bias:
    raise DprecError(f"the last Dense layer called, '{layer.name}', has {layer.units} units "
                     f"{'and a bias ' if layer.use_bias else 'and no bias '}but the output has "
                     f"{columns} columns: it is not the output layer")
  return layer


def initial_bias(kind: str, labels, noise_multiplier: float, rng, num_classes: int = 1,
                 label_range: Optional[Tuple[float, float]] = None) -> np.ndarray:
  """The output bias of the constant predictor of `labels`, from one DP release at
  `noise_multiplier` (two for MSE without a `label_range`, each at σ·√2: `dprec.privacy.
  label_stats`): the mean (MSE), logit of the rate (BCE), log class frequencies (softmax)."""
  labels = np.asarray(labels).reshape(-1)
  if kind == BCE:
    rate = privacy.dp_mean(labels, (0.0, 1.0), noise_multiplier, rng)
    rate = float(np.clip(rate, LOGIT_BOUND, 1 - LOGIT_BOUND))
    return np.array([np.log(rate / (1 - rate))])
  if kind == SOFTMAX:
    counts = privacy.dp_class_counts(labels, num_classes, noise_multiplier, rng)
    return np.log(counts / counts.sum())
  if kind == MSE:
    return np.array([privacy.dp_mean(labels, label_range, noise_multiplier, rng)])
  raise DprecError(f"no output initialisation for loss kind {kind!r}")


def set_bias(layer, bias):
  """Sets a Dense layer's bias (broadcast to its units)."""
  layer.bias.assign(np.broadcast_to(np.asarray(bias, np.float32), layer.bias.shape))


def fold_affine(layer, scale, shift):
  """Makes the layer's pre-activation z into a·z + b (kernel·a, bias·a + b)."""
  layer.kernel.assign(layer.kernel * scale)
  layer.bias.assign(layer.bias * scale + shift)


def recalibrate(layer, kind, predictions, labels, noise_multiplier, rng, prior=None,
                label_range=None, logits=False) -> Tuple[float, float]:
  """Fits (a, b) under DP at `noise_multiplier` on training `predictions` and `labels` (Platt
  scaling of the logits for BCE from the prior rate `prior`, least squares in `label_range`
  for MSE) and folds them into `layer` (`output_dense`); returns (a, b)."""
  predictions = np.asarray(predictions, np.float64).reshape(-1)
  if kind == BCE:
    if not logits:
      clipped = np.clip(predictions, LOGIT_BOUND, 1 - LOGIT_BOUND)
      predictions = np.log(clipped / (1 - clipped))
    scale, shift = privacy.dp_platt_scaling(predictions, labels, noise_multiplier, prior, rng)
  elif kind == MSE:
    scale, shift = privacy.dp_affine_recalibration(predictions, labels, label_range,
                                                   noise_multiplier, rng)
  else:
    raise DprecError(f"no recalibration for loss kind {kind!r} (only MSE and binary "
                     "cross-entropy)")
  fold_affine(layer, scale, shift)
  return scale, shift
