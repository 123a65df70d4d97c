"""User-level DP (`dprec.clipping.units`): per-unit norms equal brute force for every registered
layer and DP tables, removing one unit moves the clipped sum by ≤ C2 and the DP-AdaFEST map by
≤ C1, a batch of one-row units is the row-level step, lazy noise runs, and what cannot give a
per-unit norm is refused."""
import importlib.metadata
import types

import numpy as np
import pytest
import tensorflow as tf

from dprec.clipping import layer_norms
from dprec.clipping import units as units_lib
from dprec.clipping.units import UNIT_KEY
from dprec.distribute import replicas as replicas_lib
from dprec.errors import DprecError
from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel, ExtraNorms
from dprec.optimizers import DPFEST, DPSGD, DPAdaFEST, DPOptimizer, SparseSGD
from dprec.optimizers.config import DPSGDLazy
from dprec.sparse import contribution as contribution_lib

# Units of one row and of many rows mixed in one batch (rows of a unit together, increasing).
LAYOUTS = {"mixed": [0, 0, 0, 0, 0, 1, 2, 2], "one_row_each": [0, 1, 2, 3, 4, 5]}
MODEL_UNITS = [0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 3, 4]  # for the conftest batch of 12 rows


def _flat(outputs):
  return outputs.to_tensor() if isinstance(outputs, tf.RaggedTensor) else outputs


def _gradient_norm(grads):
  return sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g)))) for g in grads
             if g is not None)


LAYERS = {  # (layer, input shape or None for ids): every registered class, each code path
    "dense": (lambda: tf.keras.layers.Dense(4, activation="tanh"), (5,)),
    "dense_sequence": (lambda: tf.keras.layers.Dense(4, use_bias=False), (3, 5)),
    "einsum_gram": (lambda: tf.keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4),
                                                        bias_axes="de"), (3, 5)),
    "einsum_shared_axis": (lambda: tf.keras.layers.EinsumDense("abc,bcd->abd", (3, 4),
                                                               bias_axes="d"), (3, 5)),
    "embedding": (lambda: tf.keras.layers.Embedding(9, 3), None),
    "embedding_ragged": (lambda: tf.keras.layers.Embedding(9, 3), "ragged"),
    "layer_normalization": (lambda: tf.keras.layers.LayerNormalization(), (3, 5)),
}


def _layer_inputs(shape, n):
  rng = np.random.default_rng(4)
  if shape is None:
    ids = rng.integers(0, 4, (n, 2))  # few ids: a unit's rows share them
    ids[0, 1] = ids[0, 0]
    return tf.constant(ids, tf.int64)
  if shape == "ragged":
    return tf.ragged.constant([list(rng.integers(0, 4, 1 + i % 3)) for i in range(n)],
                              dtype=tf.int64)
  return tf.random.stateless_normal((n,) + shape, seed=[1, 2])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(LAYERS))
def test_per_unit_layer_norms_equal_brute_force(kind, layout):
  """For L_i = Σ w_i ⊙ layer(x)_i: the registry function's per-unit norms equal ‖∇ Σ_{i∈u} L_i‖²
  taken by a tape per unit."""
  make, shape = LAYERS[kind]
  layer, unit = make(), np.array(LAYOUTS[layout])
  registry = layer_norms.make_layer_registry()
  x = _layer_inputs(shape, len(unit))
  outputs = _flat(layer(x))
  for weight in layer.trainable_weights:  # away from initial ones and zeros
    weight.assign(tf.random.stateless_normal(weight.shape, seed=[3, 4]))
  w = tf.random.stateless_normal(tf.shape(outputs), seed=[5, 6])
  assert registry.per_unit(layer)
  with tf.GradientTape() as tape:
    watched, outputs, squared_norm_fn = registry.lookup(layer)(layer, (x,), {}, tape, None)
    loss = tf.reduce_sum(_flat(outputs) * w)
  got = squared_norm_fn(tape.gradient(loss, watched), units_lib.Units(tf.constant(unit)))
  expected = []
  for u in range(unit.max() + 1):
    rows = np.flatnonzero(unit == u)
    with tf.GradientTape() as tape:
      outputs = _flat(layer(tf.gather(x, rows)))
      loss = tf.reduce_sum(outputs * tf.gather(w, rows)[:, :outputs.shape[1]])
    expected.append(_gradient_norm(tape.gradient(loss, layer.trainable_weights)))
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("positions", [1, 3, 6])
def test_both_forms_of_the_unit_gram_agree(positions):
  """The padded Gram (k_max·T small) and the per-unit gradient (d·p small) give the same norms:
  with d·p = 20 the first form serves (k_max·T)² ≤ 20, the second the others."""
  unit = tf.constant([0, 0, 1, 2, 2, 2])
  a = tf.random.stateless_normal([6, positions, 5], seed=[1, 1])
  g = tf.random.stateless_normal([6, positions, 4], seed=[2, 2])
  got = layer_norms.unit_gram_squared_norms(a, g, units_lib.Units(unit))
  expected = [np.sum(np.einsum("itd,itp->dp", a.numpy()[rows], g.numpy()[rows]) ** 2)
              for rows in ([0, 1], [2], [3, 4, 5])]
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def _features(x, unit=None):
  features = {"cat": x[0], "multi": x[1], "extra": x[2]}
  if unit is not None:
    features[UNIT_KEY] = tf.constant(unit, tf.int32)
  return features


