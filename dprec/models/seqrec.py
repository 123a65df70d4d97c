"""DPFormer: a causal transformer for next-item recommendation (Ding et al., "DPFormer: Learning
Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633, Ding et al. 2023).

Tied item embedding (input lookup and output scores over all M items), learned positions,
pre-LN encoder blocks with Re-Attention, softmax cross-entropy over all items. Sequences are
left-padded to `max_len` with item 0. One example is one user's whole sequence (user-level DP):
its loss sums the next-item losses at every position (`loss_positions="all"`, SASRec-style) or
takes the last one only (`"last"`, the paper's Eq. 12 formalism). Both are options because Ding et
al. 2023 §11 leaves the choice open.

With `SeqRecConfig.dp_forward` (Du et al., "DP-Forward: Fine-tuning and Inference on Language Models
with Differential Privacy in Forward Pass", arXiv:2309.06746, `dprec.layers.forward_noise`) the
model is split at a `ForwardNoise` layer: the encoder up to the noised representation is the user's
side, the scoring against the item table (plus a per-item bias, the service's popularity prior) the
service's, trained with ordinary (non-private) steps; only the last position is scored, since every
earlier label is an item of the input sequence.

Training is `DPModel`'s step (shared with the CTR models): per-example squared norms without
per-example gradients come from dprec's layer registry functions for the Dense/LayerNorm
sublayers, dprec's positional rule (`seqrec_layer_registry`) and, through the
`extra_squared_norms` hook, Phantom Clipping for the tied embedding (Ding et al. 2023).
"""
import dataclasses
import math
from typing import Optional

import numpy as np
import tensorflow as tf

from dprec.clipping import layer_norms
from dprec.clipping.phantom import (scored_positions, tied_embedding_clipped_gradients_fn,
                                    tied_embedding_clipped_loss_fn, tied_embedding_norm_fn)
from dprec.layers import variance as variance_lib
from dprec.layers.forward_noise import DPForwardConfig
from dprec.layers.positional import PositionalEmbedding, positional_embedding_computation
from dprec.layers.reattention import ReAttentionConfig
from dprec.layers.tied_embedding import TiedItemEmbedding
from dprec.layers.transformer import TransformerBlock
from dprec.models.logit_prior import TrainingPriorConfig, recent_pair_scores
from dprec.models.dp_model import DPModel, ExtraNorms


