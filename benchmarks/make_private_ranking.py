"""The TFRS basic-ranking tutorial model made private by `dprec.make_private`.

The tutorial's model (user and item embeddings of 32, Dense 256-64-1, MSE through
`tfrs.tasks.Ranking`, Adagrad 0.1, 5 epochs) on synthetic MovieLens-100K-shaped ratings
(`dprec.data.ratings`, random 80/20 split), non-private at the tutorial's B = 1024 (the issue's
setting) and private through the one call, each lever switchable to measure it alone. Prints
test RMSE per run and seed beside the training mean's. Model selection: none (fixed epochs).

    python benchmarks/make_private_ranking.py --epsilons 1 8 --seeds 0 1
    python benchmarks/make_private_ranking.py --epsilons 1 --clip 5 --no-bias-init   # one lever
"""
import argparse
import json
import time

import dprec  # Keras 2 before TensorFlow is used
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from dprec.data.ratings import split
from dprec.data.ratings import synthetic_ratings


class RankingModel(tf.keras.Model):
  """The tutorial's ranking model (integer ids instead of StringLookup)."""

  def __init__(self, num_users, num_items, dim=32):
    super().__init__()
    self.user_embeddings = tf.keras.Sequential([tf.keras.layers.Embedding(num_users + 1, dim)])
    self.item_embeddings = tf.keras.Sequential([tf.keras.layers.Embedding(num_items + 1, dim)])
    self.ratings = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                                        tf.keras.layers.Dense(64, activation="relu"),
                                        tf.keras.layers.Dense(1)])

  def call(self, inputs):
    user_id, item_id = inputs
    return self.ratings(tf.concat([self.user_embeddings(user_id),
                                   self.item_embeddings(item_id)], axis=1))


class MovielensModel(tfrs.models.Model):
  """The tutorial's TFRS model: compute_loss through a Ranking task."""

  def __init__(self, num_users, num_items):
    super().__init__()
    self.ranking_model = RankingModel(num_users, num_items)
    self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError(),
                                   metrics=[tf.keras.metrics.RootMeanSquaredError()])

  def call(self, features):
    return self.ranking_model((features["user_id"], features["item_id"]))

  def compute_loss(self, features, training=False):
    labels = features.pop("rating")
    return self.task(labels=labels, predictions=self(features))


def rmse(model, test):
  predictions = model.predict({"user_id": test["user_id"], "item_id": test["item_id"]},
                              batch_size=8192, verbose=0).reshape(-1)
  return float(np.sqrt(np.mean((predictions - test["rating"]) ** 2)))


def run(args, data, epsilon, seed):
  train, test = split(data, seed=seed)
  tf.keras.utils.set_random_seed(seed)
  model = MovielensModel(int(data["user_id"].max()) + 1, int(data["item_id"].max()) + 1)
  optimizer = {"adagrad": tf.keras.optimizers.Adagrad, "sgd": tf.keras.optimizers.SGD,
               "adam": tf.keras.optimizers.Adam}[args.optimizer](args.learning_rate)
  started = time.perf_counter()
  result = {"epsilon": epsilon, "seed": seed}
  if epsilon is None:
    model.compile(optimizer=optimizer)
    dataset = tf.data.Dataset.from_tensor_slices(train).shuffle(100_000, seed=seed).batch(1024)
    model.fit(dataset, epochs=args.epochs, verbose=0)
  else:
    options = dict(epsilon=epsilon, train_size=len(train["rating"]), epochs=args.epochs,
                   algorithm=args.algorithm, init_output_bias=not args.no_bias_init,
                   insecure_noise_seed=None)
    if args.recalibrate is not None:
      options["recalibrate"] = args.recalibrate
    for name in ("batch_size", "clip", "threshold", "target_quantile"):
      if getattr(args, name) is not None:
        options["l2_norm_clip" if name == "clip" else name] = getattr(args, name)
    model = dprec.make_private(model, **options)
    model.compile(optimizer=optimizer)
    if args.recalibrate is not False:  # the model before recalibration (trained at 95% of ε)
      recalibrate = model._recalibrate

      def measured_first(*inputs):
        result["test_rmse_before_recalibration"] = rmse(model, test)
        recalibrate(*inputs)

      model._recalibrate = measured_first
    history = model.fit(train, epochs=args.epochs, verbose=0)
    result.update(epsilon_spent=model.epsilon_spent,
                  sigma=model.privacy_plan.noise_multiplier,
                  batch_size=model.privacy_plan.batch_size,
                  train_rmse_nonprivate=history.history["root_mean_squared_error"][-1],
                  final_clip=history.history.get("l2_norm_clip", [None])[-1])
  result.update(test_rmse=rmse(model, test), seconds=time.perf_counter() - started,
                train_mean_rmse=float(np.sqrt(np.mean(
                    (test["rating"] - train["rating"].mean()) ** 2))))
  return result


def append_json(args, results):
  """Appends each result, with the command's arguments, as a JSON line to `args.json` (if set)."""
  if args.json:
    with open(args.json, "a", encoding="utf-8") as f:
      for result in results:
        f.write(json.dumps(dict(result, args=vars(args))) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 8.0])
  parser.add_argument("--no-nonprivate", action="store_true", help="skip the non-private run")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--optimizer", default="adagrad", choices=("adagrad", "sgd", "adam"))
  parser.add_argument("--learning-rate", type=float, default=0.1)
  parser.add_argument("--algorithm", default="auto")
  parser.add_argument("--batch-size", type=int, default=None)
  parser.add_argument("--clip", type=float, default=None)
  parser.add_argument("--threshold", type=float, default=None)
  parser.add_argument("--target-quantile", type=float, default=None,
                      help="adaptive clipping to this quantile of the norms (--clip: start)")
  parser.add_argument("--no-bias-init", action="store_true")
  parser.add_argument("--recalibrate", action=argparse.BooleanOptionalAction, default=None,
                      help="DP recalibration after training (default: make_private's, on)")
  parser.add_argument("--json", help="append each result as a JSON line here")
  args = parser.parse_args()
  data = synthetic_ratings()
  print("| ε | seed | B | σ | test RMSE | before recalibration | final C2 | training mean's "
        "| ε spent | s |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for seed in args.seeds:
    for epsilon in ([] if args.no_nonprivate else [None]) + list(args.epsilons):
      result = run(args, data, epsilon, seed)
      print(f"| {'non-private' if epsilon is None else f'{epsilon:g}'} | {seed} | "
            f"{result.get('batch_size', 1024)} | {result.get('sigma') or 0:.3f} | "
            f"{result['test_rmse']:.4f} | "
            f"{result.get('test_rmse_before_recalibration') or float('nan'):.4f} | "
            f"{result.get('final_clip') or float('nan'):.3g} | {result['train_mean_rmse']:.4f} | "
            f"{result.get('epsilon_spent') or 0:.3f} | {result['seconds']:.0f} |", flush=True)
      append_json(args, [result])


if __name__ == "__main__":
  main()
