"""Full-ranking evaluation for next-item recommendation (Ding et al., "DPFormer: Learning
Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633; Krichene & Rendle 2020).

Every user's held-out item is ranked against all M items (no sampled negatives). With one
relevant item, HIT@k = 1[rank ≤ k] and NDCG@k = 1[rank ≤ k]/log2(rank + 1) (Eqs. 32–34). Ties
count against the target (rank = 1 + #items scoring ≥ it, itself excluded), so a constant model
scores 0. Metrics are also reported per popularity bucket of the target item: items sorted by
training frequency and split into head / torso / tail so that each bucket holds a third of all
training occurrences (the head is the few items that make up the first third).
"""
import numpy as np
import tensorflow as tf

from dprec.progress import progress_bar

BUCKETS = ("head", "torso", "tail")


def target_ranks(scores, targets, exclude=None):
  """1-based rank of each target among all items; scores [B, M], targets [B] in 0..M−1.

  `exclude` (optional bool [B, M]) removes items from the ranking, e.g. the user's history.
  """
  scores = tf.convert_to_tensor(scores)
  target_scores = tf.gather(scores, targets, axis=1, batch_dims=1)[:, None]
  beats = scores >= target_scores
  if exclude is not None:
    beats = tf.logical_and(beats, tf.logical_not(exclude))
  beats = tf.logical_and(beats, tf.logical_not(tf.one_hot(targets, tf.shape(scores)[1]) > 0))
  return 1 + tf.reduce_sum(tf.cast(beats, tf.int64), axis=1)


def ndcg_and_hit(ranks, k=10):
  """Per-user NDCG@k and HIT@k from 1-based ranks."""
  ranks = np.asarray(ranks, np.float64)
  hit = (ranks <= k).astype(np.float64)
  return hit / np.log2(ranks + 1.0), hit


def popularity_buckets(counts):
  """Bucket index (0 head, 1 torso, 2 tail) per item from training counts [M + 1] (index 0 pad).

  Items are sorted by count (descending, ties by id); an item's bucket is the third of the total
  count its cumulative share falls into before it is added. Unseen items are tail.
  """
  counts = np.asarray(counts, np.float64).copy()
  counts[0] = 0.0
  order = np.argsort(-counts, kind="stable")
  before = np.concatenate([[0.0], np.cumsum(counts[order])[:-1]]) / max(counts.sum(), 1e-12)
  buckets = np.empty(len(counts), np.int64)
  buckets[order] = np.minimum((before * 3).astype(np.int64), 2)
  buckets[counts == 0] = 2
  return buckets


def summarize(ranks, target_items, buckets, k=10):
  """{'ndcg_at_10', 'hit_at_10', 'users', 'by_popularity': {bucket: {...}}}, metrics in [0, 1]."""
  ndcg, hit = ndcg_and_hit(ranks, k)
  target_buckets = np.asarray(buckets)[np.asarray(target_items)]
  summary = {f"ndcg_at_{k}": float(ndcg.mean()) if len(ndcg) else 0.0,
             f"hit_at_{k}": float(hit.mean()) if len(hit) else 0.0,
             "users": int(len(ndcg)), "by_popularity": {}}
  for index, name in enumerate(BUCKETS):
    chosen = target_buckets == index
    summary["by_popularity"][name] = {
        f"ndcg_at_{k}": float(ndcg[chosen].mean()) if chosen.any() else 0.0,
        f"hit_at_{k}": float(hit[chosen].mean()) if chosen.any() else 0.0,
        "users": int(chosen.sum())}
  return summary


def evaluate_full_ranking(score_fn, histories, targets, buckets, k=10, batch_size=512,
                          exclude_history=False, progress=None):
  """Ranks each target item among all M items; returns `summarize(...)`.

  `score_fn(histories_batch)` returns scores [b, M] for items 1..M; `histories` int [U, L]
  (0 = padding), `targets` item ids [U] in 1..M, `buckets` from `popularity_buckets`.
  `exclude_history` drops items already in the history from the ranking (the paper does not say;
  off by default). `progress` wraps the batch iterator (e.g. tqdm).
  """
  return evaluate_scorings(lambda history: [score_fn(history)], histories, targets, buckets, k,
                           batch_size, exclude_history, progress)[0]


