"""DP-AdamBC (Tang et al., "On the Performance of Differentially Private Optimization with
Heavy-Tail Class Imbalance", arXiv:2411.04205, App. A, §6.1, §7): the update formula with its floor,
the per-row noise EMA of
lazily updated rows, σ = 0 = Adam, the DP step's noise variance, no vocabulary-sized work."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPAdaFEST, DPSGD, AdamBC, DPOptimizer

B1, B2 = 0.9, 0.999


def _slots(optimizer, variable):
  m, v, phi, last = optimizer._slots[optimizer._index_dict[optimizer._var_key(variable)]]
  return m.numpy(), v.numpy(), phi.numpy(), last.numpy()


def _adambc_reference(theta, grads, noise_variances, lr, floor):
  """Algorithm 2 (DP-AdamBC) on a dense variable, by hand."""
  m = v = phi = 0.0
  theta = theta.copy()
  for t, (g, var) in enumerate(zip(grads, noise_variances), start=1):
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g ** 2
    phi = B2 * phi + (1 - B2) * var
    m_hat, v_hat, phi_hat = m / (1 - B1 ** t), v / (1 - B2 ** t), phi / (1 - B2 ** t)
    theta -= lr * m_hat / np.sqrt(np.maximum(v_hat - phi_hat, floor))
  return theta


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
def test_update_equals_formula_floor_included(sparse):
  rng = np.random.default_rng(0)
  theta0 = rng.normal(size=(4, 3)).astype(np.float32)
  # Large and small gradients against Φ = 0.25: small ones hit the floor γ' = 0.01.
  grads = [(rng.normal(size=(4, 3)) * np.array([[3.0], [0.05], [1.0], [0.2]])).astype(np.float32)
           for _ in range(3)]
  noise = [0.25, 0.25, 0.16]
  variable = tf.Variable(theta0)
  optimizer = AdamBC(0.1, floor=0.01)
  for g, var in zip(grads, noise):
    optimizer.noise_variance.assign(var)
    grad = (tf.IndexedSlices(tf.constant(g), tf.range(4, dtype=tf.int64), [4, 3]) if sparse
            else tf.constant(g))
    optimizer.apply_gradients([(grad, variable)])
  expected = _adambc_reference(theta0.astype(np.float64), [g.astype(np.float64) for g in grads],
                               noise, 0.1, 0.01)
  np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6)
  _, v, phi, _ = _slots(optimizer, variable)
  corrected = (v - phi[:, None]) / (1 - B2 ** 3)
  assert np.any(corrected < 0.01) and np.any(corrected > 0.01)  # the floor was exercised


def test_lazy_row_kept_at_steps_1_and_4_has_the_formula_noise_ema():
  """Row 2 is noised at steps 1 and 4 only: φ = β2³·(1−β2)·Φ1 + (1−β2)·Φ4 (decayed while
  absent, Tang et al. 2024), and its update uses m, v decayed the same way."""
  variable = tf.Variable(tf.ones([6, 2], tf.float64))  # float64: "exactly" up to 1e-12
  optimizer = AdamBC(0.05, floor=1e-6)
  noise = [0.5, 0.75, 0.875, 1.125]  # exact in the float32 `noise_variance`
  g1, g4 = np.array([2.0, -1.0]), np.array([-3.0, 0.5])
  for step, var in enumerate(noise, start=1):
    rows = [2, 4] if step in (1, 4) else [0, 4]
    values = np.stack([g1 if step == 1 else g4, np.full(2, 0.3)]) if step in (1, 4) \
        else np.full((2, 2), 0.3)
    optimizer.noise_variance.assign(var)
    optimizer.apply_gradients([(tf.IndexedSlices(tf.constant(values, tf.float64),
                                                 tf.constant(rows, tf.int64), [6, 2]), variable)])
  m, v, phi, last = _slots(optimizer, variable)
  assert phi[2] == pytest.approx(B2 ** 3 * (1 - B2) * noise[0] + (1 - B2) * noise[3], rel=1e-12)
  assert phi[4] == pytest.approx(sum(B2 ** (4 - t) * (1 - B2) * n
                                     for t, n in enumerate(noise, start=1)), rel=1e-12)
  assert phi[0] == pytest.approx(B2 * (1 - B2) * noise[1] + (1 - B2) * noise[2], rel=1e-12)
  assert phi[1] == phi[3] == phi[5] == 0.0 and list(last) == [3, 0, 4, 0, 4, 0]
  m2 = B1 ** 3 * (1 - B1) * g1 + (1 - B1) * g4
  v2 = B2 ** 3 * (1 - B2) * g1 ** 2 + (1 - B2) * g4 ** 2
  np.testing.assert_allclose(m[2], m2, rtol=1e-12)
  np.testing.assert_allclose(v[2], v2, rtol=1e-12)
  step1 = 0.05 * g1 / np.sqrt(np.maximum(g1 ** 2 - noise[0], 1e-6))  # t = 1: m̂ = g, v̂ = g²
  step4 = 0.05 * (m2 / (1 - B1 ** 4)) / np.sqrt(np.maximum((v2 - phi[2]) / (1 - B2 ** 4), 1e-6))
  np.testing.assert_allclose(variable.numpy()[2], 1.0 - step1 - step4, rtol=1e-7)  # lr: float32
  np.testing.assert_array_equal(variable.numpy()[[1, 3, 5]], 1.0)


def _small_model(vocab=30, dim=3):
  tf.keras.utils.set_random_seed(3)
  ids = tf.keras.Input((2,), dtype=tf.int64)
  h = DPEmbedding(vocab, dim, combiner="sum", name="table")(ids)
  h = tf.keras.layers.Dense(4, activation="tanh")(h)
  return DPModel(ids, tf.keras.layers.Dense(1)(h))


def _batches(vocab=30, n=8, count=3):
  rng = np.random.default_rng(1)
  return [(tf.constant(rng.integers(0, vocab, (n, 2)), tf.int64),
           tf.constant(rng.integers(0, 2, (n, 1)), tf.float32)) for _ in range(count)]


def test_sigma_zero_equals_adam():
  """With σ = 0 (Φ = 0) DP-AdamBC is Adam: same weights after three DP steps."""
  loss = tf.keras.losses.BinaryCrossentropy(from_logits=True)
  weights = []
  for optimizer in (AdamBC(0.01, floor=1e-30),
                    tf.keras.optimizers.Adam(0.01, epsilon=1e-12, jit_compile=False)):
    model = _small_model()
    model.compile(DPOptimizer(DPSGD(1.0, 0.0), optimizer, expected_batch_size=8.0,
                              insecure_noise_seed=0),
                  loss=loss)
    for x, y in _batches():
      model.train_on_batch(x, y)
    weights.append([w.numpy() for w in model.trainable_variables])
  for bc, adam in zip(*weights):
    np.testing.assert_allclose(bc, adam, rtol=1e-4, atol=1e-6)


def test_dp_step_tells_the_noise_variance_and_the_noised_rows():
  """DP-AdaFEST: the optimizer learns Φ = (σ2·C2/B)², and exactly the kept rows (false
  positives included) get φ = (1 − β2)·Φ; every other row's slots stay untouched."""
  sigma2, clip2, batch = 3.0, 0.5, 4.0
  config = DPAdaFEST(clip2, sigma2, contribution_clip=1.0, contribution_noise_multiplier=1.0,
                     threshold=1.6449)  # ≈ 5% false positives
  model = _small_model(vocab=20000, dim=2)
  optimizer = AdamBC(0.01)
  model.compile(DPOptimizer(config, optimizer, expected_batch_size=batch,
                            insecure_noise_seed=1),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  x = tf.constant([[1, 2], [3, 3], [1, 4], [5, 6]], tf.int64)
  before = model.dp_tables[0].embeddings.numpy()
  model.train_on_batch(x, tf.constant([[1.0], [0.0], [1.0], [0.0]]))
  phi_expected = (1 - B2) * (sigma2 * clip2 / batch) ** 2
  assert optimizer.noise_variance.numpy() == pytest.approx((sigma2 * clip2 / batch) ** 2)
  table = model.dp_tables[0].embeddings
  _, _, phi, last = _slots(optimizer, table)
  noised = np.flatnonzero(last == 1)
  assert 500 < noised.size < 1500  # false positives: ≈ 5% of 20,000
  np.testing.assert_allclose(phi[noised], phi_expected, rtol=1e-4)  # float32
  others = np.setdiff1d(np.arange(20000), noised)
  assert not phi[others].any()
  changed = np.flatnonzero(np.any(before != table.numpy(), axis=1))
  np.testing.assert_array_equal(changed, noised)
  kernel = model.layers[2].kernel
  np.testing.assert_allclose(_slots(optimizer, kernel)[2], phi_expected, rtol=1e-4)


def test_sparse_update_has_no_vocabulary_sized_tensor():
  """Op-level: the update of an IndexedSlices gradient reads and writes rows only; no op of
  the traced step outputs a tensor with the vocabulary's dimension."""
  vocab = 1_000_003
  table = tf.Variable(tf.zeros([vocab, 2]))
  optimizer = AdamBC(0.01)
  optimizer.build([table])

  @tf.function
  def step(values, rows):
    optimizer.apply_gradients([(tf.IndexedSlices(values, rows, [vocab, 2]), table)])

  rows = tf.constant([5, 77, 999_999], tf.int64)
  graph = step.get_concrete_function(tf.TensorSpec([None, 2]),
                                     tf.TensorSpec([None], tf.int64)).graph
  sized = [op.name for op in graph.get_operations() for out in op.outputs
           if out.shape.rank and vocab in out.shape.as_list()]
  assert not sized, sized
  step(tf.ones([3, 2]), rows)
  assert np.count_nonzero(table.numpy().any(axis=1)) == 3


def test_expected_v_hat_minus_g2_is_the_noise_variance():
  """Tang et al. 2024: with a fixed gradient g and noise N(0, (σC/L)²) on every coordinate,
  E[v̂] − g² = (σC/L)² per coordinate (sampled), and v̂ − Φ̂ is unbiased for g²."""
  sigma, clip, batch = 10.0, 1.0, 256
  noise_variance = (sigma * clip / batch) ** 2  # 1.526e-3
  g2 = np.repeat([1e-8, 1e-6, 1e-4], 4000)
  g = np.sqrt(g2).astype(np.float32)
  variable = tf.Variable(tf.zeros(g.shape))
  optimizer = AdamBC(1e-9)  # a negligible step: the gradient stays fixed
  optimizer.noise_variance.assign(noise_variance)
  rng = np.random.default_rng(0)
  steps = 100
  for _ in range(steps):
    noisy = g + rng.normal(0.0, np.sqrt(noise_variance), g.shape).astype(np.float32)
    optimizer.apply_gradients([(tf.constant(noisy), variable)])
  _, v, phi, _ = _slots(optimizer, variable)
  v_hat = v / (1 - B2 ** steps)
  assert phi / (1 - B2 ** steps) == pytest.approx(noise_variance, rel=1e-4)  # float32
  for level in (1e-8, 1e-6, 1e-4):
    group = g2 == level
    assert v_hat[group].mean() - level == pytest.approx(noise_variance, rel=0.03)
  corrected = v_hat[g2 == 1e-4] - noise_variance
  assert corrected.mean() == pytest.approx(1e-4, rel=0.3)
