"""dprec's per-layer squared-norm functions equal brute-force per-example gradients."""
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from dprec.clipping import layer_norms
from dprec.errors import DprecError
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPSGD, DPOptimizer, SparseSGD

BATCH = 4


def _norms_from_function(layer, inputs, weights):
  """The registry function's norms for the per-example loss L_i = Σ weights_i ⊙ layer(x)_i."""
  function = layer_norms.make_layer_registry().lookup(layer)
  with tf.GradientTape() as tape:
    watched, outputs, squared_norm_fn = function(layer, (inputs,), {}, tape, None)
    loss = tf.reduce_sum(_flat(outputs) * weights)
  return squared_norm_fn(tape.gradient(loss, watched)).numpy(), _flat(outputs)


def _flat(outputs):
  return outputs.to_tensor() if isinstance(outputs, tf.RaggedTensor) else outputs


def _brute_force(layer, inputs, weights):
  norms = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      outputs = _flat(layer(inputs[i:i + 1]))
      # A ragged example is shorter than the padded batch: its padding had weight 0 anyway.
      loss = tf.reduce_sum(outputs * weights[i:i + 1, :outputs.shape[1]])
    grads = tape.gradient(loss, layer.trainable_weights)
    norms.append(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g)))) for g in grads))
  return np.array(norms)


def _check(layer, inputs):
  tf.keras.utils.set_random_seed(0)
  reference = _flat(layer(inputs))
  weights = tf.random.normal(tf.shape(reference))
  got, outputs = _norms_from_function(layer, inputs, weights)
  np.testing.assert_allclose(outputs, reference, rtol=1e-5, atol=1e-5)  # same forward pass
  np.testing.assert_allclose(got, _brute_force(layer, inputs, weights), rtol=1e-4, atol=1e-6)


def _normal(*shape):
  return tf.random.stateless_normal(shape, seed=[1, 2])


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(BATCH, 5), (BATCH, 3, 5), (BATCH, 2, 3, 5)],
                         ids=["vector", "sequence", "grid"])
def test_dense(shape, use_bias):
  _check(tf.keras.layers.Dense(4, activation="tanh", use_bias=use_bias), _normal(*shape))


@pytest.mark.parametrize("equation,bias_axes,shape,output", [
    ("ab,bc->ac", "c", (BATCH, 5), (3,)),  # a Dense layer
    ("abc,cd->abd", "d", (BATCH, 3, 5), (None, 4)),  # per position
    ("abc,cde->abde", "de", (BATCH, 3, 5), (None, 2, 4)),  # attention's query projection
    ("abcd,cde->abe", "e", (BATCH, 3, 2, 4), (None, 5)),  # attention's output projection
    ("abc,bc->ab", "b", (BATCH, 3, 5), (3,)),  # a kernel axis shared with input and output
], ids=["dense", "positions", "query", "output", "shared_axis"])
def test_einsum_dense(equation, bias_axes, shape, output):
  layer = tf.keras.layers.EinsumDense(equation, output, bias_axes=bias_axes, activation="relu")
  _check(layer, _normal(*shape))


def test_einsum_dense_without_bias_and_with_partial_bias():
  _check(tf.keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4)), _normal(BATCH, 3, 5))
  _check(tf.keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4), bias_axes="d"),
         _normal(BATCH, 3, 5))


def test_einsum_dense_refuses_an_ellipsis():
  layer = tf.keras.layers.EinsumDense("...b,bc->...c", 3)
  layer.build([None, 5])
  with pytest.raises(DprecError, match="ellipses"):
    _norms_from_function(layer, _normal(BATCH, 5), tf.ones([BATCH, 3]))


def test_embedding_with_repeated_ids():
  ids = tf.constant([[1, 1, 3], [2, 0, 2], [4, 4, 4], [5, 6, 7]])
  _check(tf.keras.layers.Embedding(9, 3), ids)


def test_embedding_with_ragged_repeated_ids():
  ids = tf.ragged.constant([[1, 1, 3], [2], [4, 4, 4, 0], [8, 7]], dtype=tf.int64)
  _check(tf.keras.layers.Embedding(9, 3), ids)


