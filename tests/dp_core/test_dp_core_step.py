"""The DP training step: clipped sums, sensitivity, sparse noise, equivalence limits."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import (DPAdaFEST, DPAdaFESTPlus, DPFEST, DPSGD, DPOptimizer, LazyAdam,
                              NonPrivate, SparseAdagrad, SparseSGD)

INF = float("inf")


def _all_rows(lib):
  return {name: np.arange(size) for name, size in lib.vocabs.items()}


def _one_step(lib, config, optimizer):
  model = lib.build_model()
  model.compile(DPOptimizer(config, optimizer, insecure_noise_seed=0), loss=lib.loss,
                run_eagerly=True)
  x, y = lib.make_batch(n=10)
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
  return [w.numpy() for w in model.trainable_variables]


@pytest.mark.parametrize("make_optimizer", [lambda: SparseSGD(0.5), lambda: SparseAdagrad(0.3)],
                         ids=["sgd", "adagrad"])
def test_no_noise_no_clipping_equals_non_private(lib, make_optimizer):
  reference = _one_step(lib, NonPrivate(), make_optimizer())
  everything = _all_rows(lib)
  configs = [
      DPSGD(INF, 0.0),
      DPFEST(INF, 0.0, selected_rows=everything),
      DPAdaFEST(INF, 0.0, contribution_clip=INF, contribution_noise_multiplier=0.0,
                threshold=0.5),
      DPAdaFESTPlus(INF, 0.0, contribution_clip=INF, contribution_noise_multiplier=0.0,
                    threshold=0.5, selected_rows=everything),
  ]
  for config in configs:
    for got, want in zip(_one_step(lib, config, make_optimizer()), reference):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=config.name)


def _clipped_sum(model, x, y):
  """Σ_i c_i·g_i (noise-free, normaliser 1) as {variable name: dense array}."""
  grads = model.dp_gradients(x, y)
  return {v.name: tf.convert_to_tensor(g).numpy() for g, v in grads}


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
@pytest.mark.parametrize("selected, offset", [
    (None, None), ({"a0": [0, 1, 2], "m": [0, 3, 4, 5]}, None), (None, 0.01)],
                         ids=["dp_sgd", "dp_fest", "dp_sgd_normalized"])
def test_clipped_sum_and_sensitivity(lib, selected, offset, secure):
  clip = 0.05
  config = (DPSGD(clip, 0.0, normalization_offset=offset) if selected is None
            else DPFEST(clip, 0.0, selected))
  model = lib.build_model()
  model.compile(DPOptimizer(config, SparseSGD(0.1), expected_batch_size=1.0,
                            secure_noise=secure), loss=lib.loss)
  x, y = lib.make_batch(n=8)
  full = _clipped_sum(model, x, y)
  # The clipped sum equals the brute-force sum of clipped (or normalised), masked per-example
  # gradients.
  per_example = lib.brute_force_gradients(model, x, y, kept=selected)
  norms = np.sqrt(lib.squared_norms(per_example))
  factors = np.minimum(1.0, clip / norms) if offset is None else clip / (norms + offset)
  assert np.all(norms > clip)  # clipping is active for every example
  for name, grads in per_example.items():
    np.testing.assert_allclose(full[name], np.tensordot(factors, grads, axes=1),
                               rtol=1e-4, atol=1e-7)
  # Removing one example moves the clipped sum by at most C2 (here: by exactly C2).
  for removed in range(8):
    keep = [i for i in range(8) if i != removed]
    neighbour = _clipped_sum(model, [tf.gather(t, keep) for t in x], tf.gather(y, keep))
    shift = np.sqrt(sum(np.sum((full[k] - neighbour[k]) ** 2) for k in full))
    assert shift <= clip * (1 + 1e-4)
    assert shift == pytest.approx(clip * norms[removed] / (norms[removed] + (offset or 0.0)),
                                  rel=1e-3)


def _wide_model(vocab=100000, dim=4):
  tf.keras.utils.set_random_seed(7)
  ids = tf.keras.Input((2,), dtype=tf.int64)
  h = DPEmbedding(vocab, dim, combiner="sum", name="wide")(ids)
  h = tf.keras.layers.Dense(64, activation="relu")(tf.keras.layers.Dense(64)(h))
  return DPModel(ids, tf.keras.layers.Dense(1)(h))


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_sparse_noise_on_kept_rows_only(lib, secure):
  """σ2·C2 noise on every kept row (false positives included) and on dense variables;
  the update leaves every other row bit-for-bit unchanged."""
  sigma2, clip2, batch = 3.0, 0.5, 4.0
  config = DPAdaFEST(clip2, sigma2, contribution_clip=1.0, contribution_noise_multiplier=1.0,
                     threshold=1.6449)  # Ψ(1.6449) = 5%: ≈ 5,000 false positives of 100,000
  model = _wide_model()
  model.compile(DPOptimizer(config, SparseSGD(1.0), expected_batch_size=batch,
                            insecure_noise_seed=1, secure_noise=secure),
                loss=lib.loss)
  x = tf.constant([[1, 2], [3, 3], [1, 4], [5, 6]], tf.int64)
  y = tf.constant([[1.0], [0.0], [1.0], [0.0]])
  grads = {v.name: g for g, v in model.dp_gradients(x, y)}
  table = model.dp_tables[0]
  emb = grads[table.embeddings.name]
  assert isinstance(emb, tf.IndexedSlices)
  rows = emb.indices.numpy()
  assert np.all(np.diff(rows) > 0) and 3000 < rows.size < 7000
  # Per coordinate: (clipped sum + N(0, (σ2·C2)²)) / B̄; the clipped sum is at most C2 in total.
  values = emb.values.numpy() * batch
  assert np.std(values) == pytest.approx(sigma2 * clip2, rel=0.03)
  kernel = grads[model.layers[3].kernel.name].numpy() * batch  # the 64×64 Dense
  assert np.std(kernel) == pytest.approx(sigma2 * clip2, rel=0.05)
  before = table.embeddings.numpy()
  model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  after = table.embeddings.numpy()
  changed = np.flatnonzero(np.any(before != after, axis=1))
  untouched = np.setdiff1d(np.arange(before.shape[0]), changed)
  assert 3000 < changed.size < 7000
  np.testing.assert_array_equal(before[untouched], after[untouched])


def _ancestors(op):
  """Every op `op` waits for: data and control inputs, transitively."""
  seen, stack = {}, [op]
  while stack:
    current = stack.pop()
    for parent in [t.op for t in current.inputs] + list(current.control_inputs):
      if parent.name not in seen:
        seen[parent.name] = parent
        stack.append(parent)
  return seen.values()


def test_noise_draws_wait_for_no_gradient(lib):
  """Every draw of a DP-AdaFEST step (selection, dense noise, one draw for all tables' kept
  rows) depends on the input ids and the generator only, so the executor can make it while the
  backward pass runs; a draw sized by a clipped sum would wait for the gradients."""
  model = lib.build_model()
  model.compile(DPOptimizer(DPAdaFEST(1.0, 1.0, contribution_clip=1.0,
                                      contribution_noise_multiplier=1.0, threshold=0.5),
                            SparseSGD(0.1), insecure_noise_seed=4), loss=lib.loss)
  x, y = lib.make_batch(n=6)
  graph = tf.function(model.train_step).get_concrete_function((x, y)).graph
  draws = [op for op in graph.get_operations() if op.type == "RngReadAndSkip"]
  dense = [v for v in model.trainable_variables
           if all(v is not t.embeddings for t in model.dp_tables)]
  assert len(draws) == 1 + len(dense) + 1  # contribution noise, each dense variable, kept rows
  for draw in draws:
    waits_for = [op.name for op in _ancestors(draw) if "gradient_tape" in op.name]
    assert not waits_for, (draw.name, waits_for[:3])


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_dp_sgd_noise_is_dense(lib, secure):
  model = _wide_model(vocab=2000, dim=8)
  model.compile(DPOptimizer(DPSGD(0.5, 2.0), SparseSGD(1.0), expected_batch_size=1.0,
                            insecure_noise_seed=2, secure_noise=secure),
                loss=lib.loss)
  x = tf.constant([[1, 2], [3, 3]], tf.int64)
  grads = {v.name: g for g, v in model.dp_gradients(x, tf.constant([[1.0], [0.0]]))}
  emb = tf.convert_to_tensor(grads[model.dp_tables[0].embeddings.name]).numpy()
  assert np.count_nonzero(emb) == emb.size
  assert np.std(emb) == pytest.approx(1.0, rel=0.03)


def test_gradient_size_metric_and_no_retracing(lib):
  """gradient_size = Σ |S_f|·d_f under DP-FEST; varying batch sizes do not retrace."""
  selected = {"a0": [0, 1], "a1": [2, 3, 4], "m": [5]}
  model = lib.build_model()
  model.compile(DPOptimizer(DPFEST(1.0, 1.0, selected), SparseSGD(0.1), insecure_noise_seed=3),
                loss=lib.loss)
  x, y = lib.make_batch(n=40)
  sizes = [7, 11, 9, 13]
  starts = np.cumsum([0] + sizes)
  dataset = tf.data.Dataset.from_generator(
      lambda: ((tuple(t[a:b] for t in x), y[a:b]) for a, b in zip(starts[:-1], starts[1:])),
      output_signature=((tf.TensorSpec([None, 2], tf.int64), tf.TensorSpec([None, 4], tf.int64),
                         tf.TensorSpec([None, 2], tf.int64)), tf.TensorSpec([None, 1])))
  history = model.fit(dataset, epochs=2, verbose=0)
  expected = 2 * lib.dims["a0"] + 3 * lib.dims["a1"] + 1 * lib.dims["m"]
  assert history.history["gradient_size"] == [expected, expected]
  dense = sum(lib.vocabs[k] * lib.dims[k] for k in lib.vocabs)
  assert history.history["gradient_size_reduction"][-1] == pytest.approx(dense / expected)
  assert model.train_function.experimental_get_tracing_count() <= 2


@pytest.mark.parametrize("optimizer", [SparseSGD(0.1), SparseAdagrad(0.1), LazyAdam(0.1)],
                         ids=["sgd", "adagrad", "lazy_adam"])
def test_sparse_optimizers_touch_only_gradient_rows(optimizer):
  table = tf.Variable(tf.random.stateless_normal([50, 3], seed=[1, 2]))
  before = table.numpy()
  indices = tf.constant([3, 17, 40], tf.int64)
  values = tf.constant([[1.0, -2.0, 0.5]] * 3)
  for _ in range(2):
    optimizer.apply_gradients([(tf.IndexedSlices(values, indices, [50, 3]), table)])
  after = table.numpy()
  others = np.setdiff1d(np.arange(50), indices.numpy())
  np.testing.assert_array_equal(before[others], after[others])
  if isinstance(optimizer, LazyAdam):  # two Adam steps on the same rows, by hand
    m = v = 0.0
    expected = before[indices.numpy()].copy()
    for step in (1, 2):
      m = 0.9 * m + 0.1 * values.numpy()
      v = 0.999 * v + 0.001 * values.numpy() ** 2
      alpha = 0.1 * np.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
      expected -= alpha * m / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(after[indices.numpy()], expected, rtol=1e-5)
  else:
    assert np.all(before[indices.numpy()] != after[indices.numpy()])


def test_recompiling_keeps_one_gradient_size_metric(lib):
  model = lib.build_model()
  x, y = lib.make_batch(n=6)
  for config in (NonPrivate(), DPFEST(1.0, 1.0, {"a0": [1]})):
    model.compile(DPOptimizer(config, SparseSGD(0.1)), loss=lib.loss, run_eagerly=True)
    history = model.fit(x, y, batch_size=6, epochs=1, verbose=0)
  assert [m.name for m in model.metrics].count("gradient_size") == 1
  assert history.history["gradient_size"] == [float(lib.dims["a0"])]


def test_model_without_dp_tables_logs_no_gradient_size():
  inputs = tf.keras.Input((3,))
  model = DPModel(inputs, tf.keras.layers.Dense(1)(inputs))
  model.compile(DPOptimizer(DPSGD(1.0, 1.0), SparseSGD(0.1), insecure_noise_seed=0),
                loss=tf.keras.losses.MeanSquaredError())
  history = model.fit(np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32), batch_size=4,
                      epochs=1, verbose=0)
  assert "loss" in history.history
  assert not {"gradient_size", "gradient_size_reduction"} & set(history.history)


class _RunningMean(tf.keras.layers.Layer):
  """A custom layer that keeps a running mean of its inputs by `assign` in training."""

  def build(self, input_shape):
    self.mean = self.add_weight(name="mean", shape=input_shape[-1:], trainable=False,
                                initializer="zeros")

  def call(self, inputs, training=False):
    if training:
      self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(inputs, axis=0))
    return inputs - self.mean


def _fit_with(layer):
  inputs = tf.keras.Input((3,))
  model = DPModel(inputs, tf.keras.layers.Dense(1)(layer(tf.keras.layers.Dense(4)(inputs))))
  model.compile(DPOptimizer(DPSGD(1.0, 1.0), SparseSGD(0.1)), loss="mse")
  x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  return model


@pytest.mark.parametrize("make_layer", [
    lambda: tf.keras.layers.BatchNormalization(name="batch_norm"),
    lambda: _RunningMean(name="batch_norm")], ids=["batch_normalization", "assigning_layer"])
def test_layers_updating_variables_from_the_batch_are_refused(make_layer):
  with pytest.raises(DprecError, match="updates variables from the batch in layer.*batch_norm"):
    _fit_with(make_layer())


def test_frozen_batch_normalization_is_accepted():
  frozen = tf.keras.layers.BatchNormalization(trainable=False)
  model = _fit_with(frozen)
  before = [w.numpy() for w in frozen.non_trainable_weights]
  model.fit(np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32), batch_size=8, verbose=0)
  for old, new in zip(before, frozen.non_trainable_weights):
    np.testing.assert_array_equal(old, new.numpy())


@pytest.mark.parametrize("config", [
    DPSGD(1.0, 1.0),
    DPAdaFEST(1.0, 1.0, contribution_clip=1.0, contribution_noise_multiplier=1.0, threshold=0.5)],
    ids=["dp_sgd", "dp_adafest"])
def test_frozen_dp_embedding_is_not_updated(config):
  """A DPEmbedding with trainable=False is a plain lookup: the DP step neither noises nor moves
  it (it did both), and the gradient size counts only the trainable table."""
  ids = tf.keras.Input((2,), dtype=tf.int64)
  frozen = DPEmbedding(50, 4, name="frozen", trainable=False)
  live = DPEmbedding(50, 4, name="live")
  output = tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()([frozen(ids), live(ids)]))
  model = DPModel(ids, output)
  model.compile(DPOptimizer(config, SparseSGD(1.0), expected_batch_size=4,
                            insecure_noise_seed=1), loss="mse")
  before = frozen.embeddings.numpy(), live.embeddings.numpy()
  model.fit(np.array([[1, 2], [3, 3], [1, 4], [5, 6]]), np.ones((4, 1), np.float32),
            batch_size=4, verbose=0)
  np.testing.assert_array_equal(before[0], frozen.embeddings.numpy())
  assert np.any(before[1] != live.embeddings.numpy())
  assert model.dp_tables == [live] and model.dense_embedding_size == 50 * 4


def test_secure_noise_steps_are_reproducible_from_the_key(lib):
  """Secure mode draws each noise tensor from its own keyed stream, in program order: the same
  key gives the same weights after two DP-AdaFEST steps (what exact resume relies on)."""
  config = DPAdaFEST(0.5, 1.0, contribution_clip=1.0, contribution_noise_multiplier=2.0,
                     threshold=1.0)
  x, y = lib.make_batch(n=12)
  weights = []
  for _ in range(2):
    model = lib.build_model()
    model.compile(DPOptimizer(config, SparseSGD(0.1), expected_batch_size=6.0,
                              insecure_noise_seed=5, secure_noise=True), loss=lib.loss)
    model.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False)
    weights.append([w.numpy() for w in model.trainable_variables])
  for a, b in zip(*weights):
    np.testing.assert_array_equal(a, b)