def _per_unit(per_example, unit):
  """{variable: [U, ...]}: the per-example gradients summed over each unit's rows."""
  unit = np.asarray(unit)
  return {name: np.stack([g[unit == u].sum(axis=0) for u in range(unit.max() + 1)])
          for name, g in per_example.items()}


FEST_ROWS = {"a0": [0, 2, 3], "a1": [4], "m": [1, 2, 5]}


@pytest.mark.parametrize("selected", [None, FEST_ROWS], ids=["all_rows", "fest_rows"])
def test_per_unit_norms_of_the_step_equal_brute_force(lib, selected):
  """The conftest model (two stacked tables, a multi-valued table called twice, Dense,
  LayerNormalization), in the DP step: each unit's squared norm (kept rows only) equals that
  of its rows' brute-force gradients summed."""
  model = lib.build_model()
  config = DPSGD(1.0, 0.0) if selected is None else DPFEST(1.0, 0.0, selected)
  model.compile(DPOptimizer(config, SparseSGD(0.1)), loss=lib.loss)
  x, y = lib.make_batch()
  per_example = lib.brute_force_gradients(model, x, y, kept=selected)
  expected = lib.squared_norms(_per_unit(per_example, MODEL_UNITS))
  got = model.per_example_squared_norms(_features(x, MODEL_UNITS), y).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # Not the row-level norms summed: the rows of a unit add up before the square.
  assert not np.allclose(got, _per_unit({"n": lib.squared_norms(per_example)}, MODEL_UNITS)["n"])
  traced = tf.function(model.per_example_squared_norms)(_features(x, MODEL_UNITS), y)
  np.testing.assert_allclose(traced, expected, rtol=1e-5, atol=1e-6)


def _clipped_sum(model, features, y, expected_batch_size):
  """The step's noiseless clipped sum, dense (embedding rows included), one array a variable."""
  return [tf.convert_to_tensor(g).numpy() * expected_batch_size
          for g, _ in model.dp_gradients(features, y)]


def _without_unit(x, y, unit, removed):
  """The batch without unit `removed`'s rows, the units after it renumbered."""
  unit = np.asarray(unit)
  keep = np.flatnonzero(unit != removed)
  rest = unit[keep] - (unit[keep] > removed)
  return [tf.gather(t, keep) for t in x], tf.gather(y, keep), rest


def _distance(a, b):
  return float(np.sqrt(sum(np.sum((u - v) ** 2) for u, v in zip(a, b))))


def test_removing_one_unit_moves_the_clipped_sum_by_at_most_the_clip(lib):
  """DP-SGD, no noise, a fixed normaliser: removing any unit (all its rows) moves the clipped
  sum of dense and embedding gradients together by ≤ C2, though unit 0 (7 rows) is far above
  C2 unclipped; the row-level step moves by more when those rows go."""
  clip, expected_batch_size = 0.05, 5.0
  model = lib.build_model()
  model.compile(DPOptimizer(DPSGD(clip, 0.0), SparseSGD(0.1),
                            expected_batch_size=expected_batch_size), loss=lib.loss)
  x, y = lib.make_batch()
  norms = model.per_example_squared_norms(_features(x, MODEL_UNITS), y).numpy()
  assert np.sqrt(norms[0]) > 20 * clip
  whole = _clipped_sum(model, _features(x, MODEL_UNITS), y, expected_batch_size)
  for removed in range(max(MODEL_UNITS) + 1):
    rest_x, rest_y, rest_unit = _without_unit(x, y, MODEL_UNITS, removed)
    part = _clipped_sum(model, _features(rest_x, rest_unit), rest_y, expected_batch_size)
    assert 0 < _distance(whole, part) <= clip * (1 + 1e-5)
  rest_x, rest_y, _ = _without_unit(x, y, MODEL_UNITS, 0)
  row_level = _distance(_clipped_sum(model, _features(x), y, expected_batch_size),
                        _clipped_sum(model, _features(rest_x), rest_y, expected_batch_size))
  assert row_level > 1.5 * clip


