"""DPFormer: a causal transformer for next-item recommendation (seed 000, note 000 §5).

Tied item embedding (input lookup and output scores over all M items), learned positions,
pre-LN encoder blocks with Re-Attention, softmax cross-entropy over all items. Sequences are
left-padded to `max_len` with item 0. One example is one user's whole sequence (user-level DP):
its loss sums the next-item losses at every position (`loss_positions="all"`, SASRec-style) or
takes the last one only (`"last"`, the paper's Eq. 12 formalism). Both are options because note 000
§11 leaves the choice open.

`per_example_squared_norms` computes every example's squared gradient norm without per-example
gradients: tensorflow_privacy registry functions for the Dense/LayerNorm sublayers, dprec's
positional rule, and Phantom Clipping for the tied embedding, all from one forward and one
backward pass (note 000 §2.7).
"""
import dataclasses
import math

import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads
from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry as tfp_registry
from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import layer_normalization

from dprec.clipping.phantom import record_tied_embedding
from dprec.layers import variance as variance_lib
from dprec.layers.positional import PositionalEmbedding, positional_embedding_computation
from dprec.layers.reattention import ReAttentionConfig
from dprec.layers.recording import NormRecorder
from dprec.layers.tied_embedding import TiedItemEmbedding
from dprec.layers.transformer import TransformerBlock


@dataclasses.dataclass(frozen=True)
class SeqRecConfig:
  """Architecture of the sequential recommender (defaults: the paper's Amazon setting)."""
  num_items: int
  max_len: int = 50
  dim: int = 64
  num_blocks: int = 2
  num_heads: int = 1
  ffn_dim: int = 64
  dropout: float = 0.5
  activation: str = "relu"
  tied: bool = True
  loss_positions: str = "all"
  reattention: ReAttentionConfig = ReAttentionConfig()

  def __post_init__(self):
    if self.num_items < 1 or self.max_len < 2:
      raise ValueError(f"need num_items >= 1 and max_len >= 2, got {self.num_items}, "
                       f"{self.max_len}")
    if self.loss_positions not in ("all", "last"):
      raise ValueError(f"loss_positions must be 'all' or 'last', got {self.loss_positions!r}")


def seqrec_layer_registry():
  """tensorflow_privacy's default registry plus LayerNormalization and positional embeddings."""
  registry = tfp_registry.make_default_layer_registry()
  registry.insert(tf.keras.layers.LayerNormalization,
                  layer_normalization.layer_normalization_computation)
  registry.insert(PositionalEmbedding, positional_embedding_computation)
  return registry


