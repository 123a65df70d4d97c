"""Full-ranking NDCG@10 / HIT@10 and popularity buckets against direct computations."""
import numpy as np

from dprec.models import ranking_metrics


def test_ranks_and_metrics_match_a_direct_sort():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(50, 40)).astype(np.float32)
  targets = rng.integers(0, 40, size=50)
  ranks = ranking_metrics.target_ranks(scores, targets).numpy()
  for row in range(50):
    order = np.argsort(-scores[row], kind="stable")
    assert ranks[row] == 1 + np.flatnonzero(order == targets[row])[0]
  ndcg, hit = ranking_metrics.ndcg_and_hit(ranks, k=10)
  np.testing.assert_allclose(hit, ranks <= 10)
  np.testing.assert_allclose(ndcg, np.where(ranks <= 10, 1 / np.log2(ranks + 1), 0.0))


def test_ties_count_against_the_target_and_history_can_be_excluded():
  scores = np.zeros((1, 5), np.float32)
  assert ranking_metrics.target_ranks(scores, np.array([2])).numpy()[0] == 5
  scores = np.array([[5.0, 4.0, 3.0, 2.0, 1.0]], np.float32)
  histories = np.array([[0, 1, 2]])  # items 1 and 2 = score columns 0 and 1
  summary = ranking_metrics.evaluate_full_ranking(
      lambda h: scores, histories, np.array([3]), np.zeros(6, np.int64), k=1,
      exclude_history=True)
  assert summary["hit_at_1"] == 1.0 and summary["ndcg_at_1"] == 1.0


def test_popularity_buckets_split_occurrences_in_thirds():
  counts = np.array([0, 60, 30, 20, 10, 5, 5, 0])  # item 7 never seen
  buckets = ranking_metrics.popularity_buckets(counts)
  np.testing.assert_array_equal(buckets[1:], [0, 1, 2, 2, 2, 2, 2])
  summary = ranking_metrics.summarize(np.array([1, 20, 3]), np.array([1, 2, 7]), buckets)
  assert summary["by_popularity"]["head"]["hit_at_10"] == 1.0
  assert summary["by_popularity"]["torso"]["users"] == 1
  assert summary["by_popularity"]["tail"]["ndcg_at_10"] == 0.5
