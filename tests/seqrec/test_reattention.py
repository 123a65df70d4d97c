"""Re-Attention (Eq. 4 correction) and error-variance propagation (Eqs. 7, 8) against Monte
Carlo."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.layers import variance as variance_lib
from dprec.layers.reattention import ReAttention, ReAttentionConfig, reattention_logits
from dprec.models.seqrec import SeqRecConfig, SeqRecModel


def _expected_attention(query, keys, key_std, samples, rng, correct):
  """Monte-Carlo E[softmax_j ⟨q, K_j⟩] with K_j = k_j + σ_j·N(0, I)."""
  noise = rng.normal(size=(samples,) + keys.shape) * key_std[None, :, None]
  logits = tf.einsum("d,sjd->sj", query, keys[None] + noise)
  if correct:  # C = ⟨q, q⟩ (no 1/√d in these logits), σ_j² per key coordinate
    norms = tf.fill([samples], tf.constant(query @ query, tf.float64))
    logits = reattention_logits(logits, norms, key_std ** 2)
  return tf.reduce_mean(tf.nn.softmax(logits, axis=-1), axis=0).numpy()


def test_noisy_keys_inflate_attention_and_reattention_removes_it():
  rng = np.random.default_rng(0)
  dim = 8
  query = np.zeros(dim)
  query[0] = 1.0
  # Token 0 is relevant; tokens 1..3 are not. Token 3 is a "tail" token with noisy key.
  keys = np.zeros((4, dim))
  keys[:, 0] = [4.0, 0.0, 0.0, 0.0]
  key_std = np.array([0.0, 0.0, 0.0, 1.2])
  clean = tf.nn.softmax(keys @ query).numpy()
  noisy = _expected_attention(query, keys, key_std, 400_000, rng, correct=False)
  corrected = _expected_attention(query, keys, key_std, 400_000, rng, correct=True)
  inflation = noisy[3] / clean[3]
  predicted = np.exp((query @ query) * key_std[3] ** 2 / 2)  # Eq. 4's multiplicative error
  assert inflation > 1.6
  assert abs(inflation / predicted - 1) < 0.2
  assert noisy[3] > noisy[2] * 1.6  # same relevance, the noisy token gets more attention
  assert abs(corrected[3] / clean[3] - 1) < 0.1
  assert abs(corrected[0] / clean[0] - 1) < 0.01
  assert abs(corrected[3] / corrected[2] - 1) < 0.1


def test_zero_variance_equals_keras_multi_head_attention():
  tf.keras.utils.set_random_seed(3)
  batch, length, dim, heads = 3, 5, 8, 2
  x = tf.random.normal([batch, length, dim])
  valid = tf.ones([batch, length], tf.bool)
  layer = ReAttention(heads, dim // heads)
  ours, out_var = layer(x, valid, tf.zeros([batch, length]), 0.0)
  keras_mha = tf.keras.layers.MultiHeadAttention(heads, dim // heads)
  causal = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
  keras_mha(x, x, attention_mask=tf.tile(causal[None], [batch, 1, 1]))
  for dense, einsum in ((layer.query, keras_mha._query_dense), (layer.key, keras_mha._key_dense),
                        (layer.value, keras_mha._value_dense)):
    einsum.kernel.assign(tf.reshape(dense.kernel, [dim, heads, dim // heads]))
    einsum.bias.assign(tf.reshape(dense.bias, [heads, dim // heads]))
  keras_mha._output_dense.kernel.assign(tf.reshape(layer.output_dense.kernel,
                                                   [heads, dim // heads, dim]))
  keras_mha._output_dense.bias.assign(layer.output_dense.bias)
  reference = keras_mha(x, x, attention_mask=tf.tile(causal[None], [batch, 1, 1]))
  np.testing.assert_allclose(ours.numpy(), reference.numpy(), atol=1e-5)
  np.testing.assert_array_equal(out_var.numpy(), 0.0)
  vanilla = ReAttention(heads, dim // heads, config=ReAttentionConfig(enabled=False))
  vanilla(x, valid)
  vanilla.set_weights(layer.get_weights())
  np.testing.assert_allclose(vanilla(x, valid)[0].numpy(), ours.numpy(), atol=1e-6)
  # A positive variance changes the output: the test above is not vacuous.
  changed = layer(x, valid, tf.fill([batch, length], 5.0), 0.1)[0]
  assert np.max(np.abs(changed.numpy() - ours.numpy())) > 1e-3


def test_zero_noise_dpformer_equals_vanilla_model():
  config = SeqRecConfig(num_items=9, max_len=5, dim=8, dropout=0.0)
  items = np.array([[0, 1, 2, 3, 2], [4, 5, 6, 7, 8]], np.int32)
  dpformer = SeqRecModel(config)
  vanilla = SeqRecModel(SeqRecConfig(num_items=9, max_len=5, dim=8, dropout=0.0,
                                     reattention=ReAttentionConfig(enabled=False)))
  dpformer({"items": items})
  vanilla({"items": items})
  vanilla.set_weights(dpformer.get_weights())
  dpformer.set_error_model(np.full(10, 0.3), noise_multiplier=0.0, l2_norm_clip=1.0,
                           batch_size=4, num_examples=10)
  np.testing.assert_allclose(dpformer({"items": items}).flat_values.numpy(),
                             vanilla({"items": items}).flat_values.numpy(), atol=1e-6)
  dpformer.set_error_model(np.full(10, 0.3), noise_multiplier=5.0, l2_norm_clip=1.0,
                           batch_size=4, num_examples=10)
  assert np.max(np.abs(dpformer({"items": items}).flat_values.numpy()
                       - vanilla({"items": items}).flat_values.numpy())) > 1e-4


def test_linear_variance_matches_monte_carlo():
  rng = np.random.default_rng(1)
  d_in, d_out, samples = 5, 3, 200_000
  mean_x = rng.normal(size=d_in)
  var_x = rng.uniform(0.1, 0.5, size=d_in)
  kernel = rng.normal(size=(d_in, d_out))
  bias = rng.normal(size=d_out)
  var_w = 0.05
  x = mean_x + np.sqrt(var_x) * rng.normal(size=(samples, d_in))
  w = kernel + np.sqrt(var_w) * rng.normal(size=(samples, d_in, d_out))
  b = bias + np.sqrt(var_w) * rng.normal(size=(samples, d_out))
  y = np.einsum("sk,skj->sj", x, w) + b
  analytic = variance_lib.linear_output_variance(
      tf.constant(mean_x[None], tf.float32), tf.constant(var_x[None], tf.float32),
      tf.constant(kernel, tf.float32), var_w, var_w).numpy()[0]
  np.testing.assert_allclose(y.var(axis=0), analytic, rtol=0.03)


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (0.0, 0.01), (0.5, 1.0), (-1.0, 0.7),
                                      (2.0, 0.3)])
def test_relu_variance_matches_monte_carlo(mean, std):
  rng = np.random.default_rng(2)
  z = np.maximum(mean + std * rng.normal(size=1_000_000), 0.0)
  first, var = variance_lib.relu_moments(tf.constant([mean]), tf.constant([std ** 2]))
  np.testing.assert_allclose(float(first[0]), z.mean(), rtol=0.01, atol=1e-4 * std)
  np.testing.assert_allclose(float(var[0]), z.var(), rtol=0.02)


def test_relu_variance_is_table3_not_printed_eq8():
  _, var = variance_lib.relu_moments(tf.constant([0.0]), tf.constant([1.0]))
  np.testing.assert_allclose(float(var[0]), 0.5 - 1 / (2 * np.pi), rtol=1e-5)  # 0.3408
  assert abs(float(var[0]) - 0.5) > 0.1  # printed Eq. 8 gives 0.5 at N(0, 1)


def test_effective_error_is_sigma_over_batch_times_frequency():
  frequencies = np.array([0.0, 0.5, 0.01, 0.0])
  var = variance_lib.item_error_variances(frequencies, 2.0, 1.0, 100, min_frequency=0.001)
  np.testing.assert_allclose(var.numpy(), [0.0, (2 / 50) ** 2, (2 / 1) ** 2, (2 / 0.1) ** 2],
                             rtol=1e-6)
