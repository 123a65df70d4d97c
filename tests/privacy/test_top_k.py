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


def test_candidates_outside_the_counts_compete_as_zero_counts_and_come_back_absent():
  """With a domain, the top-k is the same k exponential-mechanism draws over counts padded
  with zeros to the domain, each padded winner reported as ABSENT (order kept)."""
  counts, domain, k, epsilon = np.array([3.0, 1.0]), 5, 2, 2.0
  padded = np.concatenate([counts, np.zeros(domain - counts.size)])
  rng = np.random.default_rng(1)
  draws = 20000
  seen = {}
  for _ in range(draws):
    key = tuple(privacy.gumbel_top_k(counts, k, epsilon, rng, domain))
    seen[key] = seen.get(key, 0) + 1
  absent = privacy.top_k.ABSENT
  expected = {}
  for order in itertools.permutations(range(domain), k):
    key = tuple(i if i < counts.size else absent for i in order)
    expected[key] = expected.get(key, 0.0) + _peeling_probability(padded, order, epsilon / k)
  assert set(seen) <= set(expected)
  for key, probability in expected.items():
    observed = seen.get(key, 0) / draws
    assert abs(observed - probability) < 4.5 * math.sqrt(
        probability * (1 - probability) / draws) + 1e-3, (key, observed, probability)
  with pytest.raises(DprecError):
    privacy.gumbel_top_k(counts, 1, 1.0, rng, domain=1)


def test_fest_rows_over_a_domain_drop_the_slots_no_row_won():
  from dprec.sparse.fest import fest_rows
  counts = {"a": np.array([0, 50, 40, 0]), "b": np.array([0, 1, 0])}
  rows = fest_rows(counts, 2, epsilon=1.0, rng=np.random.default_rng(0), domain=1 << 32).rows
  # 2^32 zero-count candidates swamp counts of 0–50 at Gumbel scale 2/(ε/2) = 4 per draw: the
  # noisy maximum of 2^32 Gumbels is ≈ 4·ln(2^32) ≈ 89.
  assert rows["a"].size < 2 and rows["b"].size == 0
  assert fest_rows(counts, 2, epsilon=1e6, rng=np.random.default_rng(0),
                   domain=1 << 32).rows["a"].tolist() == [1, 2]


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
  assert selection.epsilon_per_draw == pytest.approx([0.01] * 3)
  assert selection.epsilon == pytest.approx(0.3) and selection.delta == 0
  assert selection.accounting == "basic"
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


@pytest.mark.parametrize("base,k,epsilon_per_draw", [
    ([5.0, 5.0, 0.0, 0.0, 0.0], 1, 0.5),
    ([5.0, 5.0, 0.0, 0.0, 0.0], 3, 0.5),
    ([0.0, 0.0, 0.0, 0.0], 2, 1.0),
])
def test_k_draws_are_zcdp_with_rho_k_eps_squared_over_8(base, k, epsilon_per_draw):
  """Exact Rényi divergences of neighbouring peeling distributions stay within α·ρ, and come
  close to it (the bounded-range bound is nearly tight, so a wrong constant would fail)."""
  base = np.asarray(base)
  rho = privacy.zcdp_of_draws(k, epsilon_per_draw)
  outputs = list(itertools.permutations(range(len(base)), k))
  tightest = 0.0
  for bucket in range(len(base)):
    neighbour = base.copy()
    neighbour[bucket] += 1
    p = np.array([_peeling_probability(base, o, epsilon_per_draw) for o in outputs])
    q = np.array([_peeling_probability(neighbour, o, epsilon_per_draw) for o in outputs])
    for alpha in (1.01, 1.5, 2.0, 4.0, 8.0, 16.0):
      for x, y in ((p, q), (q, p)):
        divergence = math.log(np.sum(x ** alpha * y ** (1 - alpha))) / (alpha - 1)
        assert divergence <= alpha * rho * (1 + 1e-9)
        tightest = max(tightest, divergence / (alpha * rho))
  assert tightest > 0.6


def test_zcdp_conversion_and_note_example():
  """Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
  arXiv:2311.08357, §3.1: 26 features × 1000 draws at 0.01/26 each: ρ ≈ 4.8e-4, ε ≈ 0.18 at
  δ=1e-7."""
  rho = privacy.zcdp_of_draws(26 * 1000, 0.01 / 26)
  assert rho == pytest.approx(4.8e-4, rel=1e-2)
  assert privacy.zcdp_to_dp(rho, 1e-7) == pytest.approx(0.18, abs=5e-3)
  assert privacy.top_k_selection_cost(26 * 1000, 0.01 / 26) == pytest.approx(10.0)
  assert privacy.top_k_selection_cost(26 * 1000, 0.01 / 26, delta=1e-7) == pytest.approx(
      privacy.zcdp_to_dp(rho, 1e-7))
  assert privacy.top_k_selection_cost(1, 0.5, delta=1e-7) == 0.5  # basic is better for k = 1
  for epsilon, delta in ((0.5, 1e-7), (2.0, 1e-5)):
    assert privacy.zcdp_to_dp(privacy.zcdp_budget(epsilon, delta), delta) == pytest.approx(
        epsilon, rel=1e-12)


def test_zcdp_selection_spends_its_budget_with_larger_draws():
  rng = np.random.default_rng(3)
  counts = [np.arange(200, dtype=float)] * 4
  pure = privacy.select_top_k_per_feature(counts, 400, 0.5, rng)
  zcdp = privacy.select_top_k_per_feature(counts, 400, 0.5, rng, delta=1e-7)
  assert zcdp.accounting == "zcdp" and zcdp.delta == 1e-7
  assert zcdp.epsilon == pytest.approx(0.5, rel=1e-9)
  rho = sum(privacy.zcdp_of_draws(k, e) for k, e in zip(zcdp.k_per_feature,
                                                         zcdp.epsilon_per_draw))
  assert privacy.zcdp_to_dp(rho, 1e-7) == pytest.approx(zcdp.epsilon)
  assert min(zcdp.epsilon_per_draw) > 5 * max(pure.epsilon_per_draw)  # ≈ 7× here
