"""Adaptive quantile clipping (Andrew et al. 2021, Algorithm 1): the count's sensitivity, its
noise scale measured from samples, the accounting (one Gaussian of the planned σ, as
dp_accounting composes the pair), and the DP step clipping to and noising at the current C2."""
import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from dprec import privacy
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPOptimizer
from dprec.optimizers import DPSGD
from dprec.optimizers import QuantileClipping
from dprec.optimizers import SparseSGD


def test_count_moves_by_one_half_when_one_example_is_added_or_removed():
  rng = np.random.default_rng(0)
  squared = tf.constant(rng.exponential(1.0, 50), tf.float32)
  clip = tf.constant(0.9)
  full = float(QuantileClipping.centered_count(squared, clip))
  for i in range(50):
    removed = float(QuantileClipping.centered_count(
        tf.concat([squared[:i], squared[i + 1:]], 0), clip))
    assert abs(full - removed) == pytest.approx(0.5)


def test_count_noise_scale_and_the_geometric_update_from_samples():
  """C' = C·exp(−η(b̃ − γ)) with b̃ = (count + N(0, σ_b²))/B + ½: recover the noise from C'."""
  quantile = QuantileClipping(count_noise_multiplier=3.0, target_quantile=0.3, learning_rate=0.2)
  generator = tf.random.Generator.from_seed(1)
  count, batch, clip = 4.0, 40.0, tf.constant(2.0, tf.float64)
  noise = generator.normal([20000], stddev=quantile.count_noise_multiplier, dtype=tf.float64)
  new = quantile.next_clip(clip, count + noise, batch).numpy()
  fraction = -np.log(new / 2.0) / 0.2 + 0.3
  recovered = (fraction - 0.5) * batch - count
  assert np.std(recovered) == pytest.approx(3.0, rel=0.03)
  assert np.mean(recovered) == pytest.approx(0.0, abs=0.1)
  # No noise, every example unclipped (b̃ = 1 > γ): the clip shrinks by exp(−η(1 − γ)).
  assert float(quantile.next_clip(clip, tf.constant(batch / 2, tf.float64), batch)) == \
      pytest.approx(2.0 * np.exp(-0.2 * 0.7))


def test_the_pair_is_accounted_as_one_gaussian_of_the_planned_sigma():
  sigma, sigma_b = 0.8, 1.5
  sigma_delta = privacy.quantile_gradient_noise_multiplier(sigma, sigma_b)
  assert sigma_delta == pytest.approx((sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5)
  config = DPSGD(1.0, sigma_delta, quantile_clipping=QuantileClipping(sigma_b))
  assert config.accounting_noise_multiplier == pytest.approx(sigma)
  # dp_accounting on the two releases of one Poisson-sampled step, each at its sensitivity
  # (sum: C, noise σ_Δ·C; count: ½, noise σ_b), equals one Gaussian of σ.
  q, steps, delta = 0.05, 200, 1e-5
  pair = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  pair.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(config.accounting_noise_multiplier)), steps))
  one = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  one.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(sigma)), steps))
  assert pair.get_epsilon(delta) == pytest.approx(one.get_epsilon(delta), rel=1e-6)
  # Without subsampling the composition is exact in dp_accounting's own terms.
  direct = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  direct.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(sigma_delta),
      dp_accounting.GaussianDpEvent(sigma_b / 0.5)]))
  single = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  single.compose(dp_accounting.GaussianDpEvent(sigma))
  assert direct.get_epsilon(delta) == pytest.approx(single.get_epsilon(delta), rel=1e-3)
  with pytest.raises(Exception, match="must exceed"):
    privacy.quantile_gradient_noise_multiplier(1.0, 0.5)


def _dense_model():
  tf.keras.utils.set_random_seed(0)
  inputs = tf.keras.Input((64,))
  return DPModel(inputs, tf.keras.layers.Dense(64)(inputs))


def test_the_step_clips_to_and_noises_at_the_current_clip_then_moves_it():
  clip0, sigma, batch = 0.5, 2.0, 8.0
  config = DPSGD(clip0, sigma, quantile_clipping=QuantileClipping(4.0, learning_rate=0.5))
  model = _dense_model()
  model.compile(DPOptimizer(config, SparseSGD(0.0), expected_batch_size=batch,
                            insecure_noise_seed=3), loss="mse")
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(8, 64)), tf.float32)
  y = tf.constant(100 * rng.normal(size=(8, 64)), tf.float32)  # every example clipped
  assert float(model.dp_optimizer.clip) == clip0
  clips, kernel_noise = [], []
  for _ in range(3):
    clip = float(model.dp_optimizer.clip)
    grads = {v.name: g for g, v in model.dp_gradients(x, y)}
    kernel_noise.append(np.std(grads[model.layers[1].kernel.name].numpy() * batch) / clip)
    clips.append(float(model.dp_optimizer.clip))
  # Noise σ·C_t on the sum (the clipped sum, at most 8·C_t in norm over 4,096 coordinates,
  # is small beside it); the clip grows while every example is clipped (b̃ ≈ 0 < γ = ½).
  np.testing.assert_allclose(kernel_noise, sigma, rtol=0.1)
  assert clips[0] > clip0 and clips[2] > clips[1] > clips[0]
  # The clip factors follow the current clip: each example's clipped gradient has norm C_t.
  squared = model.per_example_squared_norms(x, y).numpy()
  factors = config.clip_factors(tf.constant(squared), clip=model.dp_optimizer.clip).numpy()
  np.testing.assert_allclose(np.sqrt(squared) * factors, clips[2], rtol=1e-5)


def test_quantile_clipping_refuses_normalisation_and_an_infinite_clip():
  with pytest.raises(ValueError, match="quantile clipping"):
    DPSGD(1.0, 1.0, normalization_offset=0.01, quantile_clipping=QuantileClipping(2.0))
  with pytest.raises(ValueError, match="target_quantile"):
    QuantileClipping(2.0, target_quantile=1.0)
