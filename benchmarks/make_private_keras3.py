"""The TFRS basic-ranking tutorial's model written in Keras 3 and in tf-keras, each made private
by the same `dprec.make_private` call.

The tutorial's ranking model (user and item embeddings of 32, Dense 256-64-1, MSE, Adagrad 0.1,
5 epochs) as one functional model built from either Keras' layers, on synthetic
MovieLens-100K-shaped ratings (`dprec.data.ratings`, random 80/20 split): test RMSE of both
Kerases, private at each ε and non-private (B = 1,024, the tutorial's), beside the training
mean's. Step time: the median epoch's seconds per step (epochs 2 to 5, after tracing), both
Kerases run one after the other in this process, their ratio Keras 3 ÷ tf-keras; the load average
is printed before and after (the machine is shared).

    python benchmarks/make_private_keras3.py --epsilons 1 8 --seeds 0 1
"""
import argparse
import os
import statistics
import time

import dprec  # Keras 2 as tf.keras before TensorFlow is used
import keras
import numpy as np
import tensorflow as tf

from dprec.data.ratings import split
from dprec.data.ratings import synthetic_ratings
from make_private_ranking import append_json
from make_private_ranking import rmse

KERASES = {"tf_keras": tf.keras, "keras3": keras}


def ranking_model(keras_api, num_users, num_items, dim=32):
  """The tutorial's ranking model (integer ids instead of StringLookup) in `keras_api`."""
  layers = keras_api.layers
  user = keras_api.Input((), dtype="int32", name="user_id")
  item = keras_api.Input((), dtype="int32", name="item_id")
  joined = layers.Concatenate()([layers.Embedding(num_users + 1, dim)(user),
                                 layers.Embedding(num_items + 1, dim)(item)])
  hidden = layers.Dense(64, activation="relu")(layers.Dense(256, activation="relu")(joined))
  return keras_api.Model({"user_id": user, "item_id": item}, layers.Dense(1)(hidden))


def epoch_timer(keras_api):
  """A callback of `keras_api` holding each epoch's wall-clock seconds."""

  class EpochTimer(keras_api.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.seconds, self._start = [], None

    def on_epoch_begin(self, epoch, logs=None):
      self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
      self.seconds.append(time.perf_counter() - self._start)

  return EpochTimer()


def run(name, args, data, epsilon, seed):
  keras_api = KERASES[name]
  train, test = split(data, seed=seed)
  features = {"user_id": train["user_id"], "item_id": train["item_id"]}
  keras_api.utils.set_random_seed(seed)
  model = ranking_model(keras_api, int(data["user_id"].max()) + 1,
                        int(data["item_id"].max()) + 1)
  timer = epoch_timer(keras_api)
  result = {"keras": name, "epsilon": epsilon, "seed": seed}
  if epsilon is None:
    batch_size = 1024
    model.compile(optimizer=keras_api.optimizers.Adagrad(args.learning_rate), loss="mse")
  else:
    model = dprec.make_private(model, epsilon=epsilon, train_size=len(train["rating"]),
                               epochs=args.epochs)
    model.compile(optimizer=keras_api.optimizers.Adagrad(args.learning_rate), loss="mse")
    batch_size = None
    result.update(batch_size=model.privacy_plan.batch_size,
                  sigma=model.privacy_plan.noise_multiplier)
  model.fit(features, train["rating"], batch_size=batch_size, epochs=args.epochs,
            callbacks=[timer], verbose=0)
  steps = int(np.ceil(len(train["rating"]) / result.get("batch_size", 1024)))
  result.update(test_rmse=rmse(model, test),
                step_ms=1e3 * statistics.median(timer.seconds[1:]) / steps,
                train_mean_rmse=float(np.sqrt(np.mean(
                    (test["rating"] - train["rating"].mean()) ** 2))))
  if epsilon is not None:
    result["epsilon_spent"] = model.epsilon_spent
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 8.0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--learning-rate", type=float, default=0.1)
  parser.add_argument("--json", help="append each result as a JSON line here")
  args = parser.parse_args()
  data = synthetic_ratings()
  print(f"load average before: {os.getloadavg()}", flush=True)
  print("| ε | seed | B | σ | tf-keras RMSE | Keras 3 RMSE | Δ | training mean's | "
        "tf-keras ms/step | Keras 3 ms/step | Keras 3 ÷ tf-keras |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for seed in args.seeds:
    for epsilon in [None] + list(args.epsilons):
      ours, theirs = (run(name, args, data, epsilon, seed) for name in ("tf_keras", "keras3"))
      print(f"| {'non-private' if epsilon is None else f'{epsilon:g}'} | {seed} | "
            f"{ours.get('batch_size', 1024)} | {ours.get('sigma', 0):.3f} | "
            f"{ours['test_rmse']:.4f} | {theirs['test_rmse']:.4f} | "
            f"{theirs['test_rmse'] - ours['test_rmse']:+.4f} | {ours['train_mean_rmse']:.4f} | "
            f"{ours['step_ms']:.2f} | {theirs['step_ms']:.2f} | "
            f"{theirs['step_ms'] / ours['step_ms']:.2f} |", flush=True)
      append_json(args, [ours, theirs])
  print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
  main()
