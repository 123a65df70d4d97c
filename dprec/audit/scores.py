"""Canary scores of a trained pCTR model (higher: more likely trained on).

`alignment` (white box): ⟨θ_T − θ_0, −∇L_i(θ_0)⟩/‖∇L_i(θ_0)‖ over canary i's own rows — how far
its rows moved in the direction its own gradient at initialisation points. A canary never kept
scores exactly 0. `loss` (black box): L_i(θ_0) − L_i(θ_T), the drop of its loss.
"""
import numpy as np
import tensorflow as tf

SCORES = ("alignment", "loss")


def canary_losses(model, canaries):
  logits = model(canaries.features, training=False)
  labels = tf.reshape(tf.constant(canaries.labels), [-1, 1])
  return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)[:, 0].numpy()


def canary_rows(model, canaries):
  """Each table's canary rows [m, d_f], as a list over tables."""
  return [tf.gather(table.embeddings, canaries.rows[:, f]).numpy()
          for f, table in enumerate(model.dp_tables)]


def canary_row_gradients(model, canaries):
  """∇L_i on canary i's rows, per table [m, d_f]: the rows are disjoint, so one backward pass of
  Σ_i L_i gives every canary's own gradient."""
  tables = [table.embeddings for table in model.dp_tables]
  with tf.GradientTape() as tape:
    logits = model(canaries.features, training=False)
    labels = tf.reshape(tf.constant(canaries.labels), [-1, 1])
    loss = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
  gradients = []
  for f, gradient in enumerate(tape.gradient(loss, tables)):
    first, count = int(canaries.rows[0, f]), len(canaries.rows)  # rows first .. first + m - 1
    if isinstance(gradient, tf.IndexedSlices):
      indices, values = gradient.indices.numpy().astype(np.int64), gradient.values.numpy()
    else:
      values = gradient.numpy()
      indices = np.arange(len(values), dtype=np.int64)
    own = indices >= first
    rows = np.zeros([count, values.shape[1]], np.float64)
    np.add.at(rows, indices[own] - first, values[own])
    gradients.append(rows)
  return gradients


class CanaryScorer:
  """Records what a score needs at initialisation; `scores(model)` after training."""

  def __init__(self, model, canaries, score="alignment"):
    if score not in SCORES:
      raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    self.canaries, self.score = canaries, score
    if score == "loss":
      self.initial_losses = canary_losses(model, canaries)
    else:
      self.initial_rows = canary_rows(model, canaries)
      self.gradients = canary_row_gradients(model, canaries)

  def scores(self, model) -> np.ndarray:
    if self.score == "loss":
      return self.initial_losses - canary_losses(model, self.canaries)
    moved = [final - first for final, first in zip(canary_rows(model, self.canaries),
                                                    self.initial_rows)]
    dot = sum(np.sum(-m * g, axis=1, dtype=np.float64) for m, g in zip(moved, self.gradients))
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64), axis=1) for g in self.gradients))
    return dot / np.maximum(norm, 1e-30)