@pytest.mark.parametrize("axis", [-1, [1, 2]])
@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False)])
def test_layer_normalization(axis, center, scale):
  layer = tf.keras.layers.LayerNormalization(axis=axis, center=center, scale=scale)
  layer.build([None, 3, 5])
  for weight in layer.trainable_weights:  # away from the initial 1s and 0s
    weight.assign(tf.random.stateless_normal(weight.shape, seed=[3, 4]))
  _check(layer, _normal(BATCH, 3, 5))


def test_multi_head_attention_norms_inside_the_dp_step():
  """MultiHeadAttention needs no function: its four EinsumDense projections are routed."""
  tf.keras.utils.set_random_seed(2)
  inputs = tf.keras.Input((3, 8))
  attended = tf.keras.layers.MultiHeadAttention(2, 4)(inputs, inputs)
  model = DPModel(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(attended)))
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), SparseSGD(0.1)), loss="mse")
  x, y = _normal(BATCH, 3, 8), tf.random.stateless_normal([BATCH, 1], seed=[5, 6])
  expected = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model.per_example_loss(y[i:i + 1], model(x[i:i + 1])))
    grads = tape.gradient(loss, model.trainable_variables)
    expected.append(sum(float(tf.reduce_sum(tf.square(g))) for g in grads))
  np.testing.assert_allclose(model.per_example_squared_norms(x, y), expected, rtol=1e-4)


class _Twice(tf.keras.layers.Dense):
  """A Dense layer under another class: in no registry until registered."""


def _twice_model(registry=None):
  tf.keras.utils.set_random_seed(4)
  inputs = tf.keras.Input((5,))
  model = DPModel(inputs, tf.keras.layers.Dense(1, name="out")(_Twice(3, name="twice")(inputs)))
  model.layer_registry = registry
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), SparseSGD(0.1)), loss="mse")
  return model


def test_one_registration_holds_the_norm_and_the_clipped_gradient():
  """A class registered with both functions gets its norms from the first and its clipped sum
  from the second (book-kept: a wrong one shows in the update); the refusal's list of layers
  comes from the registry it would have needed."""
  x, y = _normal(BATCH, 5), tf.random.stateless_normal([BATCH, 1], seed=[5, 6])
  with pytest.raises(DprecError, match=r"twice \(_Twice\).*\(Dense, EinsumDense, Embedding, "
                                       r"LayerNormalization\)"):
    _twice_model().per_example_squared_norms(x, y)
  calls = []

  def clipped(layer, args, output_grads, clip_factors):
    calls.append(layer.name)
    return [2 * g for g in layer_norms.dense_clipped_gradients(layer, args, output_grads,
                                                               clip_factors)]

  registry = layer_norms.make_layer_registry()
  registry.insert(_Twice, layer_norms.dense_computation, clipped)
  assert registry.layer_names() == ["Dense", "EinsumDense", "Embedding", "LayerNormalization",
                                    "_Twice"]
  assert layer_norms.make_layer_registry().layer_names()[-1] == "LayerNormalization"  # a copy
  model = _twice_model(registry)
  reference = _twice_model()
  reference.layer_registry = layer_norms.make_layer_registry()
  reference.layer_registry.insert(_Twice, layer_norms.dense_computation,
                                  layer_norms.dense_clipped_gradients)
  np.testing.assert_allclose(model.per_example_squared_norms(x, y),
                             reference.per_example_squared_norms(x, y), rtol=1e-6)
  got = dict((v.name, g) for g, v in model.dp_gradients(x, y))
  want = dict((v.name, g) for g, v in reference.dp_gradients(x, y))
  assert calls == ["twice"]
  np.testing.assert_allclose(got["twice/kernel:0"], 2 * want["twice/kernel:0"], rtol=1e-6)
  np.testing.assert_allclose(got["out/kernel:0"], want["out/kernel:0"], rtol=1e-6)


def test_the_decorator_registers_in_the_default_registry():
  """`registers` is what this module's own entries use: Dense's holds both functions."""
  dense = tf.keras.layers.Dense(2)
  registry = layer_norms.make_layer_registry()
  assert registry.lookup(dense) is layer_norms.dense_computation
  assert registry.clipped_gradients(dense) is layer_norms.dense_clipped_gradients
  assert registry.clipped_gradients(tf.keras.layers.LayerNormalization()) is None


def test_the_readme_names_every_registered_layer():
  readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
  listed = readme[readme.index("layers dprec's layer registry knows:"):][:200]
  assert all(name in listed for name in layer_norms.make_layer_registry().layer_names())
