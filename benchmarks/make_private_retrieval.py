"""Private two-tower retrieval on Amazon Games through `dprec.make_private` (issue 30).

Data: ../shared/data/amazon-video-games/Video.txt (SASRec format, `user item` lines in time
order). Leave-one-out as in DPFormer: each user's last item is the test target, the one before
is held out (validation, unused: no model selection here), the rest are training examples
(user, item). The model is `dprec.models.retrieval.two_tower` (full softmax over the corpus);
the metrics rank each test target against all items (`dprec.models.ranking_metrics`), overall
and per popularity bucket of the target, beside the most-popular baseline and the non-private
model. The unit protected is one training interaction (example-level DP), NOT one user: a user
with many interactions is protected only as a group of that size (train seqrec protects users).

    python benchmarks/make_private_retrieval.py --epsilon 5 --epochs 3
"""
import argparse
import json
import os
import time

import dprec  # pylint: disable=unused-import  (Keras 2 before TensorFlow is used)
import numpy as np
import tensorflow as tf

from dprec.models import ranking_metrics
from dprec.models import retrieval

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                    "amazon-video-games", "Video.txt")


def load(path):
  """(train users, train items, test users, test items, M): items 1..M, leave-one-out."""
  lines = np.loadtxt(path, dtype=np.int64)
  users, items = lines[:, 0], lines[:, 1]
  train_u, train_i, test_u, test_i = [], [], [], []
  boundaries = np.flatnonzero(np.diff(users)) + 1
  for sequence_users, sequence in zip(np.split(users, boundaries), np.split(items, boundaries)):
    if len(sequence) < 3:
      train_u.append(sequence_users)
      train_i.append(sequence)
      continue
    train_u.append(sequence_users[:-2])
    train_i.append(sequence[:-2])
    test_u.append(sequence_users[-1:])
    test_i.append(sequence[-1:])
  return (np.concatenate(train_u), np.concatenate(train_i), np.concatenate(test_u),
          np.concatenate(test_i), int(items.max()))


def evaluate(score_fn, test_users, test_items, buckets, batch=1024):
  ranks = []
  for start in range(0, len(test_users), batch):
    scores = score_fn(test_users[start:start + batch])[:, 1:]  # items 1..M
    ranks.append(ranking_metrics.target_ranks(scores, test_items[start:start + batch] - 1)
                 .numpy())
  return ranking_metrics.summarize(np.concatenate(ranks), test_items, buckets)


def row(name, summary, seconds=None, epsilon=None):
  parts = [summary["hit_at_10"], summary["ndcg_at_10"]]
  for bucket in ranking_metrics.BUCKETS:
    parts += [summary["by_popularity"][bucket]["hit_at_10"],
              summary["by_popularity"][bucket]["ndcg_at_10"]]
  cells = " | ".join(f"{value:.4f}" for value in parts)
  return (f"| {name} | {cells} | {'' if epsilon is None else f'{epsilon:.3f}'} | "
          f"{'' if seconds is None else f'{seconds:.0f}'} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", default=DATA)
  parser.add_argument("--epsilon", type=float, default=5.0)
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--skip-nonprivate", action="store_true")
  parser.add_argument("--json")
  args = parser.parse_args()
  train_u, train_i, test_u, test_i, num_items = load(args.data)
  num_users = int(max(train_u.max(), test_u.max())) + 1
  counts = np.bincount(train_i, minlength=num_items + 1)
  buckets = ranking_metrics.popularity_buckets(counts)
  print(f"{len(train_u)} training interactions, {len(test_u)} test users, {num_items} items")
  print("| model | HIT@10 | NDCG@10 | head HIT | head NDCG | torso HIT | torso NDCG | tail HIT | "
        "tail NDCG | ε spent | s |")
  print("|---|" + "---:|" * 10)
  results = {"most_popular": evaluate(
      lambda users: np.tile(counts.astype(np.float32), (len(users), 1)), test_u, test_i,
      buckets)}
  print(row("most popular (training counts, not private)", results["most_popular"]), flush=True)
  for private in ([False] if not args.skip_nonprivate else []) + [True]:
    tf.keras.utils.set_random_seed(args.seed)
    model = retrieval.two_tower(num_users, num_items + 1, args.dim)
    started = time.perf_counter()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if private:
      model = dprec.make_private(model, epsilon=args.epsilon, train_size=len(train_u),
                                 epochs=args.epochs)
    model.compile(optimizer=tf.keras.optimizers.Adam(args.learning_rate), loss=loss)
    if private:
      model.fit({"user": train_u}, train_i, epochs=args.epochs, verbose=0)
    else:
      model.fit({"user": train_u}, train_i, epochs=args.epochs, batch_size=512, verbose=0)
    seconds = time.perf_counter() - started
    name = f"DP ε = {args.epsilon:g}" if private else "non-private"
    results[name] = evaluate(lambda users: model({"user": users}).numpy(), test_u, test_i,
                             buckets)
    print(row(name, results[name], seconds, model.epsilon_spent if private else None),
          flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(results, args=vars(args)), f, indent=1)


if __name__ == "__main__":
  main()