def evaluate_scorings(scores_fn, histories, targets, buckets, k=10, batch_size=512,
                      exclude_history=False, progress=None):
  """`evaluate_full_ranking` of several scorings in one pass: `scores_fn(histories_batch)`
  returns a list of [b, M] scores (e.g. one model's logits under several prior weights, the
  model run once); returns one `summarize(...)` per scoring, in order."""
  histories, targets = np.asarray(histories), np.asarray(targets)
  starts = range(0, len(targets), batch_size)
  ranks = []
  for start in (progress(starts) if progress else starts):
    history = histories[start:start + batch_size]
    scorings = scores_fn(history)
    exclude = (_seen_items(history, int(scorings[0].shape[1])) if exclude_history else None)
    ranks.append([target_ranks(scores, targets[start:start + batch_size] - 1, exclude).numpy()
                  for scores in scorings])
  if not ranks:
    return [summarize(np.zeros([0], np.int64), targets, buckets, k)]
  return [summarize(np.concatenate(column), targets, buckets, k) for column in zip(*ranks)]


def scorer(model):
  """`model.score_items` as a function of numpy histories [b, L] -> [b, M] (a Keras model's,
  e.g. `SeqRecModel`, traced once; any other object's, e.g. `Item2ItemModel`, as it is)."""
  if isinstance(model, tf.keras.Model):
    traced = tf.function(model.score_items, reduce_retracing=True)
    return lambda histories: traced(tf.constant(histories))
  return model.score_items


def ranking_progress(progress):
  """A tqdm wrapper of the batch iterator on stderr if `progress`, else None."""
  if not progress:
    return None
  return lambda batches: progress_bar(batches, desc="full ranking", unit="batch")


def evaluate_model(model, histories, targets, item_frequencies, batch_size=512,
                   exclude_history=False, progress=False):
  """`evaluate_full_ranking` of a model with `score_items(histories) -> [b, M]` (`scorer`),
  buckets from `item_frequencies` [M + 1]; a tqdm bar on stderr with `progress`."""
  return evaluate_full_ranking(scorer(model), histories, targets,
                               popularity_buckets(item_frequencies), batch_size=batch_size,
                               exclude_history=exclude_history,
                               progress=ranking_progress(progress))


def top_k_diversity(score_fn, histories, item_frequencies, users=2000, k=10, seed=0):
  """How much the top-k depends on the user, over a fixed sample (by `seed`, not a privacy
  draw) of `users` histories: {'distinct_top10_items': distinct items in their top-k lists,
  'top10_popularity_overlap': mean share of a list that is the top-k by `item_frequencies`
  [M + 1], 'top10_between_users_overlap': mean share two random users' lists have in common
  (1 = everyone gets the same)} (names for k = 10). `score_fn(histories) -> [b, M]`."""
  rng = np.random.default_rng(seed)
  sample = rng.choice(len(histories), min(users, len(histories)), replace=False)
  top = np.argsort(-np.asarray(score_fn(np.asarray(histories)[sample])), axis=1)[:, :k]
  popular = set(np.argsort(-np.asarray(item_frequencies)[1:], kind="stable")[:k])
  pairs = rng.integers(0, len(sample), (len(sample), 2))
  return {f"distinct_top{k}_items": int(len(np.unique(top))),
          f"top{k}_popularity_overlap": float(np.mean([len(set(r) & popular) / k for r in top])),
          f"top{k}_between_users_overlap": float(np.mean(
              [len(set(top[a]) & set(top[b])) / k for a, b in pairs]))}


def _seen_items(histories, num_items):
  """bool [b, M]: item m + 1 occurs in the history (padding ignored)."""
  seen = np.zeros((len(histories), num_items), bool)
  rows, cols = np.nonzero(histories > 0)
  seen[rows, histories[rows, cols] - 1] = True
  return seen
