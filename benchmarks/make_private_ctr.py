"""`dprec.make_private` on a pCTR model with large tables, as a user writes it: one plain Keras
`Embedding` per Criteo categorical column, the 13 integer features, a Dense tower, binary
cross-entropy from logits, `make_private(model, epsilon=, train_size=, epochs=)` and `fit`.

Tables this large (Σ V·d above `private_options.AUTO_DENSE_LIMIT`) make `algorithm="auto"`
DP-AdaFEST, so this measures the library path's sparse defaults (r = σ1/σ2, τ) beside DP-SGD,
the non-private model and the base rate: validation and test AUC and log loss, the gradient-size
reduction Keras logs, ε spent, wall time (non-private: the same model, plain Keras, B = 1,024;
`--optimizer`, `--learning-rate`, `--batch-size`, `--epochs`: one lever each). Each
configuration is a fresh model and a fresh secret noise key; `--draws` repeats the private ones.
`--keras keras3` writes the model with `import keras` instead of tf.keras, and `--crosses K` puts
K KerasRS `FeatureCross` layers (DCN-v2: Wang et al. 2021, "DCN V2: Improved deep & cross
network", arXiv:2008.13535) between the embeddings and the tower (Keras 3 only): the KerasRS
ranking model of `benchmarks/make_private_keras3.py`.

    dprec synth criteo --rows 800000 --days 2 --seed 0 --output DATA
    python benchmarks/make_private_ctr.py --data DATA --configs nonprivate default r2_tau7 dp_sgd
    python benchmarks/make_private_ctr.py --data DATA --keras keras3 --crosses 2 \
        --configs nonprivate default
"""
import argparse
import json
import time

import dprec
import numpy as np
import tensorflow as tf

from dprec.data import ctr_data
from dprec.models import ctr
from dprec.optimizers import sparse as sparse_optimizers
from dprec.workflows import private_options

# make_private's options of each configuration (None: the non-private model, plain Keras).
CONFIGS = {
    "nonprivate": None,
    "default": {},
    "r5_tau5": dict(algorithm="dp_adafest", ratio=5.0, threshold=5.0),
    "r2_tau7": dict(algorithm="dp_adafest", ratio=2.0, threshold=7.0),
    "dp_sgd": dict(algorithm="dp_sgd"),
}


def features(rows):
  """The model's inputs: `int_features` and one id column `C1`..`C26` per table."""
  inputs = {ctr.INT_FEATURES: rows[ctr.INT_FEATURES]}
  inputs.update({f"C{i + 1}": rows[ctr.CAT_FEATURES][:, i] for i in
                 range(rows[ctr.CAT_FEATURES].shape[1])})
  return inputs


def build(vocab_sizes, hidden_units, keras_api=tf.keras, crosses=0):
  """A plain Keras pCTR model (of `keras_api`: tf.keras or Keras 3): per-table embeddings (width
  `ctr.embedding_dim`) and the integer features, `crosses` KerasRS FeatureCross layers on them,
  a ReLU tower and one logit."""
  layers = keras_api.layers
  inputs = {ctr.INT_FEATURES: keras_api.Input((ctr.CTRConfig.num_integer_features,),
                                              name=ctr.INT_FEATURES)}
  inputs.update({f"C{i + 1}": keras_api.Input((), dtype="int64", name=f"C{i + 1}")
                 for i in range(len(vocab_sizes))})
  embedded = [layers.Embedding(size, ctr.embedding_dim(size - 1), name=f"table_{i + 1}")(
      inputs[f"C{i + 1}"]) for i, size in enumerate(vocab_sizes)]
  hidden = x0 = layers.Concatenate()(embedded + [inputs[ctr.INT_FEATURES]])
  if crosses:
    import keras_rs
    for _ in range(crosses):
      hidden = keras_rs.layers.FeatureCross()(x0, hidden)
  for units in hidden_units:
    hidden = layers.Dense(units, activation="relu")(hidden)
  return keras_api.Model(inputs, layers.Dense(1)(hidden))


def _log_loss(labels, probabilities):
  p = np.clip(probabilities, 1e-7, 1 - 1e-7)
  return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def _auc(labels, scores):
  metric = tf.keras.metrics.AUC(num_thresholds=10000)
  metric.update_state(labels, scores)
  return float(metric.result())


def evaluate(model, rows):
  probabilities = tf.sigmoid(model.predict(features(rows), batch_size=8192, verbose=0)
                             ).numpy().ravel()
  return _auc(rows["label"], probabilities), _log_loss(rows["label"], probabilities)


