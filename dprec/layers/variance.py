"""Error-variance propagation for Re-Attention (Ding et al., "DPFormer: Learning Differentially
Private Transformer on Long-Tailed Data", arXiv:2305.17633, paper Eqs. 5, 7, 8).

DP noise makes every weight a Gaussian around its released value. Re-Attention tracks, for every
token, the variance that this noise induces in the activations, by moment matching layer by layer:
linear layers by Eq. 7, ReLU by the *corrected* Eq. 8 (the printed form subtracts c² instead of
E[Z]², Ding et al. 2023), GELU by the ReLU rule (Remark A.5). Means are the actual forward
activations and the released weights (the paper's "noisy parameter as an estimate of its mean").
Everything here depends only on one example, the frequencies p_i and the weights: no batch
statistics, so the forward pass adds no privacy cost of its own (Ding et al. 2023). The p_i do:
exact counts of the training users would be released with the model, so they must be public or DP
themselves (a public file, or `dprec.privacy.user_histogram`'s DP histogram charged to the run's
ledger).
"""
import math

import tensorflow as tf


def effective_error(noise_multiplier, l2_norm_clip, batch_size, frequencies=None):
  """Eq. 5 / Claims 4.3–4.4: σ_eff = σ_dp·C/B for block weights, σ_dp·C/(B·p_i) for item rows.

  `noise_multiplier` σ_dp and clip C give the std of the *averaged* gradient noise (the paper uses
  C = 1). With `frequencies` (p_i = share of training sequences containing item i) it returns one
  σ per item; p_i must be positive (callers clamp rare/unseen items, see `item_error_variances`).
  """
  base = noise_multiplier * l2_norm_clip / batch_size
  if frequencies is None:
    return base
  return base / tf.convert_to_tensor(frequencies, tf.float32)


def item_error_variances(frequencies, noise_multiplier, l2_norm_clip, batch_size, min_frequency,
                         scale=1.0):
  """Per-item variance σ_eff² of embedding rows (index 0 = padding gets 0).

  p_i is clamped to `min_frequency` (e.g. 1/N) so items never seen in training get a large but
  finite variance. `scale` multiplies σ_eff² (Ding et al. 2023, Eq. 5 leaves the parameter-space
  scale open; 1.0 takes σ_eff literally, as the paper does).
  """
  p = tf.maximum(tf.convert_to_tensor(frequencies, tf.float32), min_frequency)
  var = scale * tf.square(effective_error(noise_multiplier, l2_norm_clip, batch_size, p))
  return tf.concat([tf.zeros([1]), var[1:]], axis=0)


def linear_output_variance(mean_x, var_x, kernel, var_w, var_b=0.0):
  """Eq. 7 for y = xW + b with independent x_k ~ (mean_x, var_x), W_kj ~ (kernel, var_w).

  Var[y_j] = Σ_k var_x_k·var_w + var_x_k·W_kj² + var_w·mean_x_k², plus var_b for the bias.
  Shapes: mean_x, var_x [..., d_in]; kernel [d_in, d_out]; returns [..., d_out].
  """
  var_x = tf.broadcast_to(var_x, tf.shape(mean_x))
  d_out = tf.shape(kernel)[1]
  from_inputs = tf.einsum("...k,kj->...j", var_x, var_w + tf.square(kernel))
  from_weights = var_w * tf.reduce_sum(tf.square(mean_x), axis=-1, keepdims=True)
  return from_inputs + from_weights + var_b + tf.zeros([d_out])


def relu_moments(mean, var):
  """Corrected Eq. 8 (Ding et al. 2023): moments of ReLU(X) for X ~ N(mean, var).

  E[Z] = μΦ(a) + sφ(a), E[Z²] = (μ² + s²)Φ(a) + μsφ(a), a = μ/s; returns (E[Z], Var[Z]).
  For N(0, 1) the variance is ½ − 1/(2π) ≈ 0.3408 (Table 3's analytic column).
  """
  var = tf.broadcast_to(tf.maximum(var, 0.0), tf.shape(mean))
  s = tf.sqrt(var)
  safe_s = tf.where(s > 0, s, tf.ones_like(s))
  a = mean / safe_s
  cdf = 0.5 * (1.0 + tf.math.erf(a / math.sqrt(2.0)))
  pdf = tf.exp(-0.5 * tf.square(a)) / math.sqrt(2.0 * math.pi)
  first = mean * cdf + s * pdf
  second = (tf.square(mean) + var) * cdf + mean * s * pdf
  relu = tf.nn.relu(mean)
  first = tf.where(s > 0, first, relu)
  variance = tf.where(s > 0, tf.maximum(second - tf.square(first), 0.0), tf.zeros_like(mean))
  return first, variance


def activation_variance(pre_activation, var, activation):
  """Variance after the FFN activation: ReLU exactly, GELU by the ReLU rule (Remark A.5)."""
  if activation not in ("relu", "gelu"):
    raise ValueError(f"no variance rule for activation {activation!r} (use relu or gelu)")
  return relu_moments(pre_activation, var)[1]


def layer_norm_variance(x, var_x, gamma, epsilon):
  """LayerNorm as a per-token affine map: Var scales by γ²/(Var_feat[x] + ε) (Ding et al. 2023)."""
  _, feature_var = tf.nn.moments(x, axes=[-1], keepdims=True)
  return var_x * tf.square(gamma) / (feature_var + epsilon)


def attention_output_variance(weights, var_values):
  """Σ_j a_ij²·v_j: attention weights treated as constants (Ding et al. 2023 step 4).

  weights [B, H, L, L]; var_values [B, H, L, D]; returns [B, H, L, D].
  """
  return tf.einsum("bhij,bhjd->bhid", tf.square(weights), var_values)
