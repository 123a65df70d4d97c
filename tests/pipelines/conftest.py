"""Shared fixtures of the Beam pipeline tests: Criteo line builder, runner options, preprocessed
rows for the batch jobs, a binomial goodness-of-fit check, tiny model."""
import numpy as np
import pytest

from dprec.data.criteo import CATEGORICAL_FEATURES

# Most tests use the in-process runner (fast start); one golden test uses two worker processes.
IN_PROCESS = ("--direct_num_workers=1", "--direct_running_mode=in_memory")


@pytest.fixture(scope="session")
def in_process():
  return list(IN_PROCESS)


@pytest.fixture(scope="session")
def preprocessed_rows(tmp_path_factory, in_process):
  """`preprocessed_rows(rows, split_bytes, users=None)`: the TFRecord files (several, in order)
  of `rows` synthetic Criteo rows (one day, seed 4; with `users` the rows of that many users,
  each carrying its `user_id`) written by the preprocessing job in process: the batch jobs'
  input."""
  from dprec.data import criteo_tfrecord
  from dprec.data import synthetic
  from pipelines import criteo

  def preprocess(rows, split_bytes, users=None):
    base = tmp_path_factory.mktemp("records")
    synthetic.generate_criteo(str(base / "tsv"), rows, days=1, seed=4, progress=False,
                              config=synthetic.CriteoSynthConfig(users=users) if users else None)
    criteo.run(criteo.CriteoJob(inputs=(str(base / "tsv"),), output=str(base / "out"),
                                split_bytes=split_bytes, user_column=bool(users)), in_process)
    return tuple(criteo_tfrecord.day_files(str(base / "out")))

  return preprocess


@pytest.fixture(scope="session")
def assert_binomial_fit():
  """`assert_binomial_fit(histogram, n, p)`: chi-square goodness of fit of a histogram of counts
  to Binomial(n, p), tail cells merged (p-value > 1e-3)."""
  from scipy import stats

  def check(histogram, n, p):
    total = histogram.sum()
    expected = stats.binom.pmf(np.arange(len(histogram)), n, p) * total
    keep = expected >= 5
    observed = np.append(histogram[keep], total - histogram[keep].sum())
    expected = np.append(expected[keep], total - expected[keep].sum())
    chi2 = np.sum((observed - expected) ** 2 / expected)
    assert stats.chi2.sf(chi2, df=len(observed) - 1) > 1e-3, (observed, expected)

  return check


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
