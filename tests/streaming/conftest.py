"""Fixtures of the streaming tests: the smallest `PeriodModel`, for fast tests of the trainer.

A logistic model with one scalar embedding per categorical feature, trained by DP-SGD (per-example
clip, Gaussian noise from a `tf.random.Generator` the trainer re-keys before every step, on touched
rows and the bias) with an Adagrad accumulator, so checkpoints must carry weights and optimizer
slots (and no generator state). A batch holding `UNIT_KEY` (a user-level plan's) is clipped per
unit: each unit's summed gradient to C.
"""
import sys

import numpy as np
import pytest
import tensorflow as tf

from dprec.privacy_unit import UNIT_KEY, USER_KEY
from dprec.training.period_model import PeriodModel
from dprec.training.stream_config import StreamConfig
from dprec.training.streaming import StreamingTrainer
from dprec.workflows.plan import plan_stream
from dprec.workflows.run import Run

FEATURES = 3


def make_days(days=4, rows=400, seed=0, new_ids_per_day=2):
  """Per-day arrays whose id universe grows by `new_ids_per_day` every day (new buckets)."""
  rng = np.random.default_rng(seed)
  out = []
  for day in range(days):
    vocab = 4 + new_ids_per_day * day
    ids = rng.integers(0, vocab, size=(rows, FEATURES)).astype(np.int32)
    ints = rng.normal(size=(rows, 2)).astype(np.float32)
    logit = (ids % 2).sum(axis=1) - 1.5 + ints[:, 0]
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int32)
    users = np.random.default_rng([seed, day]).integers(0, rows // 2, size=rows)
    out.append(({"cat_features": ids, "int_features": ints, "user_id": users}, labels))
  return out


class StandInModel(PeriodModel):
  """See the module docstring."""

  def __init__(self, noise_multiplier=0.5, clip=1.0, learning_rate=0.2, seed=0):
    self.noise_multiplier, self.clip, self.learning_rate = noise_multiplier, clip, learning_rate
    self.generator = tf.random.Generator.from_seed(seed)
    self.tables, self.slots = {}, {}
    self.dense = tf.Variable(tf.zeros([3]))  # two int weights and the bias
    self.dense_slot = tf.Variable(tf.fill([3], 0.1))
    self.selected = None

  def build(self, vocab_sizes):
    for name, size in vocab_sizes.items():
      old = self.tables.get(name)
      fresh = np.zeros(size, np.float32)
      slot = np.full(size, 0.1, np.float32)
      if old is not None:  # grow: keep learned rows and their accumulators
        fresh[:old.shape[0]] = old.numpy()
        slot[:old.shape[0]] = self.slots[name].numpy()
      self.tables[name] = tf.Variable(fresh)
      self.slots[name] = tf.Variable(slot)

  def trackables(self):
    out = {"dense": self.dense, "dense_slot": self.dense_slot}
    for name in self.tables:
      out[f"table_{name}"] = self.tables[name]
      out[f"slot_{name}"] = self.slots[name]
    return out

  def noise_generators(self):
    return {"noise": self.generator}

  def set_selected_rows(self, selected_rows):
    self.selected = selected_rows

  def _logits(self, features):
    ids = features["cat_features"]
    total = tf.add_n([tf.gather(self.tables[f"C{j + 1}"], ids[:, j]) for j in range(FEATURES)])
    return total + tf.linalg.matvec(features["int_features"], self.dense[:2]) + self.dense[2]

  def train_steps(self, batches, steps, on_step):
    for batch, labels in batches:
      on_step(self._step(batch, labels))

  def _step(self, batch, labels):
    features = {k: tf.constant(v) for k, v in batch.items()}
    logits = self._logits(features)
    residual = tf.sigmoid(logits) - tf.cast(labels, tf.float32)  # dL/dlogit per example
    ints = features["int_features"]
    norm = tf.abs(residual) * tf.sqrt(FEATURES + tf.reduce_sum(ints ** 2, axis=1) + 1.0)
    scale = residual * tf.minimum(1.0, self.clip / tf.maximum(norm, 1e-12))
    if UNIT_KEY in batch:
      scale = self._unit_scale(batch, residual.numpy())
    std = self.noise_multiplier * self.clip
    expected = max(1.0, float(len(labels)))
    touched_rows = 0
    for j in range(FEATURES):
      name = f"C{j + 1}"
      ids = batch["cat_features"][:, j]
      rows = np.unique(ids)
      if self.selected is not None:
        rows = np.intersect1d(rows, self.selected[name])
      grad = tf.math.unsorted_segment_sum(scale, ids, self.tables[name].shape[0])
      grad = tf.gather(grad, rows) + self.generator.normal([len(rows)]) * std
      self._apply(self.tables[name], self.slots[name], rows, grad / expected)
      touched_rows += len(rows)
    dense_grad = tf.concat([tf.linalg.matvec(ints, scale, transpose_a=True),
                            [tf.reduce_sum(scale)]], 0) + self.generator.normal([3]) * std
    self._apply(self.dense, self.dense_slot, np.arange(3), dense_grad / expected)
    vocab = sum(t.shape[0] for t in self.tables.values())
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        tf.cast(labels, tf.float32), logits))
    return {"loss": float(loss), "gradient_size_reduction": vocab / max(1, touched_rows)}

  def _unit_scale(self, batch, residual):
    """Each row's dL/dlogit weighted by its unit's clip factor min(1, C/‖Σ_{i∈u} g_i‖)."""
    unit = batch[UNIT_KEY]
    x = np.concatenate([np.eye(self.tables[f"C{j + 1}"].shape[0])[batch["cat_features"][:, j]]
                        for j in range(FEATURES)]
                       + [batch["int_features"], np.ones((len(unit), 1))], axis=1)
    sums = np.zeros((unit.max() + 1 if len(unit) else 0, x.shape[1]))
    np.add.at(sums, unit, residual[:, None] * x)
    factor = np.minimum(1.0, self.clip / np.maximum(np.linalg.norm(sums, axis=1), 1e-12))
    return tf.constant(residual * factor[unit], tf.float32)

  def _apply(self, variable, slot, rows, grad):
    accumulator = tf.gather(slot, rows) + grad ** 2
    slot.scatter_nd_update(rows[:, None], accumulator)
    variable.scatter_nd_sub(rows[:, None], self.learning_rate * grad / tf.sqrt(accumulator))

  def evaluate(self, features, labels):
    logits = self._logits({k: tf.constant(v) for k, v in features.items()})
    auc = tf.keras.metrics.AUC()
    auc.update_state(labels, tf.sigmoid(logits))
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        tf.cast(labels, tf.float32), logits))
    return {"auc": float(auc.result()), "loss": float(loss)}


