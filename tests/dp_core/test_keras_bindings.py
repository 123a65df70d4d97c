"""One DP core, two bindings: the same tests run on a tf.keras (Keras 2) and a Keras 3 model."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

# The TF 2.15 stack (make test-legacy): `keras` is Keras 2, left unimported (its classes would
# shadow tf-keras' when a later test loads a saved model).
if int(importlib.metadata.version("keras").split(".")[0]) < 3:
  pytest.skip("Keras 3 is not installed", allow_module_level=True)

import keras

from dprec.clipping import layer_norms
from dprec.errors import DprecError
from dprec.layers.embedding import convert_embedding
from dprec.models import keras3 as keras3_binding
from dprec.models.dp_model import DPModel
from dprec.optimizers import (DPFEST, DPSGD, DPAdaFEST, DPOptimizer, LazyAdam, SparseAdagrad,
                              SparseSGD)

BATCH, VOCAB, LEARNING_RATE = 6, 9, 0.1


class _TfKeras:
  """tf.keras: the model is a `DPModel`, its own step."""
  keras = tf.keras
  registry = staticmethod(layer_norms.make_layer_registry)

  @staticmethod
  def model(inputs, outputs):
    """Embedding layers become DP tables, as `make_private` makes them."""
    model = DPModel(inputs, outputs)
    for layer in model.submodules:
      if type(layer) is tf.keras.layers.Embedding:
        convert_embedding(layer)
    return model

  # make_private's row-sparse twins of Keras' SGD, Adagrad and Adam.
  optimizers = {"sgd": SparseSGD, "adagrad": SparseAdagrad, "adam": LazyAdam}


class _Keras3:
  """Keras 3 (TensorFlow backend): a `keras.Model` made a `Keras3DPModel`."""
  keras = keras
  registry = staticmethod(keras3_binding.make_layer_registry)

  @staticmethod
  def model(inputs, outputs):
    return keras3_binding.dp_model(keras.Model(inputs, outputs))

  optimizers = {"sgd": keras.optimizers.SGD, "adagrad": keras.optimizers.Adagrad,
                "adam": keras3_binding.LazyAdam}


def _dp_step(binding, model, config, seed, optimizer="sgd"):
  """`model` compiled with the binding's `optimizer` in a DPOptimizer of `config`."""
  model.compile(DPOptimizer(config, binding.optimizers[optimizer](LEARNING_RATE),
                            insecure_noise_seed=seed), loss="mse")
  return model


BINDINGS = {"tf_keras": _TfKeras, "keras3": _Keras3}


@pytest.fixture(params=list(BINDINGS))
def binding(request):
  return BINDINGS[request.param]


def _model(binding):
  """ids [n, 2] → Embedding → Flatten → Dense(tanh) → Dense, with the same initial weights in
  either binding."""
  layers = binding.keras.layers
  ids = binding.keras.Input((2,), dtype="int32")
  table = layers.Embedding(VOCAB, 3, name="table")
  hidden = layers.Dense(4, activation="tanh")(layers.Flatten()(table(ids)))
  model = binding.model(ids, layers.Dense(1)(hidden))
  rng = np.random.default_rng(0)
  model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
  return model


def _batch():
  rng = np.random.default_rng(1)
  ids = rng.integers(0, VOCAB, (BATCH, 2)).astype(np.int32)
  ids[0, 1] = ids[0, 0]  # a repeated id in one example
  return tf.constant(ids), tf.constant(rng.normal(size=(BATCH, 1)).astype(np.float32))


def _attention_model(binding):
  """MultiHeadAttention (its EinsumDense projections are routed) → LayerNormalization → Dense."""
  binding.keras.utils.set_random_seed(2)
  layers = binding.keras.layers
  inputs = binding.keras.Input((3, 8))
  attended = layers.LayerNormalization()(layers.MultiHeadAttention(2, 4)(inputs, inputs))
  return binding.model(inputs, layers.Dense(1)(layers.Flatten()(attended)))


@pytest.mark.parametrize("build", ["embedding_dense", "attention"])
def test_norms_equal_brute_force_per_example_gradients(binding, build):
  if build == "attention":
    model = _attention_model(binding)
    x = tf.random.stateless_normal([BATCH, 3, 8], seed=[7, 8])
    y = _batch()[1]
  else:
    model = _model(binding)
    x, y = _batch()
  step = _dp_step(binding, model, DPSGD(1.0, 0.0), seed=0)
  expected = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x[i:i + 1]) - y[i:i + 1]))
    grads = tape.gradient(loss, model.trainable_variables)
    expected.append(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
                        for g in grads))
  np.testing.assert_allclose(step.per_example_squared_norms(x, y), expected, rtol=1e-4)


