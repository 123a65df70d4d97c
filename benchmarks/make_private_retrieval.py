"""Private two-tower retrieval on Amazon Games through `dprec.make_private`.

Data: ../shared/data/amazon-video-games/Video.txt (SASRec format, `user item` lines in time
order). Leave-one-out as in DPFormer: each user's last item is the test target, the one before
the validation target, the rest are training examples (user, item). Every choice (epochs, K,
learning rate) is made on validation (`--splits valid`, the default); `--splits valid test`
also reports test, to be read only for the configuration validation chose. The model is
`dprec.models.retrieval.SampledTwoTower` (K negatives drawn
per example, logQ correction, a fixed log-popularity prior); the metrics rank each target
against all items (`dprec.models.ranking_metrics`), overall and per popularity bucket of the
target, beside most popular and the non-private model (exact training counts for its sampling
distribution and prior; the DP model uses make_private's DP item histogram). The unit protected
is one training interaction (example-level DP), NOT one user: a user with many interactions is
protected only as a group of that size (train seqrec protects users).

    python benchmarks/make_private_retrieval.py --epsilon 5 --epochs 1 --splits valid test
"""
import argparse
import dataclasses
import json
import math
import os
import time

import dprec  # Keras 2 before TensorFlow is used
import numpy as np
import tensorflow as tf

from dprec.models import ranking_metrics
from dprec.models import retrieval

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                    "amazon-video-games", "Video.txt")
MODELS = ("popular", "nonprivate", "dp")


def load(path):
  """{'train'|'valid'|'test': (users, items)} and M: items 1..M, leave-one-out (users with
  fewer than 3 items train on all of them)."""
  lines = np.loadtxt(path, dtype=np.int64)
  users, items = lines[:, 0], lines[:, 1]
  parts = {"train": ([], []), "valid": ([], []), "test": ([], [])}
  boundaries = np.flatnonzero(np.diff(users)) + 1
  for sequence_users, sequence in zip(np.split(users, boundaries), np.split(items, boundaries)):
    cut = len(sequence) - 2 if len(sequence) >= 3 else len(sequence)
    for name, rows in (("train", slice(0, cut)), ("valid", slice(cut, cut + 1)),
                       ("test", slice(cut + 1, cut + 2))):
      parts[name][0].append(sequence_users[rows])
      parts[name][1].append(sequence[rows])
  return ({name: (np.concatenate(u), np.concatenate(i)) for name, (u, i) in parts.items()},
          int(items.max()))


def evaluate(score_fn, users, items, buckets, batch=1024):
  ranks = []
  for start in range(0, len(users), batch):
    scores = np.asarray(score_fn(users[start:start + batch]))[:, 1:]  # items 1..M
    ranks.append(ranking_metrics.target_ranks(scores, items[start:start + batch] - 1).numpy())
  return ranking_metrics.summarize(np.concatenate(ranks), items, buckets)


def row(name, summary, seconds=None, epsilon=None):
  parts = [summary["hit_at_10"], summary["ndcg_at_10"]]
  for bucket in ranking_metrics.BUCKETS:
    parts += [summary["by_popularity"][bucket]["hit_at_10"],
              summary["by_popularity"][bucket]["ndcg_at_10"]]
  cells = " | ".join(f"{value:.4f}" for value in parts)
  return (f"| {name} | {cells} | {'' if epsilon is None else f'{epsilon:.3f}'} | "
          f"{'' if seconds is None else f'{seconds:.0f}'} |")


class _StepTimer(tf.keras.callbacks.Callback):
  """Prints the mean time of the steps after the first (the trace) every `every` steps."""

  def __init__(self, every=100):
    super().__init__()
    self.every, self.steps, self.start = every, 0, None

  def on_train_batch_end(self, batch, logs=None):
    self.steps += 1
    if self.steps == 1:
      self.start = time.perf_counter()
    elif self.steps % self.every == 0:
      print(f"  step {self.steps}: {(time.perf_counter() - self.start) / (self.steps - 1):.3f} "
            "s/step", flush=True)


class _EpochEvaluation(tf.keras.callbacks.Callback):
  """Prints the validation metrics after every epoch (choosing epochs)."""

  def __init__(self, evaluate_model):
    super().__init__()
    self.evaluate_model = evaluate_model

  def on_epoch_end(self, epoch, logs=None):
    summary = self.evaluate_model(self.model, ["valid"])["valid"]
    print(row(f"after epoch {epoch + 1} (valid)", summary), flush=True)