@dataclasses.dataclass(frozen=True)
class SeqRecConfig:
  """Architecture of the sequential recommender (defaults: the paper's Amazon setting).

  By default only the positions from each sequence's first item on are scored (same loss, ~7×
  fewer logits on Amazon). `score_padding=True` (with `loss_positions="all"`) scores all L
  positions, padding included: fixed shapes, as `tf.vectorized_map` needs.

  `item_norm_share` F: the item table is its own clipping group with F of C² (the rest of the
  model 1 − F; `ExtraNorms.norm_share`), so it gets a set share of each user's norm.
  `item_table_rows` R: the table has R rows (a DP-FEST vocabulary, `set_item_vocabulary`: items
  map to rows, some sharing one) instead of one per item; inputs stay item ids, labels and
  logits are rows, `score_items` still scores all M items.
  `popularity_weights`: the table is reparameterised row by row, E[j] = w_j·Ẽ[j] with Ẽ trained
  and w fixed (`set_popularity_weights`, from a DP count), so a row's share of each user's
  clipped norm, and its update, scale with w_j while the noise per row of Ẽ stays σC.
  `frozen_items`: the item table and a per-item logit offset b are fixed (`set_frozen_items`,
  from released statistics): logits h·E[1:]ᵀ + b, the table gets no gradient, norm or noise,
  and only the blocks, positions and norms are trained.
  `training_prior` (with `frozen_items` and `loss_positions="last"`): the logits are
  (h·W)·E[1:]ᵀ + b + w·prior, the item-to-item score of the input's recent items through the
  released pairs (`set_training_prior`; `dprec.models.logit_prior`), with W a d×d projection
  initialised to 0: the untrained model ranks by b + w·prior exactly and the blocks learn its
  residual. W is a registry Dense layer (its per-example norm is the registry's).
  """
  num_items: int
  max_len: int = 50
  dim: int = 64
  num_blocks: int = 2
  num_heads: int = 1
  ffn_dim: int = 64
  dropout: float = 0.5
  activation: str = "relu"
  tied: bool = True
  item_rank: Optional[int] = None
  item_norm_share: Optional[float] = None
  item_table_rows: Optional[int] = None
  popularity_weights: bool = False
  frozen_items: bool = False
  training_prior: Optional[TrainingPriorConfig] = None
  loss_positions: str = "all"
  score_padding: bool = False
  reattention: ReAttentionConfig = ReAttentionConfig()
  dp_forward: Optional[DPForwardConfig] = None

  def __post_init__(self):
    if self.num_items < 1 or self.max_len < 2:
      raise ValueError(f"need num_items >= 1 and max_len >= 2, got {self.num_items}, "
                       f"{self.max_len}")
    if self.loss_positions not in ("all", "last"):
      raise ValueError(f"loss_positions must be 'all' or 'last', got {self.loss_positions!r}")
    if self.dp_forward is not None and self.loss_positions != "last":
      raise ValueError("DP-Forward needs loss_positions='last': the labels of earlier positions "
                       "are the input items themselves and would reveal the sequence")
    if self.item_rank is not None:
      if not 1 <= self.item_rank <= self.dim:
        raise ValueError(f"item_rank must be in [1, dim={self.dim}], got {self.item_rank}")
      if self.dp_forward is not None:
        raise ValueError("item_rank does not combine with DP-Forward (its noise is on the "
                         "d-wide representation the service scores)")
    if self.item_norm_share is not None and not 0 < self.item_norm_share < 1:
      raise ValueError(f"item_norm_share must be in (0, 1), got {self.item_norm_share}")
    if self.item_table_rows is not None:
      if not 1 <= self.item_table_rows <= self.num_items:
        raise ValueError(f"item_table_rows must be in [1, num_items={self.num_items}], got "
                         f"{self.item_table_rows}")
      if self.dp_forward is not None:
        raise ValueError("item_table_rows does not combine with DP-Forward")
    if self.popularity_weights and self.dp_forward is not None:
      raise ValueError("popularity_weights does not combine with DP-Forward")
    if self.frozen_items and (not self.tied or self.dp_forward is not None
                              or self.item_rank is not None or self.item_norm_share is not None
                              or self.item_table_rows is not None or self.popularity_weights):
      raise ValueError("frozen_items needs a tied table with a row per item: it does not "
                       "combine with untied, DP-Forward, item_rank, item_norm_share, "
                       "item_table_rows or popularity_weights")
    if self.training_prior is not None and not (self.frozen_items
                                                and self.loss_positions == "last"):
      raise ValueError("training_prior needs frozen_items and loss_positions='last' (the prior "
                       "scores the next item after the whole input)")

  @property
  def table_rows(self):
    """Non-padding rows of the item table: one per item unless a vocabulary is set."""
    return self.item_table_rows or self.num_items


def seqrec_layer_registry():
  """dprec's layer registry plus the learned positional embedding."""
  registry = layer_norms.make_layer_registry()
  registry.insert(PositionalEmbedding, positional_embedding_computation)
  return registry


