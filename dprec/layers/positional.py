"""Learned absolute positional embedding (paper A.9.2) and its per-example gradient norm."""
import tensorflow as tf


class PositionalEmbedding(tf.keras.layers.Layer):
  """Returns the learned position vectors P[0:L] for a [B, L, d] input, tiled over the batch."""

  def __init__(self, max_len, dim, **kwargs):
    super().__init__(**kwargs)
    self.max_len, self.dim = max_len, dim

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        "embeddings", shape=(self.max_len, self.dim),
        initializer=tf.keras.initializers.TruncatedNormal(stddev=0.02))
    super().build(input_shape)

  def call(self, x):
    batch, length = tf.shape(x)[0], tf.shape(x)[1]
    return tf.tile(self.embeddings[None, :length], [batch, 1, 1])


def positional_embedding_computation(layer_instance, input_args, input_kwargs, tape,
                                     num_microbatches=None):
  """Registry function (`dprec.clipping.layer_norms` convention) for `PositionalEmbedding`.

  Each row is used once per example, so the per-example gradient of P is the gradient of the
  example's loss w.r.t. its tiled copy (Ding et al., "DPFormer: Learning Differentially Private
  Transformer on Long-Tailed Data", arXiv:2305.17633 item 5): its squared norm is a plain sum.
  """
  del input_kwargs
  if num_microbatches is not None:
    raise NotImplementedError("microbatches are not supported for PositionalEmbedding")
  base_vars = layer_instance(*input_args)
  tape.watch(base_vars)

  def sqr_norm_fn(grads):
    return tf.reduce_sum(tf.square(grads), axis=[1, 2])

  return base_vars, base_vars, sqr_norm_fn
