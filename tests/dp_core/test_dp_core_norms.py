"""Per-example squared norms of the DP step equal brute-force per-example gradients."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.models.dp_model import DPModel, ExtraNorms
from dprec.optimizers import DPFEST, DPSGD, DPOptimizer, SparseSGD

FEST_ROWS = {"a0": [0, 2, 3], "a1": [4], "m": [1, 2, 5]}


@pytest.mark.parametrize("selected", [None, FEST_ROWS], ids=["all_rows", "masked_rows"])
def test_norms_match_brute_force(lib, selected):
  model = lib.build_model()
  config = DPSGD(1.0, 0.0) if selected is None else DPFEST(1.0, 0.0, selected)
  model.compile(DPOptimizer(config, SparseSGD(0.1)), loss=lib.loss)
  x, y = lib.make_batch()
  expected = lib.squared_norms(lib.brute_force_gradients(model, x, y, kept=selected))
  got = model.per_example_squared_norms(x, y).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  if selected is not None:  # the mask matters: unmasked norms differ
    full = lib.squared_norms(lib.brute_force_gradients(model, x, y))
    assert np.all(full >= got - 1e-6) and np.any(full > got + 1e-3)


def test_norms_inside_tf_function_and_ragged(lib):
  """Ragged multi-valued input, mean combiner, traced once for two batch sizes."""
  tf.keras.utils.set_random_seed(1)
  ids = tf.keras.Input((None,), dtype=tf.int64, ragged=True)
  from dprec.layers import embedding
  h = embedding.DPEmbedding(9, 4, combiner="mean", name="bag")(ids)
  model = DPModel(ids, tf.keras.layers.Dense(1)(h))
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), SparseSGD(0.1)), loss=lib.loss)
  norms = tf.function(model.per_example_squared_norms, reduce_retracing=True)
  for n in (5, 8):
    rows = [[1, 1, 3], [2], [4, 4, 4, 0], [8, 7], [5, 5]] * 2
    x = tf.ragged.constant(rows[:n], dtype=tf.int64)
    y = tf.constant(np.arange(n) % 2, tf.float32)[:, None]
    expected = []
    for i in range(n):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model.per_example_loss(y[i:i + 1], model(x[i:i + 1])))
      grads = tape.gradient(loss, model.trainable_variables)
      expected.append(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
                          for g in grads))
    np.testing.assert_allclose(norms(x, y).numpy(), expected, rtol=1e-5, atol=1e-7)


class _Scale(tf.keras.layers.Layer):
  """y = s ⊙ h with a trainable vector s: not in any registry; covered by the model hook."""

  def build(self, input_shape):
    self.scale = self.add_weight(name="scale", shape=input_shape[-1:], initializer="ones")
    self.last = None

  def call(self, inputs):
    outputs = inputs * self.scale
    object.__setattr__(self, "last", (inputs, outputs))
    return outputs


class _HookModel(DPModel):
  """A subclassed model whose `_Scale` variable is handled by `extra_squared_norms`."""

  def __init__(self):
    super().__init__()
    from dprec.layers import embedding
    self.table = embedding.DPEmbedding(6, 3, name="t")
    self.dense = tf.keras.layers.Dense(4)
    self.scale = _Scale()
    self.head = tf.keras.layers.Dense(1)

  def call(self, inputs):
    return self.head(self.scale(self.dense(self.table(inputs))))

  def extra_squared_norms(self):
    inputs, outputs = self.scale.last
    return [ExtraNorms([self.scale.scale], outputs,
                       lambda grad: tf.reduce_sum(tf.square(grad * inputs),
                                                  axis=1))]


def test_extra_norm_hook_in_subclassed_model(lib):
  tf.keras.utils.set_random_seed(2)
  model = _HookModel()
  x = tf.constant([[1, 1], [2, 5], [0, 3], [4, 4]], tf.int64)
  y = tf.constant([[1.0], [0.0], [1.0], [0.0]])
  model(x)
  model.scale.scale.assign([0.05, -0.1, 0.08, 0.2])
  model.dense.kernel.assign(model.dense.kernel * 20.0)  # make s's own gradient g ⊙ h count
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), SparseSGD(0.1)), loss=lib.loss)
  per_variable = lib.brute_force_gradients(model, [x], y)
  expected = lib.squared_norms(per_variable)
  np.testing.assert_allclose(model.per_example_squared_norms(x, y).numpy(), expected,
                             rtol=1e-5, atol=1e-7)
  scale_part = lib.squared_norms({k: v for k, v in per_variable.items() if "scale" in k})
  assert np.all(scale_part > 0.005 * expected)  # the hook's share is not negligible


def test_uncovered_variables_are_refused(lib):
  tf.keras.utils.set_random_seed(3)
  inputs = tf.keras.Input((4,))
  model = DPModel(inputs, tf.keras.layers.Dense(1)(_Scale()(inputs)))
  model.compile(DPOptimizer(DPSGD(1.0, 1.0), SparseSGD(0.1)), loss=lib.loss)
  with pytest.raises(DprecError, match="no per-example gradient norm") as error:
    model.per_example_squared_norms(tf.ones([2, 4]), tf.ones([2, 1]))
  assert "DPModel.layer_registry" in str(error.value)


def test_the_docs_name_the_registry_the_step_uses():
  """DPModel clips through its own `layer_registry` (dprec.clipping.layer_norms), not
  tensorflow_privacy's: the module docstring says so, and the default registry's docstring
  lists the registered layers (generated from the registry)."""
  from dprec.clipping import layer_norms
  from dprec.models import dp_model
  assert "tensorflow_privacy registry" not in dp_model.__doc__
  assert "DPModel.layer_registry" in dp_model.__doc__
  assert "make_layer_registry" in dp_model.__doc__
  names = layer_norms.make_layer_registry().layer_names()
  assert names == ["Dense", "EinsumDense", "Embedding", "LayerNormalization"]
  assert ", ".join(names) in layer_norms.make_layer_registry.__doc__


class _BookKeptHookModel(_HookModel):
  """`_HookModel` whose hook also book-keeps the clipped sum: the loss reaches `scale` only
  through its output t, so Σ_i ⟨stop_gradient(c_i·∂L/∂t_i), t_i⟩ has the gradient of Σ c_i·L_i.
  `copies` ExtraNorms carry the function; `calls` counts its uses."""

  def __init__(self, copies=1):
    super().__init__()
    self.copies, self.calls = copies, 0

  def clipped_loss(self, grad, clip_factors):
    self.calls += 1
    outputs = self.scale.last[1]
    return tf.reduce_sum(tf.stop_gradient(clip_factors[:, None] * grad) * outputs)

  def extra_squared_norms(self):
    (norms,) = super().extra_squared_norms()
    return [norms._replace(clipped_loss_fn=self.clipped_loss)] * self.copies


def _book_kept_model(lib, clip, copies=1):
  tf.keras.utils.set_random_seed(2)
  model = _BookKeptHookModel(copies)
  x = tf.constant([[1, 1], [2, 5], [0, 3], [4, 4]], tf.int64)
  y = tf.constant([[1.0], [0.0], [1.0], [0.0]])
  model(x)
  model.scale.scale.assign([0.05, -0.1, 0.08, 0.2])
  model.compile(DPOptimizer(DPSGD(clip, 0.0), SparseSGD(0.1), expected_batch_size=1.0),
                loss=lib.loss)
  return model, x, y


def test_extra_clipped_loss_hook_gives_the_clipped_sum(lib):
  """The step's second backward pass starts at the hook's scalar (used once per step) and the
  clipped sum still equals Σ_i c_i·g_i of brute-force per-example gradients."""
  clip = 0.05
  model, x, y = _book_kept_model(lib, clip)
  per_example = lib.brute_force_gradients(model, [x], y)
  norms = np.sqrt(lib.squared_norms(per_example))
  assert np.all(norms > clip)
  factors = clip / norms
  got = {v.name: tf.convert_to_tensor(g).numpy() for g, v in model.dp_gradients(x, y)}
  assert model.calls == 1
  for name, grads in per_example.items():
    np.testing.assert_allclose(got[name], np.tensordot(factors, grads, axes=1),
                               rtol=1e-4, atol=1e-7, err_msg=name)
  assert np.abs(got[model.scale.scale.name]).max() > 1e-4  # the hook's variable is updated


def test_two_clipped_loss_hooks_are_refused(lib):
  model, x, y = _book_kept_model(lib, 0.05, copies=2)
  with pytest.raises(DprecError, match="at most one ExtraNorms"):
    model.dp_gradients(x, y)