def train(args, private, num_users, num_items, train_u, train_i, counts, evaluate_model):
  tf.keras.utils.set_random_seed(args.seed)
  model = retrieval.SampledTwoTower(
      num_users, num_items + 1, args.dim, num_negatives=args.num_negatives,
      sampling_exponent=args.sampling_exponent, popularity_prior=not args.no_prior,
      seed=args.seed)
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  optimizer = tf.keras.optimizers.Adam(args.learning_rate)
  labels = retrieval.positive_labels(len(train_u))
  x = {retrieval.USER: train_u, retrieval.ITEM: train_i}
  callbacks = [_StepTimer()] + [_EpochEvaluation(evaluate_model)] * args.every_epoch
  if private:
    model = dprec.make_private(model, epsilon=args.epsilon, train_size=len(train_u),
                               epochs=args.epochs, l2_norm_clip=args.clip,
                               algorithm=args.algorithm)
    model.compile(optimizer=optimizer, loss=loss)
    if args.no_noise:  # a diagnostic: clipping alone, NOT private
      model.dp_optimizer.config = dataclasses.replace(model.dp_optimizer.config,
                                                      noise_multiplier=0.0)
    print(f"  DP plan: B = {model.privacy_plan.batch_size}, {model.privacy_plan.steps} steps, "
          f"σ = {model.privacy_plan.noise_multiplier:.3f}, "
          f"algorithm {model.dp_optimizer.config}", flush=True)
    history = model.fit(x, labels, epochs=math.ceil(args.epochs), verbose=0,
                        callbacks=callbacks).history
    print(f"  noised embedding-gradient coordinates per step {history['gradient_size'][-1]:.0f}"
          f" of {model.dense_embedding_size} (last epoch's mean)", flush=True)
  else:
    model.set_item_counts(counts)  # exact training counts: the non-private baseline
    model.compile(optimizer=optimizer, loss=loss)
    steps = math.ceil(len(train_u) / args.batch_size)
    dataset = tf.data.Dataset.from_tensor_slices((x, labels)).shuffle(
        len(train_u), seed=args.seed).batch(args.batch_size).repeat()
    model.fit(dataset, epochs=math.ceil(args.epochs),
              steps_per_epoch=math.ceil(steps * args.epochs / math.ceil(args.epochs)),
              verbose=0, callbacks=callbacks)
  return model


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", default=DATA)
  parser.add_argument("--splits", nargs="+", choices=("valid", "test"), default=["valid"],
                      help="targets to rank: choose on valid; read test only for the choice")
  parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
  parser.add_argument("--epsilon", type=float, default=5.0)
  parser.add_argument("--epochs", type=float, default=1.0)
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--num-negatives", type=int, default=100, help="K per example")
  parser.add_argument("--sampling-exponent", type=float, default=0.0,
                      help="Q ∝ countᵅ: 0 uniform, 1 popularity")
  parser.add_argument("--no-prior", action="store_true",
                      help="no fixed log-popularity logit bias")
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--batch-size", type=int, default=512, help="non-private batch")
  parser.add_argument("--clip", type=float, default=1.0, help="C2 of the DP model")
  parser.add_argument("--algorithm", default="auto", choices=("auto", "dp_sgd", "dp_adafest"),
                      help="make_private's algorithm")
  parser.add_argument("--no-noise", action="store_true",
                      help="diagnostic: the DP step without its gradient noise (AdaFEST keeps its "
                           "selection noise) "
                           "(NOT private)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--every-epoch", action="store_true",
                      help="also print the validation metrics after every epoch")
  parser.add_argument("--json")
  args = parser.parse_args()
  parts, num_items = load(args.data)
  train_u, train_i = parts["train"]
  num_users = int(max(u.max() for u, _ in parts.values())) + 1
  counts = np.bincount(train_i, minlength=num_items + 1)
  buckets = ranking_metrics.popularity_buckets(counts)
  print(f"{len(train_u)} training interactions, {len(parts['valid'][0])} valid and "
        f"{len(parts['test'][0])} test users, "
        f"{num_items} items; {vars(args)}")
  print("| model | HIT@10 | NDCG@10 | head HIT | head NDCG | torso HIT | torso NDCG | tail HIT | "
        "tail NDCG | ε spent | s |")
  print("|---|" + "---:|" * 10, flush=True)
  results = {}

  def evaluate_model(model, splits=args.splits):
    score = tf.function(model.score_items)
    return {split: evaluate(lambda users: score(tf.constant(users)), *parts[split], buckets)
            for split in splits}

  if "popular" in args.models:
    results["most_popular"] = {split: evaluate(
        lambda users: np.tile(counts.astype(np.float32), (len(users), 1)), *parts[split],
        buckets) for split in args.splits}
    for split, summary in results["most_popular"].items():
      print(row(f"most popular (training counts, not private; {split})", summary), flush=True)
  for private in [False] * ("nonprivate" in args.models) + [True] * ("dp" in args.models):
    started = time.perf_counter()
    model = train(args, private, num_users, num_items, train_u, train_i, counts, evaluate_model)
    seconds = time.perf_counter() - started
    name = f"DP ε = {args.epsilon:g}" if private else "non-private"
    name += " (clipping only, no noise: NOT private)" * (private and args.no_noise)
    results[name] = dict(evaluate_model(model), seconds=seconds)
    for split in args.splits:
      print(row(f"{name} ({split})", results[name][split], seconds,
                model.epsilon_spent if private else None), flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(results, args=vars(args)), f, indent=1)


if __name__ == "__main__":
  main()
