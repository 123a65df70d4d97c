"""`ForwardNoise` (Du et al., "DP-Forward: Fine-tuning and Inference on Language Models with
Differential Privacy in Forward Pass", arXiv:2309.06746): bounded norms per example, calibrated
noise covariance."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.layers.forward_noise import ForwardNoise


def seeded(seed=0):
  return tf.random.Generator.from_seed(seed)


@pytest.mark.parametrize("shape", [(5, 4), (3, 6, 4)])
def test_normalize_gives_norm_c_for_every_example(shape):
  x = tf.random.stateless_normal(shape, [1, 2]) * tf.reshape(
      tf.range(1, shape[0] + 1, dtype=tf.float32) ** 3, [-1] + [1] * (len(shape) - 1))
  layer = ForwardNoise(0.7, 1.0, generator=seeded())
  bounded = layer.bounded(x).numpy().reshape(shape[0], -1)
  np.testing.assert_allclose(np.linalg.norm(bounded, axis=1), 0.7, rtol=1e-5)
  # The output is the bounded representation plus noise: different, same shape.
  assert layer(x, training=True).shape == shape


def test_clip_bounds_large_norms_and_keeps_small_ones():
  x = tf.constant([[3.0, 4.0], [0.3, 0.4]])
  bounded = ForwardNoise(1.0, 1.0, bound="clip", generator=seeded()).bounded(x).numpy()
  np.testing.assert_allclose(bounded, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)


def test_sensitivity_is_twice_the_bound_brute_force():
  """Any two normalised representations are at most 2C apart, and opposite ones reach it."""
  layer = ForwardNoise(1.5, 1.0, generator=seeded())
  assert layer.sensitivity == 3.0
  x = tf.random.stateless_normal([64, 3], [3, 4])
  bounded = layer.bounded(tf.concat([x, -x], 0)).numpy()
  distances = np.linalg.norm(bounded[:, None] - bounded[None], axis=-1)
  assert distances.max() == pytest.approx(3.0, rel=1e-5)
  assert distances.max() <= 3.0 * (1 + 1e-6)


def test_noise_covariance_matches_calibration():
  """Empirical covariance of the output over many draws of one input is σ²·I, σ = z·2C."""
  layer = ForwardNoise(0.5, 0.8, generator=seeded(7))
  x = tf.tile(tf.constant([[1.0, 2.0, 0.0, -1.0]]), [20000, 1])
  noisy = layer(x, training=True).numpy()
  clean = layer.bounded(x).numpy()
  sigma = 0.8 * 2 * 0.5
  np.testing.assert_allclose(np.cov((noisy - clean).T), sigma ** 2 * np.eye(4), atol=0.03)
  np.testing.assert_allclose(noisy.mean(0), clean[0], atol=0.03)


def test_inference_noise_is_optional():
  x = tf.constant([[1.0, 2.0]])
  quiet = ForwardNoise(1.0, 1.0, at_inference=False, generator=seeded())
  np.testing.assert_allclose(quiet(x, training=False), quiet.bounded(x))
  loud = ForwardNoise(1.0, 1.0, generator=seeded())
  assert not np.allclose(loud(x, training=False), loud.bounded(x))


def test_no_gradient_reaches_the_user_side_unless_asked():
  x = tf.constant([[1.0, 2.0, 3.0]])
  for user_gradients in (False, True):
    layer = ForwardNoise(1.0, 0.5, user_gradients=user_gradients, generator=seeded())
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(layer(x, training=True))
    assert (tape.gradient(y, x) is not None) == user_gradients


def test_dimension_reduction_bounds_the_reduced_vector_and_restores_dim():
  layer = ForwardNoise(1.0, 0.5, reduced_dim=2, user_gradients=True, generator=seeded())
  x = tf.random.stateless_normal([4, 6], [5, 6])
  assert layer(x, training=True).shape == (4, 6)
  bounded = layer.bounded(x).numpy()
  assert bounded.shape == (4, 2)
  np.testing.assert_allclose(np.linalg.norm(bounded, axis=1), 1.0, rtol=1e-5)
  ids = lambda weights: {id(w) for w in weights}
  assert ids(layer.trainable_weights) == ids([layer.reduce.kernel, layer.restore.kernel])
  fixed = ForwardNoise(1.0, 0.5, reduced_dim=2, generator=seeded())
  fixed(x)
  assert ids(fixed.trainable_weights) == ids([fixed.restore.kernel])


def test_default_generator_is_not_deterministic():
  x = tf.zeros([1, 8])
  first, second = ForwardNoise(1.0, 1.0), ForwardNoise(1.0, 1.0)
  assert not np.allclose(first(x, training=True), second(x, training=True))


def test_bad_arguments():
  with pytest.raises(ValueError, match="bound"):
    ForwardNoise(1.0, 1.0, bound="scale")
  with pytest.raises(ValueError, match="norm_bound"):
    ForwardNoise(0.0, 1.0)
