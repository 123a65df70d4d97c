"""Small models and batches shared by the DP-core tests."""
import types

import numpy as np
import pytest
import tensorflow as tf

from dprec.layers.embedding import DPEmbedding, DPMultiEmbedding
from dprec.models.dp_model import DPModel

VOCABS = {"a0": 7, "a1": 5, "m": 6}
DIMS = {"a0": 3, "a1": 2, "m": 3}


def build_model(seed=0, hidden=5):
  """Two single-valued tables, and one multi-valued table `m` called twice (sum combiner),
  then Dense → LayerNormalization → Dense: registry layers and DP embeddings together."""
  tf.keras.utils.set_random_seed(seed)
  cat = tf.keras.Input((2,), dtype=tf.int64, name="cat")
  multi = tf.keras.Input((4,), dtype=tf.int64, name="multi")
  extra = tf.keras.Input((2,), dtype=tf.int64, name="extra")
  shared = DPEmbedding(VOCABS["m"], DIMS["m"], combiner="sum", name="m",
                       embeddings_initializer=tf.keras.initializers.RandomUniform(
                           -1, 1, seed=seed + 1))
  h = tf.keras.layers.Concatenate()([
      DPMultiEmbedding([VOCABS["a0"], VOCABS["a1"]], [DIMS["a0"], DIMS["a1"]],
                       table_names=["a0", "a1"],
                       embeddings_initializer=tf.keras.initializers.RandomUniform(
                           -1, 1, seed=seed))(cat),
      shared(multi), shared(extra)])
  h = tf.keras.layers.Dense(hidden, activation="tanh")(h)
  h = tf.keras.layers.LayerNormalization()(h)
  out = tf.keras.layers.Dense(1)(h)
  return DPModel([cat, multi, extra], out)


def make_batch(n=12, seed=0):
  """Ids with repeats across and inside examples, pads (-1) in the multi-valued input."""
  rng = np.random.default_rng(seed)
  cat = np.stack([rng.integers(0, VOCABS["a0"], n), rng.integers(0, VOCABS["a1"], n)], axis=1)
  multi = rng.integers(0, VOCABS["m"], (n, 4))
  multi[:, 1] = multi[:, 0]  # a repeated id inside each example
  multi[rng.random((n, 4)) < 0.25] = -1
  extra = rng.integers(0, VOCABS["m"], (n, 2))
  x = [tf.constant(cat, tf.int64), tf.constant(multi, tf.int64), tf.constant(extra, tf.int64)]
  y = tf.constant(rng.integers(0, 2, (n, 1)), tf.float32)
  return x, y


LOSS = tf.keras.losses.BinaryCrossentropy(from_logits=True)


def brute_force_gradients(model, x, y, kept=None):
  """Per-example gradients by a loop over examples, dense, with embedding rows outside
  `kept` ({table name: row ids}) zeroed. Returns {variable name: [n, *shape]}."""
  tables = {t.embeddings.ref(): t.table_name for t in model.dp_tables}
  n = int(y.shape[0])
  result = {v.name: [] for v in model.trainable_variables}
  for i in range(n):
    with tf.GradientTape() as tape:
      inputs = [t[i:i + 1] for t in x]
      pred = model(inputs if len(inputs) > 1 else inputs[0], training=True)
      loss = tf.reduce_sum(model.per_example_loss(y[i:i + 1], pred))
    for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
      g = tf.convert_to_tensor(g).numpy() if g is not None else np.zeros(v.shape, np.float32)
      name = tables.get(v.ref())
      if name is not None and kept is not None:
        mask = np.zeros(v.shape[0], bool)
        mask[np.asarray(kept.get(name, []), dtype=np.int64)] = True
        g = g * mask[:, None]
      result[v.name].append(g)
  return {k: np.stack(v) for k, v in result.items()}


def squared_norms(per_example):
  return sum(np.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in per_example.values())


@pytest.fixture
def lib():
  """The helpers above (test modules cannot import conftest under importlib mode)."""
  return types.SimpleNamespace(
      build_model=build_model, make_batch=make_batch, loss=LOSS, vocabs=VOCABS, dims=DIMS,
      brute_force_gradients=brute_force_gradients, squared_norms=squared_norms)
