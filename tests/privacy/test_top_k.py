"""DP top-k: Gumbel one-shot equals k exponential-mechanism draws, whose privacy loss needs k·ε."""
import itertools
import math

import numpy as np
import pytest

from dprec import privacy
from dprec.errors import DprecError


def _peeling_probability(counts, order, epsilon_per_draw):
  """Exact P(ordered output) of k exponential-mechanism draws without replacement."""
  remaining = list(range(len(counts)))
  probability = 1.0
  for index in order:
    weights = np.exp(epsilon_per_draw * np.asarray([counts[i] for i in remaining], float))
    probability *= weights[remaining.index(index)] / weights.sum()
    remaining.remove(index)
  return probability


def test_gumbel_top_k_is_k_exponential_mechanism_draws():
  counts, k, epsilon = np.array([3.0, 1.0, 0.0, 2.0]), 2, 2.0
  rng = np.random.default_rng(0)
  draws = 20000
  seen = {}
  for _ in range(draws):
    key = tuple(privacy.gumbel_top_k(counts, k, epsilon, rng))
    seen[key] = seen.get(key, 0) + 1
  for order in itertools.permutations(range(4), k):
    expected = _peeling_probability(counts, order, epsilon / k)
    observed = seen.get(order, 0) / draws
    assert abs(observed - expected) < 4.5 * math.sqrt(expected * (1 - expected) / draws) + 1e-3


def test_k_selections_cost_k_draws_not_one():
  """Add one example to a bucket: the worst log-ratio over outputs exceeds one draw's ε and
  stays within k·ε_draw, the cost dprec charges."""
  base, k, epsilon_per_draw = np.array([5.0, 5.0, 0.0, 0.0, 0.0]), 3, 0.5
  worst = 0.0
  for bucket in range(len(base)):
    neighbour = base.copy()
    neighbour[bucket] += 1
    for order in itertools.permutations(range(len(base)), k):
      p, q = (_peeling_probability(c, order, epsilon_per_draw) for c in (base, neighbour))
      worst = max(worst, abs(math.log(p / q)))
  charged = privacy.top_k_selection_cost(k, epsilon_per_draw)
  assert worst <= charged + 1e-12
  assert worst > 2 * epsilon_per_draw


def test_feature_counts_sensitivity_one_bucket_per_feature():
  rng = np.random.default_rng(1)
  sizes = [7, 3, 11]
  ids = np.stack([rng.integers(0, s, 50) for s in sizes], axis=1)
  counts = privacy.feature_counts(ids, sizes)
  with_one_more = privacy.feature_counts(np.vstack([ids, [[6, 0, 10]]]), sizes)
  for before, after in zip(counts, with_one_more):
    diff = after - before
    assert diff.min() == 0 and diff.sum() == 1  # one bucket per feature moves by exactly one
  with pytest.raises(DprecError):
    privacy.feature_counts(ids, [7, 3, 5])


def test_multi_feature_selection_splits_budget_and_reports_cost():
  rng = np.random.default_rng(2)
  counts = [np.arange(100, dtype=float) * 50, np.zeros(40), np.arange(10, dtype=float)]
  selection = privacy.select_top_k_per_feature(counts, 30, 0.3, rng)
  assert selection.k_per_feature == [10, 10, 10]
  assert selection.epsilon_per_feature == pytest.approx(0.1)
  assert selection.epsilon_per_draw == pytest.approx([0.01] * 3)
  assert selection.epsilon == pytest.approx(0.3)
  assert [len(i) for i in selection.indices] == [10, 10, 10]
  assert all(len(set(i.tolist())) == len(i) for i in selection.indices)
  # Strong signal (gaps of 50 counts vs Gumbel scale 100) mostly keeps the frequent buckets.
  assert np.mean(selection.indices[0] >= 70) >= 0.7
  uneven = privacy.select_top_k_per_feature(counts, [5, 50, 20], 0.3, rng)
  assert uneven.k_per_feature == [5, 40, 10]  # capped at each feature's bucket count
  assert uneven.epsilon == pytest.approx(0.3)


def test_bad_selection_input():
  rng = np.random.default_rng(0)
  with pytest.raises(DprecError):
    privacy.gumbel_top_k(np.ones(3), 4, 1.0, rng)
  with pytest.raises(DprecError):
    privacy.gumbel_top_k(np.ones(3), 1, 0.0, rng)
  with pytest.raises(DprecError):
    privacy.select_top_k_per_feature([np.ones(3), np.ones(3)], 1, 1.0, rng)