def run(name, options, data, args, seed):
  keras_api = _keras(args.keras)
  keras_api.utils.set_random_seed(seed)
  model = build(data.vocab_sizes, args.hidden_units, keras_api, args.crosses)
  n = len(data.train["label"])
  if options is not None:
    options = dict(options, **({"batch_size": args.batch_size} if args.batch_size else {}))
    model = dprec.make_private(model, epsilon=args.epsilon, train_size=n, epochs=args.epochs,
                               **options)
  optimizer = (sparse_optimizers.AdamBC(args.learning_rate) if args.optimizer == "adambc"
               else keras_api.optimizers.Adam(args.learning_rate))
  model.compile(optimizer=optimizer,
                loss=keras_api.losses.BinaryCrossentropy(from_logits=True))
  start = time.perf_counter()
  history = model.fit(features(data.train), data.train["label"].astype(np.float32),
                      epochs=int(np.ceil(args.epochs)),
                      batch_size=None if options is not None else 1024, verbose=0)
  seconds = time.perf_counter() - start
  record = dict(config=name, draw=seed, keras=args.keras, crosses=args.crosses,
                optimizer=args.optimizer,
                learning_rate=args.learning_rate, epochs=args.epochs,
                hidden_units=args.hidden_units,
                epsilon=args.epsilon if options is not None else None,
                seconds=round(seconds, 1))
  if options is not None:
    plan = model.privacy_plan
    record.update(algorithm=model.dp_optimizer.config.__class__.__name__,
                  batch_size=plan.batch_size, steps=plan.steps,
                  epsilon_spent=round(float(model.epsilon_spent), 4),
                  gradient_size_reduction=round(float(
                      history.history.get("gradient_size_reduction", [1.0])[-1]), 1))
  for split, rows in (("validation", data.validation), ("test", data.eval)):
    record[f"{split}_auc"], record[f"{split}_log_loss"] = evaluate(model, rows)
  return record


def _keras(name):
  """tf.keras, or Keras 3 (`import keras`, imported only when asked for)."""
  if name == "tf_keras":
    return tf.keras
  import keras
  return keras


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--data", required=True, help="Criteo TSV day files (last day = test)")
  parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
  parser.add_argument("--epsilon", type=float, default=1.0)
  parser.add_argument("--epochs", type=float, default=1.0)
  parser.add_argument("--optimizer", choices=("adam", "adambc"), default="adam",
                      help="Keras' Adam, or dprec's DP-AdamBC (Tang et al. 2024, "
                           "arXiv:2411.04205)")
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--batch-size", type=int,
                      help="make_private's B (default: its own, about 150 steps an epoch)")
  parser.add_argument("--draws", type=int, default=1, help="runs of each private configuration")
  parser.add_argument("--validation-rows", type=int, default=50_000,
                      help="held out of the end of the training days")
  parser.add_argument("--hidden-units", type=int, nargs="+", default=[256, 256])
  parser.add_argument("--keras", choices=("tf_keras", "keras3"), default="tf_keras",
                      help="the Keras the model is written with")
  parser.add_argument("--crosses", type=int, default=0,
                      help="KerasRS FeatureCross layers before the tower (--keras keras3)")
  parser.add_argument("--jsonl", help="append each run's record here")
  args = parser.parse_args(argv)
  if args.crosses and args.keras != "keras3":
    parser.error("--crosses needs --keras keras3 (KerasRS is Keras 3 only)")
  data = ctr_data.hold_out_validation(ctr_data.load_data(args.data), args.validation_rows)
  rate = float(np.mean(data.train["label"]))
  base = {split: ctr.log_loss_of_constant(rows["label"], rate)
          for split, rows in (("validation", data.validation), ("test", data.eval))}
  print(json.dumps(dict(config="base rate", train_rows=len(data.train["label"]),
                        table_floats=sum(s * ctr.embedding_dim(s - 1) for s in data.vocab_sizes),
                        auto_dense_limit=private_options.AUTO_DENSE_LIMIT,
                        validation_log_loss=base["validation"], test_log_loss=base["test"])),
        flush=True)
  for name in args.configs:
    for draw in range(1 if CONFIGS[name] is None else args.draws):
      record = run(name, CONFIGS[name], data, args, draw)
      print(json.dumps(record), flush=True)
      if args.jsonl:
        with open(args.jsonl, "a", encoding="utf-8") as stream:
          stream.write(json.dumps(record) + "\n")


if __name__ == "__main__":
  main()
