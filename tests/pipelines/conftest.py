"""Shared fixtures of the Beam pipeline tests: Criteo line builder, runner options, tiny model."""
import numpy as np
import pytest

from dprec.data.criteo import CATEGORICAL_FEATURES

# Most tests use the in-process runner (fast start); one golden test uses two worker processes.
IN_PROCESS = ("--direct_num_workers=1", "--direct_running_mode=in_memory")


@pytest.fixture
def in_process():
  return list(IN_PROCESS)


def _criteo_line(label="0", ints=None, cats=None):
  """A Criteo TSV line: `ints` {index 0..12: text}, `cats` {"C1": text}; others empty."""
  int_fields = [""] * 13
  for index, text in (ints or {}).items():
    int_fields[index] = str(text)
  cat_fields = [(cats or {}).get(name, "") for name in CATEGORICAL_FEATURES]
  return "\t".join([str(label)] + int_fields + cat_fields)


@pytest.fixture
def criteo_line():
  return _criteo_line


def _train_tiny_model(dataset, vocab_sizes, epochs=3):
  """Fits a logistic model on (int features, summed embeddings); returns the loss per epoch."""
  import tensorflow as tf
  tf.keras.utils.set_random_seed(0)
  ints = tf.keras.Input([13], name="int_features")
  cats = tf.keras.Input([26], name="cat_features", dtype=tf.int32)
  offsets = tf.constant(np.concatenate([[0], np.cumsum(vocab_sizes)[:-1]]), tf.int32)
  embedded = tf.keras.layers.Embedding(int(sum(vocab_sizes)), 4)(cats + offsets)
  hidden = tf.keras.layers.Concatenate()([ints, tf.keras.layers.Flatten()(embedded)])
  model = tf.keras.Model([ints, cats], tf.keras.layers.Dense(1)(hidden))
  model.compile(tf.keras.optimizers.Adam(0.05),
                tf.keras.losses.BinaryCrossentropy(from_logits=True))
  rows = dataset.map(lambda b: ((b["int_features"], b["cat_features"]), b["label"]))
  return model.fit(rows, epochs=epochs, verbose=0).history["loss"]


@pytest.fixture
def train_tiny_model():
  return _train_tiny_model
