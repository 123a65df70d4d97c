"""Tang et al.'s "On the Performance of Differentially Private Optimization with Heavy-Tail Class
Imbalance" (arXiv:2411.04205) heavy-tail benchmark (benchmarks/adambc_heavytail.py): its clipped
full-batch gradient of the linear softmax model, from ghost norms and one GEMM, equals the sum of
clipped brute-force per-example gradients; its ε equals dp_accounting called directly; its data
layout is
Tang et al. 2024, §3's."""
import math
import os

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from dprec.optimizers import DPSGD

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "adambc_heavytail.py")


@pytest.fixture(scope="module")
def heavytail(load_script):
  return load_script(PATH)


def _brute_force(x, labels, kernel, clip):
  """Per-example gradients of −log softmax(x_i W)_{y_i} from a tape, their norms, clipped sum."""
  kernel = tf.Variable(kernel)
  with tf.GradientTape() as tape:
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.matmul(x, kernel))
  per_example = tape.jacobian(losses, kernel).numpy()  # [n, d, c]
  norms = np.sqrt((per_example ** 2).sum(axis=(1, 2)))
  factors = np.minimum(1.0, clip / norms)
  return norms, (per_example * factors[:, None, None]).sum(axis=0)


def test_ghost_norms_and_one_gemm_equal_brute_force(heavytail):
  rng = np.random.default_rng(0)
  n, d, c = 12, 7, 5
  x = rng.random((n, d)).astype(np.float32)
  labels = rng.integers(0, c, n)
  kernel = rng.normal(scale=0.5, size=(d, c)).astype(np.float32)
  norms, expected = _brute_force(x, labels, kernel, clip=1.2)
  assert (norms > 1.2).any() and (norms < 1.2).any()  # some examples clipped, some not
  layer = heavytail.linear_model(c, d)
  layer.kernel.assign(kernel)
  residual = tf.nn.softmax(tf.matmul(x, layer.kernel)) - tf.one_hot(labels, c)
  got = heavytail.clipped_gradient_sum(layer, DPSGD(l2_norm_clip=1.2, noise_multiplier=10.0),
                                       tf.constant(x), residual)
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
  ghost = np.linalg.norm(x, axis=1) * np.linalg.norm(residual.numpy(), axis=1)
  np.testing.assert_allclose(ghost, norms, rtol=1e-5)


def test_epsilon_equals_dp_accounting_and_the_exact_gaussian(heavytail):
  sigma, steps, delta = 10.0, 1961, 1e-5
  pld, exact = heavytail.epsilon_full_batch(sigma, steps, delta)
  accountant = dp_accounting.pld.PLDAccountant()  # full batch: q = 1, T steps
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(sigma)), steps))
  assert pld == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
  assert pld == pytest.approx(exact, rel=1e-4)  # T steps = one Gaussian with σ/√T
  assert heavytail.steps_for_epsilon(sigma, exact + 1e-6, delta) == steps


def test_layout_is_note_002s(heavytail):
  x, labels, group_of_class = heavytail.make_data(top_class=64)
  sizes = np.bincount(labels)
  assert x.shape == (4 * 64, 4 * 64 + 64) and sizes.size == 15
  for j in range(4):  # group j: 2^j classes of 64/2^j examples; the rarest have 8
    assert (sizes[group_of_class == j] == 64 // 2 ** j).all()
    assert (group_of_class == j).sum() == 2 ** j
  # S = 1024 is the paper's instance: n = 8192, c = 255, d = 9216.
  groups = int(math.log2(1024 / 8)) + 1
  assert (groups * 1024, 2 ** groups - 1, groups * 1024 + 1024) == (8192, 255, 9216)
