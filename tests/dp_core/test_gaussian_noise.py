"""The step's Gaussian sampler (`dprec.sparse.gaussian`): N(0, σ²) in distribution, any shape."""
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dprec.sparse import gaussian


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_samples_are_gaussian_with_the_given_std(dtype):
  sigma = 2.5
  z = gaussian.normal(tf.random.Generator.from_seed(7), [301, 333], sigma, dtype)
  assert z.dtype == dtype and z.shape == (301, 333)
  flat = z.numpy().ravel() / sigma
  assert stats.kstest(flat, "norm").pvalue > 1e-3
  assert np.mean(np.abs(flat) > 3) == pytest.approx(2 * stats.norm.sf(3), rel=0.15)
  # The two halves come from the same uniforms (cos and sin): still uncorrelated, and the
  # norm of each pair is chi-squared with two degrees of freedom.
  half = flat.size // 2
  assert abs(np.corrcoef(flat[:half], flat[half:2 * half])[0, 1]) < 0.01
  assert stats.kstest(flat[:half] ** 2 + flat[half:2 * half] ** 2, "chi2", args=(2,)).pvalue > 1e-3


def test_shapes_and_the_generator_stream():
  @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  def noisy(values):
    return values + gaussian.normal(generator, tf.shape(values), 1.0)

  generator = tf.random.Generator.from_seed(3)
  assert noisy(tf.zeros([0, 3])).shape == (0, 3)
  assert noisy(tf.zeros([5, 3])).shape == (5, 3)  # odd count
  first = gaussian.normal(tf.random.Generator.from_seed(1), [4])
  again = gaussian.normal(tf.random.Generator.from_seed(1), [4])
  other = gaussian.normal(tf.random.Generator.from_seed(2), [4])
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)


def test_large_tensors_use_the_one_buffer_kernel(monkeypatch):
  monkeypatch.setattr(gaussian, "FUSED_ABOVE", 10)
  z = gaussian.normal(tf.random.Generator.from_seed(4), [3, 5], 2.0)
  np.testing.assert_array_equal(z, tf.random.Generator.from_seed(4).normal([3, 5], stddev=2.0))
  assert gaussian.normal(tf.random.Generator.from_seed(4), [2, 5]).shape == (2, 5)
