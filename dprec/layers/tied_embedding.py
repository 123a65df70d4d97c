"""Item embedding used both as the input lookup and as the output softmax layer (paper §3).

Tying (r = E·h over all items) is DPFormer's inductive bias; `tied=False` adds a separate output
table (the paper's "W/O PS" baseline). Row 0 is padding: it is never looked up by a real position
(the model masks padded positions) and is not a candidate in the scores, so the M scores are for
items 1..M and score column m is item m + 1.
"""
import tensorflow as tf


class TiedItemEmbedding(tf.keras.layers.Layer):
  """E ∈ R^{(M+1)×d}; `call(ids)` looks rows up, `scores(h)` returns h·E[1:]ᵀ (or h·E_outᵀ)."""

  def __init__(self, num_items, dim, tied=True, **kwargs):
    super().__init__(**kwargs)
    self.num_items, self.dim, self.tied = num_items, dim, tied

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        "embeddings", shape=(self.num_items + 1, self.dim),
        initializer=tf.keras.initializers.TruncatedNormal(stddev=0.02))
    if not self.tied:
      self.output_embeddings = self.add_weight(
          "output_embeddings", shape=(self.num_items, self.dim),
          initializer=tf.keras.initializers.TruncatedNormal(stddev=0.02))
    super().build(input_shape)

  def call(self, ids):
    return tf.gather(self.embeddings, ids)

  @property
  def output_table(self):
    """The M×d candidate matrix e_c (Ding et al., "DPFormer: Learning Differentially Private
    Transformer on Long-Tailed Data", arXiv:2305.17633 Eq. 12 corrected: r = e_c·h)."""
    return self.embeddings[1:] if self.tied else self.output_embeddings

  def scores(self, hidden):
    """Logits over all M items for every hidden vector: [..., d] → [..., M]."""
    # A 2-D matmul: einsum's gradient would broadcast the table to [..., M, d] first.
    flat = tf.reshape(hidden, [-1, self.dim])
    scores = tf.matmul(flat, self.output_table, transpose_b=True)
    return tf.reshape(scores, tf.concat([tf.shape(hidden)[:-1], [-1]], axis=0))