LAYERS = {  # a layer of each registered kind, built from a binding's `keras.layers`
    "dense": (lambda layers: layers.Dense(4, activation="tanh"), (BATCH, 3, 5)),
    "einsum_dense": (lambda layers: layers.EinsumDense("abc,cde->abde", (None, 2, 4),
                                                       bias_axes="de"), (BATCH, 3, 5)),
    "layer_normalization": (lambda layers: layers.LayerNormalization(), (BATCH, 3, 5)),
    "embedding": (lambda layers: layers.Embedding(VOCAB, 3), None),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_norm_functions_equal_brute_force(binding, kind):
  """The registry of each binding maps the layer to a function whose per-example squared norms
  (for L_i = Σ w_i ⊙ layer(x)_i) equal per-example gradients taken one example at a time."""
  make, shape = LAYERS[kind]
  layer = make(binding.keras.layers)
  x = _batch()[0] if shape is None else tf.random.stateless_normal(shape, seed=[1, 2])
  outputs = layer(x)
  for weight in layer.trainable_weights:  # away from initial ones and zeros
    weight.assign(tf.random.stateless_normal(weight.shape, seed=[3, 4]))
  w = tf.random.stateless_normal(tf.shape(outputs), seed=[5, 6])
  with tf.GradientTape() as tape:
    watched, outputs, squared_norm_fn = binding.registry().lookup(layer)(layer, (x,), {}, tape)
    loss = tf.reduce_sum(outputs * w)
  got = squared_norm_fn(tape.gradient(loss, watched))
  expected = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(x[i:i + 1]) * w[i:i + 1])
    expected.append(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
                        for g in tape.gradient(loss, layer.trainable_weights)))
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_removing_one_example_moves_the_clipped_sum_by_at_most_the_clip(binding):
  model = _model(binding)
  clip = 0.5
  step = _dp_step(binding, model, DPSGD(clip, 0.0), seed=0)
  x, y = _batch()
  whole = [tf.convert_to_tensor(g) * BATCH for g, _ in step.dp_gradients(x, y)]
  part = [tf.convert_to_tensor(g) * (BATCH - 1) for g, _ in step.dp_gradients(x[1:], y[1:])]
  moved = np.sqrt(sum(float(tf.reduce_sum(tf.square(a - b))) for a, b in zip(whole, part)))
  assert 0 < moved <= clip * (1 + 1e-5)


ALGORITHMS = {
    "dp_sgd": DPSGD(1.0, 0.7),
    "dp_fest": DPFEST(1.0, 0.7, selected_rows={"table": [0, 2, 3, 5]}),
    "dp_adafest": DPAdaFEST(1.0, 0.7, contribution_clip=1.0, contribution_noise_multiplier=1.0,
                            threshold=0.5),
}


def _one_step(binding, config, optimizer="sgd", steps=1):
  """The weights after `steps` DP steps, on the batch and then on its last half."""
  model = _model(binding)
  step = _dp_step(binding, model, config, seed=11, optimizer=optimizer)
  x, y = _batch()
  for s in range(steps):
    step.apply_step(x[s * BATCH // 2:], y[s * BATCH // 2:])
  return model.get_weights()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_one_dp_step_equals_across_bindings(algorithm, optimizer):
  """The same model, initial weights and insecure key: the same noisy update in both (the
  table's kept rows, false positives and noise included), by Keras 3's own SGD, Adagrad and
  Adam and make_private's row-sparse twins of tf.keras'."""
  ours, theirs = (_one_step(binding, ALGORITHMS[algorithm], optimizer)
                  for binding in BINDINGS.values())
  _assert_equal_moved(ours, theirs)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_two_dp_adafest_steps_equal_across_bindings(optimizer):
  """Rows kept at the first step and not at the second keep their moments: Keras 3's Adam
  would still move them (0.067 apart after two steps), its `LazyAdam` does not."""
  ours, theirs = (_one_step(binding, ALGORITHMS["dp_adafest"], optimizer, steps=2)
                  for binding in BINDINGS.values())
  _assert_equal_moved(ours, theirs)


def _assert_equal_moved(ours, theirs):
  initial = _model(_TfKeras).get_weights()
  for mine, other, start in zip(ours, theirs, initial):
    np.testing.assert_allclose(mine, other, rtol=1e-6, atol=1e-6)
    assert not np.allclose(mine, start)  # the steps moved every variable


def test_the_keras3_binding_refuses_what_it_does_not_drive():
  with pytest.raises(DprecError, match="needs a Keras 3 model"):
    keras3_binding.dp_model(_model(_TfKeras))
  inputs = keras.Input((3,))
  lora = _Keras3.model(inputs, keras.layers.Dense(1, lora_rank=1, name="low")(inputs))
  with pytest.raises(DprecError, match=r"layer 'low' \(Dense\) uses LoRA"):
    _dp_step(_Keras3, lora, DPSGD(1.0, 0.0), seed=0)
  model = _Keras3.model(inputs, keras.layers.Dense(1)(keras.layers.GroupNormalization(
      groups=1, name="norm")(keras.layers.Dense(2)(inputs))))
  step = _dp_step(_Keras3, model, DPSGD(1.0, 0.0), seed=0)
  # Not registered: refused, naming the layer and the binding's registered layers.
  with pytest.raises(DprecError, match=r"cannot clip layer\(s\) norm \(GroupNormalization\) "
                                       r".*\(Dense, EinsumDense, Embedding, LayerNormalization\)"):
    step.per_example_squared_norms(tf.ones([2, 3]), tf.ones([2, 1]))


def test_another_keras_3_backend_is_refused_in_one_line(monkeypatch):
  monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
  with pytest.raises(DprecError) as error:
    _model(_Keras3)
  assert "TensorFlow backend, not jax" in str(error.value) and "\n" not in str(error.value)
  assert "KERAS_BACKEND=tensorflow" in str(error.value)


def test_importing_dprec_after_keras_3_keeps_both():
  """`import keras` (Keras 3) before `import dprec`: tf.keras still becomes Keras 2 for dprec's
  tf.keras path, and `keras` stays Keras 3 for the binding."""
  code = ("import keras, dprec, tensorflow as tf; "
          "print(keras.__version__.split('.')[0], tf.keras.__name__.split('.')[0])")
  root = Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=str(root), TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_USE_LEGACY_KERAS", None)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env)
  assert result.stdout.split() == ["3", "tf_keras"]
