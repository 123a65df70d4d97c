"""Lazy dense noise for DP-SGD (Lim et al., "LazyDP", ASPLOS 2024; `dprec.sparse.lazy`): with
noise keyed per (row, step) the lazy run ends at eager DP-SGD's weights (SGD and momentum); the
one-Gaussian shortcut's pending noise has the derived variance and (row, velocity) covariance;
nothing released holds pending noise; what lazy noise cannot run with is refused."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPOptimizer
from dprec.optimizers.config import DPSGD, DPSGDLazy
from dprec.optimizers.sparse import LazyAdam, SparseSGD, TableSGD
from dprec.sparse import lazy as lazy_lib
from dprec.sparse import noise as noise_lib

VOCAB, DIM, BATCH = 40, 3, 8.0


def _model():
  tf.keras.utils.set_random_seed(3)
  ids = tf.keras.Input((2,), dtype=tf.int64)
  h = DPEmbedding(VOCAB, DIM, combiner="sum", name="table")(ids)
  h = tf.keras.layers.Dense(4, activation="tanh")(h)
  return DPModel(ids, tf.keras.layers.Dense(1)(h))


def _batches(count=6, n=8):
  rng = np.random.default_rng(1)  # ids < 12: most of the 40 rows stay untouched for steps
  return [(tf.constant(rng.integers(0, 12, (n, 2)), tf.int64),
           tf.constant(rng.integers(0, 2, (n, 1)), tf.float32)) for _ in range(count)]


def _optimizer(momentum):
  if momentum is None:
    return SparseSGD(0.5)
  return TableSGD(0.01, table_learning_rate=0.5, momentum=momentum)


def _compiled(config, momentum):
  model = _model()
  optimizer = _optimizer(momentum)
  model.compile(DPOptimizer(config, optimizer, expected_batch_size=BATCH,
                            insecure_noise_seed=5),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  if momentum is not None:
    optimizer.train_tables([model.dp_tables[0].embeddings])
  optimizer.build(model.trainable_variables)
  return model


@pytest.mark.parametrize("momentum", [None, 0.0, 0.9])
def test_lazy_run_ends_at_eager_dp_sgds_weights(momentum):
  """Same key, noise keyed per (row, step): after six steps (rows read after gaps of several
  steps, some never) and the final flush, every weight equals eager DP-SGD's to float rounding."""
  weights = []
  for config in (DPSGD(1.0, 1.5, per_step_noise=True), DPSGDLazy(1.0, 1.5, per_step_noise=True)):
    model = _compiled(config, momentum)
    for x, y in _batches():
      model.train_on_batch(x, y)
    model.materialise_pending()
    weights.append([w.numpy() for w in model.trainable_variables])
  for eager, lazy in zip(*weights):
    np.testing.assert_allclose(lazy, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_pending_noise_has_the_derived_covariance(momentum):
  """k = 7 pending steps drawn as one Gaussian, 40,000 samples: Var(Δw), Cov(Δw, Δv), Var(Δv)
  equal (η·s)²·(A, X, V), and A, X, V equal the sums over the seven steps' weights."""
  k, lr, std, n = 7, 0.3, 0.2, 40_000
  table = tf.Variable(tf.zeros([n, 1]))
  optimizer = TableSGD(0.01, table_learning_rate=lr, momentum=momentum)
  optimizer.train_tables([table])
  optimizer.build([table])
  lazy = lazy_lib.LazyNoise([table], optimizer, std, tf.random.Generator.from_seed(2))
  lazy.materialise(0, tf.range(n, dtype=tf.int64), k)
  moves_w = table.numpy()[:, 0]
  moves_v = (optimizer.velocity(table).numpy()[:, 0] if momentum else np.zeros(n))
  a = [(1 - momentum ** (j + 1)) / (1 - momentum) for j in range(k)]
  b = [momentum ** j for j in range(k)]
  expected = np.array([np.dot(a, a), np.dot(a, b), np.dot(b, b) if momentum else 0.0])
  formula = np.array([c.numpy()[0] for c in lazy_lib.pending_covariance(
      tf.constant([k], tf.int64), momentum)])
  np.testing.assert_allclose(formula[:3 if momentum else 1], expected[:3 if momentum else 1],
                             rtol=1e-9)
  measured = np.cov(np.stack([moves_w, moves_v]))
  scale = (lr * std) ** 2
  # Sample variances of 40,000 Gaussians: relative SE ≈ 0.7%; 5% is > 6 SEs.
  assert measured[0, 0] == pytest.approx(scale * expected[0], rel=0.05)
  if momentum:
    assert measured[0, 1] == pytest.approx(scale * expected[1], rel=0.05)
    assert measured[1, 1] == pytest.approx(scale * expected[2], rel=0.05)
  assert (lazy.done[0].numpy() == k).all()


def test_nothing_released_holds_pending_noise(tmp_path):
  """After fit, and before a save or a prediction, no row has pending noise (`done` = steps)."""
  model = _compiled(DPSGDLazy(1.0, 1.5), 0.9)
  x = tf.concat([x for x, _ in _batches()], 0)
  y = tf.concat([y for _, y in _batches()], 0)
  model.fit(x, y, batch_size=8, verbose=0)
  assert (model._lazy.done[0].numpy() == 6).all()
  model.train_on_batch(x[:8], y[:8])
  assert (model._lazy.done[0].numpy() < 7).any()
  model.save_weights(str(tmp_path / "w"))
  assert (model._lazy.done[0].numpy() == 7).all()


def test_lazy_noise_is_refused_where_it_cannot_run():
  """A non-SGD table optimizer (Adam's update is not linear in the noise) is refused."""
  model = _model()
  model.compile(DPOptimizer(DPSGDLazy(1.0, 1.0), LazyAdam(0.01), expected_batch_size=BATCH,
                            insecure_noise_seed=0),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  x, y = _batches(1)[0]
  with pytest.raises(DprecError, match="not SparseSGD or TableSGD"):
    model.train_on_batch(x, y)


def test_table_sgd_without_the_tables_is_refused():
  """TableSGD not told which variables are the DP tables would run Adam on their noise-free
  clipped sums (the noise added apart): refused."""
  model = _model()
  model.compile(DPOptimizer(DPSGDLazy(1.0, 1.0), TableSGD(0.01, table_learning_rate=0.5),
                            expected_batch_size=BATCH, insecure_noise_seed=0),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  x, y = _batches(1)[0]
  with pytest.raises(DprecError, match="not given the DP tables"):
    model.train_on_batch(x, y)



def test_the_look_ahead_reads_no_table_rows():
  """The pass that finds the rows a step will read records their ids without gathering them
  (a table read is stateful: it would run although nothing uses it), and finds the same rows."""
  model = _compiled(DPSGDLazy(1.0, 1.5), None)
  x, _ = _batches(1)[0]
  graph = tf.function(model._rows_read).get_concrete_function(x).graph
  assert not [op.name for op in graph.get_operations() if op.type == "ResourceGather"]
  rows = model._rows_read(x)
  np.testing.assert_array_equal(np.sort(rows[0].numpy()), np.unique(x.numpy()))


def test_distinct_row_gradients_skip_the_duplicate_sum_and_others_keep_it():
  """A `DistinctRows` gradient is applied as it is (no unique and segment sum over its values);
  an ordinary IndexedSlices with a repeated row still has its values summed first."""
  for optimizer in (SparseSGD(0.5), LazyAdam(0.1), TableSGD(0.1, table_learning_rate=0.5)):
    table = tf.Variable(tf.zeros([6, 2]))
    if isinstance(optimizer, TableSGD):
      optimizer.train_tables([table])
    values, rows = tf.ones([3, 2]), tf.constant([1, 1, 4], tf.int64)
    distinct = noise_lib.DistinctRows(values[:2], tf.constant([1, 4], tf.int64),
                                      tf.constant([6, 2], tf.int64))
    summed = optimizer._deduplicate_sparse_grad(
        [distinct, tf.IndexedSlices(values, rows, tf.constant([6, 2], tf.int64))])
    assert summed[0] is distinct
    np.testing.assert_array_equal(tf.convert_to_tensor(summed[1]).numpy()[1], [2.0, 2.0])
    assert summed[1].indices.shape[0] == 2
    optimizer.apply_gradients([(distinct, table)])
    moved = np.flatnonzero(np.abs(table.numpy()).sum(1))
    np.testing.assert_array_equal(moved, [1, 4])