class NextItemLoss(tf.keras.losses.Loss):
  """Per-example Σ over positions with a target (label > 0) of the softmax cross-entropy over
  all M items (Eq. 13). Logits are ragged [B, (T_i), M]: row i scores the last T_i positions of
  labels [B, L] (left padding), so labels before an example's first item are not scored."""

  def __init__(self, name="next_item_loss", **kwargs):
    super().__init__(name=name, **kwargs)

  def call(self, y_true, y_pred):
    labels = tf.cast(y_true, tf.int32)
    length = y_pred.uniform_row_length
    if length is not None:  # fixed shapes, no boolean mask (tf.vectorized_map can batch it)
      length = tf.cast(length, tf.int32)
      targets = tf.reshape(labels[:, tf.shape(labels)[1] - length:], [-1])
      per_example = lambda losses: tf.reduce_sum(tf.reshape(losses, [-1, length]), axis=1)
    else:
      targets = tf.boolean_mask(labels, scored_positions(y_pred.row_lengths(),
                                                         tf.shape(labels)[1]))
      per_example = lambda losses: tf.reduce_sum(y_pred.with_flat_values(losses), axis=1)
    # targets [P] are in the packed-row order of the logits.
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.maximum(targets - 1, 0), logits=y_pred.flat_values)
    return per_example(tf.where(targets > 0, losses, 0.0))