def _contribution_map(monkeypatch, model, features, y):
  """{global position: value} of the DP-AdaFEST contribution map the step builds."""
  maps = []

  def recording(*args):
    cmap = original(*args)
    maps.append(cmap)
    return cmap

  original = contribution_lib.contribution_map
  monkeypatch.setattr(contribution_lib, "contribution_map", recording)
  model.per_example_squared_norms(features, y)
  monkeypatch.setattr(contribution_lib, "contribution_map", original)
  (cmap,) = maps
  return dict(zip(cmap.rows.numpy().tolist(), cmap.values.numpy().tolist()))


def _map_distance(a, b):
  return float(np.sqrt(sum((a.get(r, 0.0) - b.get(r, 0.0)) ** 2 for r in set(a) | set(b))))


def test_removing_one_unit_moves_the_contribution_map_by_at_most_c1(lib, monkeypatch):
  """DP-AdaFEST: a unit's map is 0/1 over the distinct rows its rows touch, clipped to C1 as
  one; removing any unit moves the batch map by ≤ C1 (unit 0 touches far more than C1² rows);
  at row level removing unit 0's rows moves it by more."""
  clip = 0.5
  model = lib.build_model()
  model.compile(DPOptimizer(DPAdaFEST(1.0, 0.0, contribution_clip=clip,
                                      contribution_noise_multiplier=1.0, threshold=0.5),
                            SparseSGD(0.1), insecure_noise_seed=1), loss=lib.loss)
  x, y = lib.make_batch()
  whole = _contribution_map(monkeypatch, model, _features(x, MODEL_UNITS), y)
  for removed in range(max(MODEL_UNITS) + 1):
    rest_x, rest_y, rest_unit = _without_unit(x, y, MODEL_UNITS, removed)
    part = _contribution_map(monkeypatch, model, _features(rest_x, rest_unit), rest_y)
    assert 0 < _map_distance(whole, part) <= clip * (1 + 1e-6)
    if removed == 0:  # each of its k_0 distinct rows changes: unclipped, ‖v_0‖ = √k_0 ≫ C1
      changed = [r for r in set(whole) | set(part) if whole.get(r, 0.0) != part.get(r, 0.0)]
      assert np.sqrt(len(changed)) > 6 * clip
  rest_x, rest_y, _ = _without_unit(x, y, MODEL_UNITS, 0)
  row_level = _map_distance(_contribution_map(monkeypatch, model, _features(x), y),
                            _contribution_map(monkeypatch, model, _features(rest_x), rest_y))
  assert row_level > 2 * clip


def test_units_of_one_row_are_the_row_level_step(lib):
  """Every row its own unit: the same norms and the same clipped, noised gradients (one key)."""
  x, y = lib.make_batch()
  got = []
  for unit in (list(range(12)), None):
    model = lib.build_model()
    model.compile(DPOptimizer(DPSGD(0.5, 1.0), SparseSGD(0.1), insecure_noise_seed=3),
                  loss=lib.loss)
    got.append((model.per_example_squared_norms(_features(x, unit), y).numpy(),
                [tf.convert_to_tensor(g).numpy()
                 for g, _ in model.dp_gradients(_features(x, unit), y)]))
  np.testing.assert_allclose(got[0][0], got[1][0], rtol=1e-5)
  for unit_level, row_level in zip(got[0][1], got[1][1]):
    np.testing.assert_allclose(unit_level, row_level, rtol=1e-5, atol=1e-6)


def _ids_model():
  tf.keras.utils.set_random_seed(3)
  ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
  h = DPEmbedding(40, 3, combiner="sum", name="table")(ids)
  h = tf.keras.layers.Dense(4, activation="tanh")(h)
  return DPModel(ids, tf.keras.layers.Dense(1)(h))


