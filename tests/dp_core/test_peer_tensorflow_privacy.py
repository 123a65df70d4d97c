"""Peer tests: dprec's norm functions and DP step against tensorflow_privacy's (TF 2.15 leg).

Skipped where tensorflow_privacy does not import (TF ≥ 2.16), failed instead under
DPREC_REQUIRE_PEERS=1 (see tests/conftest.py).
"""
import numpy as np
import pytest
import tensorflow as tf

from dprec.clipping import layer_norms
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPSGD, DPOptimizer

BATCH = 4


def _tfp_functions():
  from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
  from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import einsum_dense
  from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import \
      layer_normalization
  registry = layer_registry.make_default_layer_registry()
  return {tf.keras.layers.Dense: registry.lookup(tf.keras.layers.Dense(1)),
          tf.keras.layers.Embedding: registry.lookup(tf.keras.layers.Embedding(2, 1)),
          tf.keras.layers.LayerNormalization: layer_normalization.layer_normalization_computation,
          tf.keras.layers.EinsumDense: einsum_dense.einsum_layer_computation}


def _norms(function, layer, inputs, weights):
  with tf.GradientTape() as tape:
    watched, outputs, squared_norm_fn = function(layer, (inputs,), {}, tape, None)
    loss = tf.reduce_sum(outputs * weights)
  return squared_norm_fn(tape.gradient(loss, watched)).numpy()


@pytest.mark.parametrize("make_layer,inputs", [
    (lambda: tf.keras.layers.Dense(4, activation="tanh"),
     tf.random.stateless_normal([BATCH, 3, 5], seed=[1, 2])),
    (lambda: tf.keras.layers.Embedding(9, 3), tf.constant([[1, 1, 3], [2, 0, 2], [4, 4, 4],
                                                           [5, 6, 7]])),
    (lambda: tf.keras.layers.LayerNormalization(),
     tf.random.stateless_normal([BATCH, 3, 5], seed=[1, 2])),
    (lambda: tf.keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4), bias_axes="de"),
     tf.random.stateless_normal([BATCH, 3, 5], seed=[1, 2])),
], ids=["dense", "embedding", "layer_normalization", "einsum_dense"])
def test_norm_functions_equal_tensorflow_privacy(tensorflow_privacy, make_layer, inputs):
  del tensorflow_privacy
  layer = make_layer()
  reference = layer(inputs)
  weights = tf.random.stateless_normal(tf.shape(reference), seed=[3, 4])
  ours = _norms(layer_norms.make_layer_registry().lookup(layer), layer, inputs, weights)
  theirs = _norms(_tfp_functions()[type(layer)], layer, inputs, weights)
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def _model(model_class, **kwargs):
  tf.keras.utils.set_random_seed(5)
  ids = tf.keras.Input((2,), dtype=tf.int32)
  hidden = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(11, 3)(ids))
  hidden = tf.keras.layers.LayerNormalization()(tf.keras.layers.Dense(6, "relu")(hidden))
  return model_class(inputs=ids, outputs=tf.keras.layers.Dense(1)(hidden), **kwargs)


def test_dp_step_equals_tensorflow_privacy_dp_model(tensorflow_privacy):
  """One clipped step without noise: the same update as tensorflow_privacy's DPModel."""
  del tensorflow_privacy
  from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
  from tensorflow_privacy.privacy.keras_models import dp_keras_model
  x = tf.constant(np.random.default_rng(0).integers(0, 11, (8, 2)), tf.int32)
  y = tf.constant(np.random.default_rng(1).normal(size=(8, 1)), tf.float32)
  clip = 0.05  # below every per-example norm: every example is clipped
  theirs = _model(dp_keras_model.make_dp_model_class(tf.keras.Model), l2_norm_clip=clip,
                  noise_multiplier=0.0, layer_registry=layer_registry.make_default_layer_registry())
  ours = _model(DPModel)
  ours.set_weights(theirs.get_weights())
  theirs.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss="mse")
  ours.compile(optimizer=DPOptimizer(DPSGD(clip, 0.0), tf.keras.optimizers.SGD(1.0),
                                     expected_batch_size=8), loss="mse")
  for model in (theirs, ours):
    model.train_on_batch(x, y)
  for a, b in zip(ours.get_weights(), theirs.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