class SeqRecModel(DPModel):
  """Inputs `{"items": int [B, L]}` (left-padded, 0 = padding); outputs ragged logits over the M
  items, [B, (T_i), M] for the last T_i positions (`forward`). Labels: next items [B, L].

  Trained by `DPModel`'s step: the Dense/LayerNorm/positional norms come from the layer registry,
  the tied embedding's Phantom norm from `extra_squared_norms`.
  """

  def __init__(self, config, forward_noise_generator=None, **kwargs):
    """`forward_noise_generator`: the secret `tf.random.Generator` of DP-Forward's noise
    (default: seeded from the OS)."""
    super().__init__(**kwargs)
    self.config = config
    self.forward_noise = None
    if config.dp_forward is not None:
      self.forward_noise = config.dp_forward.make_layer(forward_noise_generator)
    noise_in_block = self._noise_at("attention")
    self.item_embedding = TiedItemEmbedding(config.table_rows, config.item_rank or config.dim,
                                            config.tied, name="item_embedding")
    if config.frozen_items:
      self.item_embedding.trainable = False
      self.item_logit_offset = tf.Variable(tf.zeros([config.num_items]), trainable=False,
                                           name="item_logit_offset")
    self.output_projection = None
    if config.training_prior is not None:
      self.output_projection = tf.keras.layers.Dense(
          config.dim, use_bias=False, kernel_initializer="zeros", name="output_projection")
      slots = config.training_prior.items + 1
      self.prior_slot = tf.Variable(tf.zeros([config.num_items + 1], tf.int32), trainable=False,
                                    name="prior_slot")
      self.prior_pairs = tf.Variable(tf.zeros([slots, slots]), trainable=False,
                                     name="prior_pairs")
    self.item_projections = None
    if config.item_rank is not None:
      self.item_projections = (
          tf.keras.layers.Dense(config.dim, use_bias=False, name="item_up"),      # P_in
          tf.keras.layers.Dense(config.item_rank, use_bias=False, name="item_down"))  # P_out
    self.positions = PositionalEmbedding(config.max_len, config.dim, name="positions")
    self.input_dropout = tf.keras.layers.Dropout(config.dropout)
    self.blocks = [TransformerBlock(config.num_heads, config.ffn_dim, config.dropout,
                                    config.activation, config.reattention,
                                    attention_noise=self.forward_noise if noise_in_block and i == 0
                                    else None, name=f"block_{i}")
                   for i in range(config.num_blocks)]
    self.final_norm = tf.keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")
    if self.forward_noise is not None and not self.forward_noise.user_gradients:
      # The user's side before the noise gets no gradient: fixed (the tied table still learns
      # from the service's scores).
      self.positions.trainable = False
      if self._noise_at("output"):
        for layer in self.blocks + [self.final_norm]:
          layer.trainable = False
    if self.forward_noise is not None:
      # The service's own popularity prior: a bias per item, learned from the labels it receives.
      self.item_bias = tf.Variable(tf.zeros([config.num_items]), name="item_bias")
    self.item_variance = tf.Variable(tf.zeros([config.table_rows + 1]), trainable=False,
                                     name="item_variance")
    if config.item_table_rows is not None:  # items beyond R share row R until set
      self.item_row_of = tf.Variable(tf.minimum(tf.range(config.num_items + 1), config.table_rows),
                                     trainable=False, name="item_row_of")
      self.item_log_share = tf.Variable(tf.zeros([config.num_items + 1]), trainable=False,
                                        name="item_log_share")
    if config.popularity_weights:  # w_j of row j (row 0, padding, unused)
      self.item_row_weight = tf.Variable(tf.ones([config.table_rows + 1]), trainable=False,
                                         name="item_row_weight")
    self.weight_variance = tf.Variable(0.0, trainable=False, name="weight_variance")
    object.__setattr__(self, "layer_registry", seqrec_layer_registry())
    object.__setattr__(self, "_last_forward", {})

  def _noise_at(self, position):
    return self.config.dp_forward is not None and self.config.dp_forward.position == position

  def compile(self, optimizer="adam", loss=None, metrics=None, **kwargs):
    """As `DPModel.compile`, with `NextItemLoss` as the default loss."""
    super().compile(optimizer=optimizer, loss=loss or NextItemLoss(), metrics=metrics, **kwargs)

  def set_item_vocabulary(self, vocabulary):
    """Maps items to table rows (`dprec.sparse.fest.SharedRowVocabulary` with
    `config.item_table_rows` rows; DP or public, as it is stored in every checkpoint)."""
    if vocabulary.num_rows != self.config.item_table_rows:
      raise ValueError(f"the vocabulary has {vocabulary.num_rows} rows, the model "
                       f"{self.config.item_table_rows}")
    self.item_row_of.assign(np.asarray(vocabulary.row_of, np.int32))
    self.item_log_share.assign(np.asarray(vocabulary.log_share, np.float32))

  def set_popularity_weights(self, weights, keep_effective_table=True):
    """Sets w [R + 1] of `popularity_weights` (`item_frequencies.popularity_weights`: DP or
    public, stored in every checkpoint). `keep_effective_table`: divide the rows of Ẽ by w, so
    E = w·Ẽ is the table the model had (its initialisation unchanged)."""
    weights = np.asarray(weights, np.float32)
    if weights.shape != (self.config.table_rows + 1,) or not (weights > 0).all():
      raise ValueError(f"need {self.config.table_rows + 1} positive row weights, got shape "
                       f"{weights.shape}")
    self.item_row_weight.assign(weights)
    if keep_effective_table:
      for table in self.item_embedding.trainable_weights:  # the input (and untied output) rows
        table.assign(table / weights[-table.shape[0]:, None])

  def set_frozen_items(self, rows, offset):
    """Sets `frozen_items`' table E = `rows` [M + 1, d] and logit offset b = `offset` [M]
    (released values or functions of them only: they are in every checkpoint)."""
    self.item_embedding.embeddings.assign(np.asarray(rows, np.float32))
    self.item_logit_offset.assign(np.asarray(offset, np.float32))

  def set_training_prior(self, slot, packed):
    """Sets `training_prior`'s released pairs, packed (`logit_prior.packed_pairs`; released
    values only: they are in every checkpoint)."""
    self.prior_slot.assign(np.asarray(slot, np.int32))
    self.prior_pairs.assign(np.asarray(packed, np.float32))

  def _row_weights(self, rows):
    """w of table rows `rows`."""
    return tf.gather(self.item_row_weight, rows)

  def rows_of(self, items):
    """Table rows of item ids (0 stays 0); the identity without a vocabulary."""
    if self.config.item_table_rows is None:
      return tf.convert_to_tensor(items)
    return tf.gather(self.item_row_of, tf.cast(items, tf.int32))

  def set_error_model(self, frequencies, noise_multiplier, l2_norm_clip, batch_size,
                      num_examples, scale=1.0):
    """Re-Attention's effective errors (Eq. 5): σ_dp·C/(B·p_i) per item row, σ_dp·C/B for weights.

    `frequencies` p_i (length M+1, p_0 unused) are stored, through the variances, in the model and
    every checkpoint, so they must be public or DP (Remark A.2 assumes them public; `train seqrec`
    takes a public file or `dprec.privacy.user_histogram`'s DP histogram), never exact counts of
    the training data. p_i is clamped to 1/N so unseen items get a large finite variance.
    σ_dp = 0 gives plain attention. With a vocabulary, a row's p is the sum over its items
    (at most 1; set the vocabulary first).
    """
    frequencies = np.asarray(frequencies, np.float64)
    if self.config.item_table_rows is not None:
      frequencies = np.minimum(1.0, np.bincount(self.item_row_of.numpy(), weights=frequencies,
                                                minlength=self.config.table_rows + 1))
    variances = variance_lib.item_error_variances(
        frequencies.astype(np.float32), noise_multiplier, l2_norm_clip, batch_size,
        1.0 / num_examples, scale)
    if self.config.popularity_weights:  # noise on Ẽ[j] reaches E[j] = w_j·Ẽ[j] times w_j
      variances = variances * self.item_row_weight.numpy() ** 2
    self.item_variance.assign(variances)
    self.weight_variance.assign(
        scale * variance_lib.effective_error(noise_multiplier, l2_norm_clip, batch_size) ** 2)

  def forward(self, items, training=False, last_only=False, return_weights=False):
    """Returns (logits, hidden, lookup, scores[, attention weights per block]). Logits are
    ragged [B, (T_i), M] for the last T_i positions: T_i = 1 (`loss_positions="last"`, and
    `last_only` for evaluation), L (`score_padding`) or the positions from example i's first
    item on; `hidden` [P, d] (or [P, r], projected by P_out) holds the packed hidden states they
    score (P = Σ T_i); `lookup` is Ẽ[rows] and `scores` [P, M] = hidden·Ẽ[1:]ᵀ, both before
    the popularity weights (Phantom's inputs). `items` are item ids; logits and `lookup` are
    over table rows."""
    items = self.rows_of(items)
    valid = items > 0
    mask = tf.cast(valid, tf.float32)[..., None]
    lookup = self.item_embedding(items)
    embedded = lookup
    if self.config.popularity_weights:
      embedded = lookup * self._row_weights(items)[..., None]
    if self.item_projections is not None:
      embedded = self.item_projections[0](embedded)
    x = self.input_dropout((embedded + self.positions(embedded)) * mask, training=training)
    variance = None
    if self.config.reattention.enabled:
      # Item rows and the positional rows (σ_dp/B: every sequence uses every position) add up.
      variance = (tf.gather(self.item_variance, items) * self._item_variance_scale()
                  + self.weight_variance) * mask[..., 0]
    weights = []
    for block in self.blocks:
      outputs = block(x, valid, variance, self.weight_variance, training=training,
                      return_weights=return_weights)
      if block.attention_noise is not None:  # the service's side: no mask (length private)
        valid, mask = tf.ones_like(valid), tf.ones_like(mask)
      x, variance = outputs[0] * mask, outputs[1]
      weights.extend(outputs[2:])
    hidden = self.final_norm(x)
    if self.item_projections is not None:  # before packing: the Dense norm is per example
      hidden = self.item_projections[1](hidden)
    if self.output_projection is not None:
      hidden = self.output_projection(hidden)
    if last_only or self.config.loss_positions == "last":
      hidden, row_length = hidden[:, -1], 1
      if self._noise_at("output"):
        hidden = self.forward_noise(hidden, training=training)
    elif self.config.score_padding:
      hidden, row_length = tf.reshape(hidden, [-1, hidden.shape[-1]]), tf.shape(items)[1]
    else:
      row_length = None
      row_lengths = tf.reduce_sum(tf.cast(tf.cumsum(tf.cast(valid, tf.int32), axis=1) > 0,
                                          tf.int32), axis=1)
      hidden = tf.boolean_mask(hidden, scored_positions(row_lengths, tf.shape(items)[1]))
    scores = self.item_embedding.scores(hidden)
    weighted = scores
    if self.config.popularity_weights:
      weighted = scores * self._row_weights(tf.range(1, self.config.table_rows + 1))
    if self.forward_noise is not None:
      weighted += self.item_bias
    if self.config.frozen_items:
      weighted += self.item_logit_offset
    if self.config.training_prior is not None:  # row_length 1: the next item after `items`
      weighted += self.config.training_prior.weight * recent_pair_scores(
          items, self.prior_slot, self.prior_pairs, self.config.training_prior)
    if row_length is None:
      logits = tf.RaggedTensor.from_row_lengths(weighted, row_lengths, validate=False)
    else:
      logits = tf.RaggedTensor.from_uniform_row_length(weighted, row_length, validate=False)
    outputs = (logits, hidden, lookup, scores)
    return outputs + (weights,) if return_weights else outputs

  def _item_variance_scale(self):
    """Noise of variance v per coordinate of an item row reaches e_s = A[s]·P_in with variance
    v·‖P_in‖²_F/d per coordinate on average (1 without the low-rank table; P_in's own noise is
    left out, as for the other weights)."""
    if self.item_projections is None:
      return 1.0
    kernel = tf.stop_gradient(self.item_projections[0].kernel)
    return tf.reduce_sum(tf.square(kernel)) / self.config.dim

  def call(self, inputs, training=False):
    items = inputs["items"]
    logits, hidden, lookup, scores = self.forward(items, training=training)
    self._last_forward.update(rows=self.rows_of(items), hidden=hidden, lookup=lookup,
                              logits=logits, scores=scores)
    return logits

  def extra_squared_norms(self):
    """Phantom norms of the tied (or untied) item embedding from the step's forward pass, and
    the clipped sum book-kept from the same gradients (no second softmax backward pass); with
    `item_norm_share`, the table is its own clipping group, book-kept directly. Phantom sees
    the trained table Ẽ: the raw lookup Ẽ[rows] and the scores H·Ẽ[1:]ᵀ, before the popularity
    weights, whose gradients carry w (Eq. 16 then gives ‖∂L_i/∂Ẽ‖² exactly). A frozen table
    has none: the registry's layers are all that is trained."""
    if self.config.frozen_items:
      return []
    last = self._last_forward
    logits, hidden, rows = last["logits"], last["hidden"], last["rows"]
    row_lengths = logits.row_lengths()
    return [ExtraNorms(
        self.item_embedding.trainable_weights, [last["lookup"], last["scores"], hidden],
        tied_embedding_norm_fn(rows, hidden, row_lengths, self.config.tied),
        tied_embedding_clipped_loss_fn(hidden, row_lengths,
                                       lambda: self.item_embedding.output_table),
        norm_share=self.config.item_norm_share,
        clipped_gradient_fn=tied_embedding_clipped_gradients_fn(
            rows, hidden, row_lengths, self.config.table_rows, self.config.tied))]

  def score_items(self, items):
    """Scores [B, M] of items 1..M as the next item after each (left-padded) history; with a
    vocabulary, an item's row's score plus its log share of the row."""
    scores = self.forward(items, last_only=True)[0].flat_values
    if self.config.item_table_rows is None:
      return scores
    return (tf.gather(scores, self.item_row_of[1:] - 1, axis=1)
            + self.item_log_share[1:][None, :])


def warmup_linear_decay(peak_learning_rate, total_steps, warmup_fraction=0.2):
  """The paper's schedule (Ding et al. 2023): linear warm-up over 20% of training, then linear
  decay."""
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