def test_lazy_noise_at_user_level_ends_at_eager_dp_sgds_weights():
  """Lazy noise needs only the clipped sums: with units, four steps of DPSGDLazy and the flush
  end at DP-SGD's weights (noise keyed per (row, step))."""
  rng = np.random.default_rng(1)
  unit = [0, 0, 0, 1, 2, 2, 3, 3]
  batches = [({"ids": tf.constant(rng.integers(0, 12, (8, 2)), tf.int64),
               UNIT_KEY: tf.constant(unit, tf.int32)},
              tf.constant(rng.integers(0, 2, (8, 1)), tf.float32)) for _ in range(4)]
  weights = []
  for config in (DPSGD(1.0, 1.5, per_step_noise=True), DPSGDLazy(1.0, 1.5, per_step_noise=True)):
    model = _ids_model()
    model.compile(DPOptimizer(config, SparseSGD(0.5), expected_batch_size=4.0,
                              insecure_noise_seed=5),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    for x, y in batches:
      model.train_on_batch(x, y)
    model.materialise_pending()
    weights.append([w.numpy() for w in model.trainable_variables])
  for eager, lazy in zip(*weights):
    np.testing.assert_allclose(lazy, eager, rtol=1e-5, atol=1e-5)


def test_what_gives_no_per_unit_norm_is_refused(lib, monkeypatch):
  x, y = lib.make_batch()
  features = _features(x, MODEL_UNITS)
  model = lib.build_model()
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), SparseSGD(0.1)), loss=lib.loss)
  registry = layer_norms.make_layer_registry()
  registry.insert(tf.keras.layers.Dense, layer_norms.dense_computation)  # per-example only
  object.__setattr__(model, "layer_registry", registry)
  with pytest.raises(DprecError, match=r"user-level DP .*'dense.*' \(Dense\) has a per-example"):
    model.per_example_squared_norms(features, y)
  model.per_example_squared_norms(_features(x), y)  # row level: as before
  object.__setattr__(model, "layer_registry", None)
  object.__setattr__(model, "extra_squared_norms", lambda: [
      ExtraNorms([], tf.zeros([12]), lambda grads: grads)])
  with pytest.raises(DprecError, match="extra_squared_norms gives per-example norms only"):
    model.per_example_squared_norms(features, y)
  with pytest.raises(DprecError, match=f"{UNIT_KEY!r} must be a dense integer tensor"):
    model.per_example_squared_norms(dict(features, **{UNIT_KEY: tf.zeros([12])}), y)
  object.__setattr__(model, "extra_squared_norms", lambda: [])
  monkeypatch.setattr(replicas_lib, "Replicas", lambda: types.SimpleNamespace(count=2))
  with pytest.raises(DprecError, match="replicas could split a unit's rows"):
    model.per_example_squared_norms(features, y)


def test_units_out_of_order_are_refused(lib):
  model = lib.build_model()
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), SparseSGD(0.1)), loss=lib.loss)
  x, y = lib.make_batch()
  with pytest.raises(tf.errors.InvalidArgumentError, match="each unit's rows together"):
    model.per_example_squared_norms(_features(x, [0, 1, 0] + list(range(2, 11))), y)


@pytest.mark.skipif(int(importlib.metadata.version("keras").split(".")[0]) < 3,
                    reason="Keras 3 is not installed")
def test_keras3_binding_clips_per_unit():
  """The Keras 3 binding runs the same step: per-unit norms equal brute force, and removing a
  unit moves the clipped sum by ≤ C2."""
  import keras
  from dprec.models import keras3 as keras3_binding
  keras.utils.set_random_seed(2)
  ids = keras.Input((2,), dtype="int32", name="ids")
  hidden = keras.layers.Dense(4, activation="tanh")(
      keras.layers.Flatten()(keras.layers.Embedding(9, 3)(ids)))
  model = keras3_binding.dp_model(keras.Model({"ids": ids}, keras.layers.Dense(1)(hidden)))
  clip, expected_batch_size = 0.05, 3.0
  model.compile(DPOptimizer(DPSGD(clip, 0.0), keras.optimizers.SGD(0.1),
                            expected_batch_size=expected_batch_size), loss="mse")
  rng = np.random.default_rng(1)
  x = tf.constant(rng.integers(0, 9, (7, 2)), tf.int32)
  y = tf.constant(rng.normal(size=(7, 1)), tf.float32)
  unit = [0, 0, 0, 0, 1, 2, 2]
  expected = []
  for u in range(3):
    rows = np.flatnonzero(np.array(unit) == u)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model({"ids": tf.gather(x, rows)}) - tf.gather(y, rows)))
    expected.append(_gradient_norm(tape.gradient(loss, model.trainable_variables)))
  features = {"ids": x, UNIT_KEY: tf.constant(unit)}
  np.testing.assert_allclose(model.per_example_squared_norms(features, y), expected, rtol=1e-4)
  whole = _clipped_sum(model, features, y, expected_batch_size)
  rows = np.flatnonzero(np.array(unit) != 0)
  part = _clipped_sum(model, {"ids": tf.gather(x, rows), UNIT_KEY: tf.constant([0, 1, 1])},
                      tf.gather(y, rows), expected_batch_size)
  assert np.sqrt(expected[0]) > 2 * clip
  assert _distance(whole, part) == pytest.approx(clip, rel=1e-5)