def make_trainer(run_dir, epsilon_total, source, train_periods=None, checkpoint_every=7,
                 expected_periods=3, noise_multiplier=2.0, batch_size=40, accountant="pld",
                 ledger_path=None, insecure_noise_seed=None, diagnostics=False, idle_timeout=0.0,
                 log=None, examples_per_period=None, **plan_options):
  """A StreamingTrainer of the stand-in model over `source` (units per period: given, or day 0's
  rows, or its users at the user level); `plan_options`: more of `plan_stream`'s."""
  first = source.period(0)
  per_period = examples_per_period or (
      first.examples if plan_options.get("privacy_unit", "row") == "row"
      else np.unique(first.load()[0][USER_KEY]).size)
  plan = plan_stream(epsilon_total, 1e-5, expected_periods=expected_periods,
                     examples_per_period=per_period, batch_size=batch_size,
                     noise_multiplier=noise_multiplier, accountant=accountant, **plan_options)
  model = StandInModel(noise_multiplier=plan.noise_multiplier)
  config = StreamConfig(checkpoint_every=checkpoint_every, train_periods=train_periods,
                        diagnostics=diagnostics, idle_timeout=idle_timeout, poll_interval=0.01)
  run = Run("stream", run_dir, ledger_path, insecure_noise_seed)
  return StreamingTrainer(model, source, plan, config, run, log=log)


@pytest.fixture
def standin():
  """This module: `make_days`, `StandInModel`, `make_trainer`."""
  return sys.modules[__name__]
