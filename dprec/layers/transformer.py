"""Pre-LayerNorm causal transformer encoder block carrying Re-Attention's error variances.

x ← x + Dropout(ReAttention(LN(x))), x ← x + Dropout(W2·act(W1·LN(x))) (Vaswani et al. with
pre-LN, Ding et al., "DPFormer: Learning Differentially Private Transformer on Long-Tailed Data",
arXiv:2305.17633 leaves placement open). Alongside the activations it propagates one error variance
per token (Ding et al. 2023): LayerNorm scales it by γ²/Var_feat, Dense layers follow Eq. 7, the
activation the corrected Eq. 8, residual connections add variances. Dropout is treated as the
identity for variances (its inference behaviour).

With `attention_noise` (a `ForwardNoise` layer, DP-Forward after the first attention sub-layer,
Du et al., "DP-Forward: Fine-tuning and Inference on Language Models with Differential Privacy in
Forward Pass", arXiv:2309.06746) the residual is removed: x ← noise(Dropout(Attention(LN(x)))·mask),
so nothing after the noise re-reads x; without user gradients the attention sub-layer is the user's
fixed side.
"""
import tensorflow as tf

from dprec.layers import variance as variance_lib
from dprec.layers.reattention import ReAttention, ReAttentionConfig

_ACTIVATIONS = {"relu": tf.nn.relu, "gelu": tf.nn.gelu}


class TransformerBlock(tf.keras.layers.Layer):
  """One encoder block; `call` returns (outputs [B, L, d], variances [B, L] or None)."""

  def __init__(self, num_heads, ffn_dim, dropout=0.0, activation="relu",
               reattention=ReAttentionConfig(), attention_noise=None, **kwargs):
    super().__init__(**kwargs)
    self.attention_noise = attention_noise
    if activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    self.num_heads, self.ffn_dim, self.dropout_rate = num_heads, ffn_dim, dropout
    self.activation, self.reattention = activation, reattention

  def build(self, input_shape):
    dim = input_shape[-1]
    if dim % self.num_heads:
      raise ValueError(f"model dim {dim} is not divisible by {self.num_heads} heads")
    self.attention_norm = tf.keras.layers.LayerNormalization(epsilon=1e-6, name="attention_norm")
    self.attention = ReAttention(self.num_heads, dim // self.num_heads, self.dropout_rate,
                                 self.reattention, name="attention")
    self.ffn_norm = tf.keras.layers.LayerNormalization(epsilon=1e-6, name="ffn_norm")
    self.ffn_in = tf.keras.layers.Dense(self.ffn_dim, name="ffn_in")
    self.ffn_out = tf.keras.layers.Dense(dim, name="ffn_out")
    self.dropout = tf.keras.layers.Dropout(self.dropout_rate)
    if self.attention_noise is not None and not self.attention_noise.user_gradients:
      self.attention_norm.trainable = self.attention.trainable = False
    super().build(input_shape)

  def call(self, x, valid, variance=None, weight_variance=0.0, training=False,
           return_weights=False):
    h = self.attention_norm(x)
    attended = self.attention(
        h, valid, self._norm_variance(self.attention_norm, x, variance), weight_variance,
        training=training, return_weights=return_weights)
    if self.attention_noise is None:
      x = x + self.dropout(attended[0], training=training)
    else:
      masked = self.dropout(attended[0], training=training) * tf.cast(valid, x.dtype)[..., None]
      x = self.attention_noise(masked, training=training)
    if variance is not None and attended[1] is not None:
      variance = variance + attended[1]
    h = self.ffn_norm(x)
    pre = self.ffn_in(h)
    act = _ACTIVATIONS[self.activation](pre)
    out = self.ffn_out(self.dropout(act, training=training))
    if variance is not None and attended[1] is not None:
      variance = variance + self._ffn_variance(h, pre, act, variance, x, weight_variance)
    x = x + self.dropout(out, training=training)
    outputs = (x, variance)
    return outputs + (attended[2],) if return_weights else outputs

  def _norm_variance(self, norm, x, variance):
    """Per-token variance after LayerNorm, averaged over features (scalar per token)."""
    if variance is None or not self.reattention.enabled:
      return None
    per_feature = variance_lib.layer_norm_variance(
        tf.stop_gradient(x), tf.stop_gradient(variance)[..., None],
        tf.stop_gradient(norm.gamma), norm.epsilon)
    return tf.reduce_mean(per_feature, axis=-1)

  def _ffn_variance(self, h, pre, act, variance, x, weight_variance):
    """Eq. 7 → corrected Eq. 8 → Eq. 7 through the feed-forward network; [B, L]."""
    h, pre, act = tf.stop_gradient(h), tf.stop_gradient(pre), tf.stop_gradient(act)
    var_h = self._norm_variance(self.ffn_norm, x, variance)[..., None]
    var_pre = variance_lib.linear_output_variance(
        h, var_h, tf.stop_gradient(self.ffn_in.kernel), weight_variance, weight_variance)
    var_act = variance_lib.activation_variance(pre, var_pre, self.activation)
    var_out = variance_lib.linear_output_variance(
        act, var_act, tf.stop_gradient(self.ffn_out.kernel), weight_variance, weight_variance)
    return tf.reduce_mean(var_out, axis=-1)