class SeqRecModel(tf.keras.Model):
  """Inputs `{"items": int [B, L]}`; outputs logits over the M items, [B, L, M] or [B, 1, M].

  Labels are item ids [B, L] (the next item at every position, 0 = none); with
  `loss_positions="last"` only labels[:, -1] is used.
  """

  def __init__(self, config, **kwargs):
    super().__init__(**kwargs)
    self.config = config
    self.item_embedding = TiedItemEmbedding(config.num_items, config.dim, config.tied,
                                            name="item_embedding")
    self.positions = PositionalEmbedding(config.max_len, config.dim, name="positions")
    self.input_dropout = tf.keras.layers.Dropout(config.dropout)
    self.blocks = [TransformerBlock(config.num_heads, config.ffn_dim, config.dropout,
                                    config.activation, config.reattention, name=f"block_{i}")
                   for i in range(config.num_blocks)]
    self.final_norm = tf.keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")
    self.item_variance = tf.Variable(tf.zeros([config.num_items + 1]), trainable=False,
                                     name="item_variance")
    self.weight_variance = tf.Variable(0.0, trainable=False, name="weight_variance")
    self.registry = seqrec_layer_registry()

  def set_error_model(self, frequencies, noise_multiplier, l2_norm_clip, batch_size,
                      num_examples, scale=1.0):
    """Re-Attention's effective errors (Eq. 5): σ_dp·C/(B·p_i) per item row, σ_dp·C/B for weights.

    `frequencies` p_i (length M+1, p_0 unused) are treated as public (Remark A.2); p_i is clamped
    to 1/N so unseen items get a large finite variance. σ_dp = 0 gives plain attention.
    """
    self.item_variance.assign(variance_lib.item_error_variances(
        np.asarray(frequencies, np.float32), noise_multiplier, l2_norm_clip, batch_size,
        1.0 / num_examples, scale))
    self.weight_variance.assign(
        scale * variance_lib.effective_error(noise_multiplier, l2_norm_clip, batch_size) ** 2)

  def forward(self, items, training=False, recorder=None, return_weights=False):
    """Returns (logits, hidden, lookup[, attention weights per block])."""
    items = tf.convert_to_tensor(items)
    valid = items > 0
    mask = tf.cast(valid, tf.float32)[..., None]
    lookup = self.item_embedding(items)
    if recorder is None:
      positions = self.positions(lookup)
    else:
      positions = recorder(self.positions, lookup)
    x = self.input_dropout((lookup + positions) * mask, training=training)
    variance = None
    if self.config.reattention.enabled:
      # Item rows and the (σ_dp/B, every sequence uses every position) positional rows add up.
      variance = (tf.gather(self.item_variance, items) + self.weight_variance) * mask[..., 0]
    weights = []
    for block in self.blocks:
      outputs = block(x, valid, variance, self.weight_variance, training=training,
                      recorder=recorder, return_weights=return_weights)
      x, variance = outputs[0] * mask, outputs[1]
      weights.extend(outputs[2:])
    if recorder is None:
      hidden = self.final_norm(x)
    else:
      hidden = recorder(self.final_norm, x)
    if self.config.loss_positions == "last":
      hidden = hidden[:, -1:]
    logits = self.item_embedding.scores(hidden)
    outputs = (logits, hidden, lookup)
    return outputs + (weights,) if return_weights else outputs

  def call(self, inputs, training=False):
    return self.forward(inputs["items"], training=training)[0]

  def targets(self, labels):
    """Labels aligned with the logits: [B, L] or [B, 1]."""
    labels = tf.convert_to_tensor(labels)
    return labels[:, -1:] if self.config.loss_positions == "last" else labels

  def per_example_losses(self, labels, logits):
    """Σ over positions with a target of the softmax cross-entropy over all M items; [B]."""
    labels = self.targets(labels)
    has_target = labels > 0
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.maximum(labels - 1, 0), logits=logits)
    return tf.reduce_sum(tf.where(has_target, losses, 0.0), axis=-1)

  def per_example_squared_norms(self, inputs, labels, training=True):
    """Per-example squared gradient norms [B] of the per-example losses, with losses and logits.

    One forward pass recording norm functions (tensorflow_privacy registry + Phantom) and one
    backward pass to the recorded intermediates; no per-example gradient is formed.
    """
    tape, recorder, losses, logits = self._recorded_forward(inputs, labels, training)
    return self._squared_norms(tape, recorder, losses), losses, logits

  def clipped_gradient_sum(self, inputs, labels, clip_weights_fn, training=True):
    """Σ_i c_i·∇L_i over the trainable variables, c = clip_weights_fn(squared norms) [B].

    Norms and the weighted gradient come from the *same* forward pass, so dropout masks agree
    and each example's contribution is bounded exactly as its computed norm says.
    Returns (gradients, squared norms, losses).
    """
    tape, recorder, losses, _ = self._recorded_forward(inputs, labels, training)
    squared_norms = self._squared_norms(tape, recorder, losses)
    weights = tf.stop_gradient(clip_weights_fn(squared_norms))
    grads = tape.gradient(losses, self.trainable_variables, output_gradients=weights,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    del tape
    return grads, squared_norms, losses

  def _recorded_forward(self, inputs, labels, training):
    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    with tape:
      tape.watch(self.trainable_variables)
      recorder = NormRecorder(tape, clip_grads.get_registry_generator_fn(tape, self.registry))
      items = inputs["items"]
      logits, hidden, lookup = self.forward(items, training=training, recorder=recorder)
      record_tied_embedding(recorder, self.item_embedding, items, lookup, hidden, logits)
      losses = self.per_example_losses(labels, logits)
    return tape, recorder, losses, logits

  @staticmethod
  def _squared_norms(tape, recorder, losses):
    base_vars = [record[0] for record in recorder.records]
    grads = tape.gradient(losses, base_vars, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return tf.add_n([record[1](grad) for record, grad in zip(recorder.records, grads)])


def left_pad(sequence, length):
  """The last `length` items of `sequence`, left-padded with 0."""
  tail = list(sequence)[-length:]
  return [0] * (length - len(tail)) + tail


def training_examples(sequences, max_len):
  """One example per user: inputs s_1..s_{n−1} and next-item labels s_2..s_n (last max_len).

  Users with fewer than two items have no next-item target and are dropped.
  """
  kept = [seq for seq in sequences if len(seq) >= 2]
  items = np.array([left_pad(seq[:-1], max_len) for seq in kept], np.int32).reshape(-1, max_len)
  labels = np.array([left_pad(seq[1:], max_len) for seq in kept], np.int32).reshape(-1, max_len)
  return items, labels


def item_frequencies(sequences, num_items):
  """p_i = share of sequences containing item i (Claim 4.4: presence, not counts); [M + 1]."""
  counts = np.zeros(num_items + 1, np.float64)
  for seq in sequences:
    counts[np.unique(np.asarray(seq, np.int64))] += 1
  counts[0] = 0
  return counts / max(len(sequences), 1)


def warmup_linear_decay(peak_learning_rate, total_steps, warmup_fraction=0.2):
  """The paper's schedule (note 000 §7): linear warm-up over 20% of training, then linear decay."""
  warmup = max(1, int(math.ceil(warmup_fraction * total_steps)))
  return _WarmupLinearDecay(peak_learning_rate, warmup, max(total_steps, warmup + 1))


class _WarmupLinearDecay(tf.keras.optimizers.schedules.LearningRateSchedule):
  """lr(t) = peak·t/W for t ≤ W, then peak·(T − t)/(T − W)."""

  def __init__(self, peak, warmup_steps, total_steps):
    self.peak, self.warmup_steps, self.total_steps = peak, warmup_steps, total_steps

  def __call__(self, step):
    step = tf.cast(step, tf.float32) + 1.0
    up = step / self.warmup_steps
    down = (self.total_steps - step) / (self.total_steps - self.warmup_steps)
    return self.peak * tf.maximum(tf.minimum(up, down), 0.0)

  def get_config(self):
    return {"peak": self.peak, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}
