"""Canary scores of a trained pCTR model (higher: more likely trained on), from the final model.

`alignment`: ⟨θ_T − θ_0, −∇L_i(θ_0)⟩/‖∇L_i(θ_0)‖ over canary i's own rows — how far its rows
moved in the direction its own gradient at initialisation points. `movement`: ‖θ_T − θ_0‖ over
its rows — how far they moved at all (a row no step updated, as a canary never sampled by a
sparse step, has not moved). A canary never kept scores exactly 0 on both. `loss`:
L_i(θ_0) − L_i(θ_T), the drop of its loss.
"""
import numpy as np
import tensorflow as tf

SCORES = ("alignment", "movement", "loss")


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
  """Records what the scores need at initialisation; `scores(model)` after training."""

  def __init__(self, model, canaries, scores=SCORES):
    unknown = set(scores) - set(SCORES)
    if unknown or not scores:
      raise ValueError(f"scores must be among {SCORES}, got {scores!r}")
    self.canaries, self.names = canaries, tuple(scores)
    self.initial_losses = canary_losses(model, canaries)
    self.initial_rows = canary_rows(model, canaries)
    self.gradients = canary_row_gradients(model, canaries)

  def scores(self, model) -> dict:
    """{score name: [m] scores}."""
    moved = [final - first for final, first in zip(canary_rows(model, self.canaries),
                                                    self.initial_rows)]
    dot = sum(np.sum(-m * g, axis=1, dtype=np.float64) for m, g in zip(moved, self.gradients))
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64), axis=1) for g in self.gradients))
    every = {"alignment": dot / np.maximum(norm, 1e-30),
             "movement": np.sqrt(sum(np.sum(np.square(m, dtype=np.float64), axis=1)
                                     for m in moved)),
             "loss": self.initial_losses - canary_losses(model, self.canaries)}
    return {name: every[name] for name in self.names}
