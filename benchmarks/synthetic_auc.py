"""How learnable is the synthetic Criteo click model? Test AUC of non-private baselines.

Generates `--rows` rows over `--days` days, builds the vocabulary from the training days, trains
a logistic regression (one weight per bucket + linear integers) and a small MLP on all days but
the last, and reports AUC on the last day, next to the oracle AUC of the generator's own click
probabilities on the same rows. Prints a table.

  .venv/bin/python benchmarks/synthetic_auc.py --rows 1000000 --days 4
"""
import argparse
import tempfile
import time

import numpy as np
from scipy import special, stats

from dprec.data import criteo, synthetic


def auc(labels, scores):
  """Exact ROC AUC (Mann-Whitney U with mid-ranks for ties)."""
  labels = np.asarray(labels).astype(bool)
  ranks = stats.rankdata(scores)
  positives = labels.sum()
  negatives = len(labels) - positives
  return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def build_model(sizes, hidden):
  """Logistic regression over one-hot buckets (hidden == 0) or an MLP over embeddings."""
  import tensorflow as tf
  int_features = tf.keras.Input([len(criteo.INTEGER_FEATURES)], name="int_features")
  cat_features = tf.keras.Input([len(criteo.CATEGORICAL_FEATURES)], name="cat_features",
                                dtype=tf.int32)
  columns = tf.unstack(cat_features, axis=1)
  if hidden:
    embedded = [tf.keras.layers.Embedding(size, max(2, int(2 * size**0.25)))(column)
                for size, column in zip(sizes, columns)]
    x = tf.keras.layers.Concatenate()(embedded + [int_features])
    for units in hidden:
      x = tf.keras.layers.Dense(units, activation="relu")(x)
    logit = tf.keras.layers.Dense(1)(x)
  else:
    weights = [tf.keras.layers.Embedding(size, 1)(column) for size, column in zip(sizes, columns)]
    logit = tf.keras.layers.Add()(weights + [tf.keras.layers.Dense(1)(int_features)])
  return tf.keras.Model({"int_features": int_features, "cat_features": cat_features}, logit)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=1_000_000)
  parser.add_argument("--days", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--vocab", default="table3")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--learning-rate", type=float, default=5e-3)
  args = parser.parse_args()
  import tensorflow as tf
  tf.keras.utils.set_random_seed(args.seed)
  with tempfile.TemporaryDirectory() as directory:
    summary = synthetic.generate_criteo(directory, args.rows, args.days, args.seed, args.vocab)
    files = criteo.criteo_day_files(directory)
    vocab = criteo.CriteoVocabulary.build(files[:-1], min_count=2)
    train, test = criteo.load_criteo(files[:-1], vocab), criteo.load_criteo(files[-1:], vocab)
  config = synthetic.CriteoSynthConfig(vocab=args.vocab)
  oracle = np.concatenate([special.expit(block["logit"]) for day, block in synthetic.criteo_blocks(
      args.rows, args.days, args.seed, config) if day == args.days - 1])
  rows = [("oracle (generator's click probability)", auc(test["label"], oracle), 0.0)]
  for name, hidden in (("logistic regression (one-hot buckets)", ()),
                       ("MLP 2x256 over embeddings", (256, 256))):
    model = build_model(vocab.sizes, hidden)
    model.compile(tf.keras.optimizers.Adam(args.learning_rate),
                  tf.keras.losses.BinaryCrossentropy(from_logits=True))
    start = time.perf_counter()
    model.fit({k: train[k] for k in ("int_features", "cat_features")}, train["label"],
              batch_size=1024, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - start
    scores = model.predict({k: test[k] for k in ("int_features", "cat_features")},
                           batch_size=8192, verbose=0)[:, 0]
    rows.append((name, auc(test["label"], scores), seconds))
  print(f"rows={args.rows} days={args.days} vocab={args.vocab} train=days 0..{args.days - 2} "
        f"({len(train['label'])} rows) test=day {args.days - 1} ({len(test['label'])} rows), "
        f"ctr={summary['ctr']:.3f}, top-1% buckets cover {summary['top1pct_bucket_share']:.1%}")
  print(f"| {'model':<40} | test AUC | train s |")
  print(f"|{'-' * 42}|----------|---------|")
  for name, value, seconds in rows:
    print(f"| {name:<40} | {value:8.4f} | {seconds:7.1f} |")


if __name__ == "__main__":
  main()
