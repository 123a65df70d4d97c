"""Causal multi-head self-attention with Re-Attention (paper §4, Eqs. 3–4, Algorithm 1).

If key K_j ~ N(k_j, σ_j²I), then E[exp(⟨q,K_j⟩)] = exp(⟨q,k_j⟩)·exp(C·σ_j²/2), C = ⟨q,q⟩: noisy
(rare) tokens attract attention they do not deserve (Eq. 4). Re-Attention divides each unnormalised
score by exp(C·σ_j²/2) and renormalises; we subtract C·σ_j²/2 from the logits before the softmax,
which is the same after renormalisation and safe for very large σ_j (Ding et al., "DPFormer:
Learning Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633 step 3).

Open choices of the paper (Ding et al. 2023), as options of `ReAttentionConfig`:
- `scale_by_dim`: logits are ⟨q,K⟩/√d_k, whose variance is ‖q‖²σ²/d_k, so C = ‖q‖²/d_k (default);
  False takes the paper's C = ⟨q,q⟩ literally.
- `stop_gradient`: no gradient flows through the correction (default). The variance itself is
  always treated as a tracked constant (error *tracking*); that also keeps the ghost norms of the
  projections exact, since no gradient reaches a kernel except through its output.
- `at_eval`: apply the correction at evaluation too (default; the released model still carries the
  DP noise).
Variances enter as one scalar per token (isometric noise); key variances are averaged over each
head's coordinates; the values' variance is propagated through the attention as Σ_j a_ij²·v_j.
"""
import dataclasses

import tensorflow as tf

from dprec.layers import variance as variance_lib


@dataclasses.dataclass(frozen=True)
class ReAttentionConfig:
  """Re-Attention switches; `enabled=False` is the paper's "vanilla" transformer."""
  enabled: bool = True
  scale_by_dim: bool = True
  stop_gradient: bool = True
  at_eval: bool = True


def reattention_logits(logits, query_sq_norm, key_variance):
  """logits − C_i·σ_j²/2: the log of S_ij / exp(C_i σ_j²/2) (Eq. 4 correction, §4.2).

  logits [..., Lq, Lk]; query_sq_norm C_i [..., Lq]; key_variance σ_j² [..., Lk].
  """
  return logits - 0.5 * query_sq_norm[..., :, None] * key_variance[..., None, :]


def causal_mask(valid):
  """[B, 1, L, L] bool: query i sees keys j ≤ i that are not padding (and always itself)."""
  length = tf.shape(valid)[1]
  lower = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
  allowed = tf.logical_and(lower[None], valid[:, None, :])
  allowed = tf.logical_or(allowed, tf.eye(length, dtype=tf.bool)[None])
  return allowed[:, None]


class ReAttention(tf.keras.layers.Layer):
  """Causal self-attention; with per-token variances it applies the Re-Attention correction."""

  def __init__(self, num_heads, key_dim, dropout=0.0, config=ReAttentionConfig(), **kwargs):
    super().__init__(**kwargs)
    self.num_heads, self.key_dim, self.config = num_heads, key_dim, config
    width = num_heads * key_dim
    self.query = tf.keras.layers.Dense(width, name="query")
    self.key = tf.keras.layers.Dense(width, name="key")
    self.value = tf.keras.layers.Dense(width, name="value")
    self.dropout = tf.keras.layers.Dropout(dropout)
    self._model_dim = None

  def build(self, input_shape):
    self._model_dim = input_shape[-1]
    self.output_dense = tf.keras.layers.Dense(self._model_dim, name="output")
    super().build(input_shape)

  def _split(self, x):
    batch, length = tf.shape(x)[0], tf.shape(x)[1]
    x = tf.reshape(x, [batch, length, self.num_heads, self.key_dim])
    return tf.transpose(x, [0, 2, 1, 3])

  def _merge(self, x):
    batch, length = tf.shape(x)[0], tf.shape(x)[2]
    return tf.reshape(tf.transpose(x, [0, 2, 1, 3]), [batch, length, self.num_heads * self.key_dim])

  def call(self, x, valid, variance=None, weight_variance=0.0, training=False,
           return_weights=False):
    """x [B, L, d]; valid [B, L] bool; variance [B, L] per-token error variance or None.

    Returns (output [B, L, d], output variance [B, L] or None[, attention weights [B, H, L, L]]).
    """
    q = self._split(self.query(x))
    k = self._split(self.key(x))
    v = self._split(self.value(x))
    logits = tf.einsum("bhid,bhjd->bhij", q, k) / tf.sqrt(float(self.key_dim))
    correct = (self.config.enabled and variance is not None
               and (training or self.config.at_eval))
    if correct:
      key_var = self._projected_variance(x, variance, self.key.kernel, weight_variance)
      key_var = tf.reduce_mean(key_var, axis=-1)  # [B, H, L]
      query_sq_norm = tf.reduce_sum(tf.square(q), axis=-1)
      if self.config.scale_by_dim:
        query_sq_norm /= float(self.key_dim)
      corrected = reattention_logits(logits, query_sq_norm, key_var)
      if self.config.stop_gradient:
        corrected = logits + tf.stop_gradient(corrected - logits)
      logits = corrected
    logits = tf.where(causal_mask(valid), logits, tf.cast(-1e9, logits.dtype))
    weights = tf.nn.softmax(logits, axis=-1)
    heads = tf.einsum("bhij,bhjd->bhid", self.dropout(weights, training=training), v)
    output = self.output_dense(self._merge(heads))
    out_var = None
    if self.config.enabled and variance is not None:
      value_var = self._projected_variance(x, variance, self.value.kernel, weight_variance)
      heads_var = variance_lib.attention_output_variance(tf.stop_gradient(weights), value_var)
      out_var = variance_lib.linear_output_variance(
          self._merge(tf.stop_gradient(heads)), self._merge(heads_var),
          tf.stop_gradient(self.output_dense.kernel), weight_variance, weight_variance)
      out_var = tf.reduce_mean(out_var, axis=-1)
    if return_weights:
      return output, out_var, weights
    return output, out_var

  def _projected_variance(self, x, variance, kernel, weight_variance):
    """Eq. 7 through a projection, per head coordinate: [B, H, L, d_k] (no gradient)."""
    var = variance_lib.linear_output_variance(
        tf.stop_gradient(x), tf.stop_gradient(variance)[..., None], tf.stop_gradient(kernel),
        weight_variance, weight_variance)
    return self._split(var)
