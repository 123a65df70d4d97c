"""The vectorised Example encoder equals tf.train.Example row by row; reader errors are clear."""
import json

import numpy as np
import pytest
import tensorflow as tf

from dprec.data import criteo_tfrecord
from dprec.errors import DprecError


def test_batch_encoding_equals_per_row_examples():
  rng = np.random.default_rng(0)
  n = 50
  batch = {"label": rng.integers(0, 2, n).astype(np.int32),
           "int_features": rng.random((n, 13)).astype(np.float32) * 10,
           "cat_features": rng.integers(0, 3_000_000, (n, 26)).astype(np.int32)}
  encoded = criteo_tfrecord.encode_examples(batch)
  for row in range(n):
    example = tf.train.Example(features=tf.train.Features(feature={
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[batch["label"][row]])),
        "int_features": tf.train.Feature(
            float_list=tf.train.FloatList(value=batch["int_features"][row])),
        "cat_features": tf.train.Feature(
            int64_list=tf.train.Int64List(value=batch["cat_features"][row]))}))
    parsed = tf.train.Example.FromString(encoded[row])
    assert parsed == example
  assert len(criteo_tfrecord.encode_examples({k: v[:0] for k, v in batch.items()})) == 0


def test_reader_errors_name_the_file(tmp_path):
  with pytest.raises(DprecError, match="no manifest; run `dprec preprocess criteo"):
    criteo_tfrecord.load_manifest(str(tmp_path))
  (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
  with pytest.raises(DprecError, match="manifest.json: format 'other'"):
    criteo_tfrecord.load_manifest(str(tmp_path))
