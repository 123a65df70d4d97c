"""DP item-to-item statistics: per-user sensitivity 1, and a release distributed as the Gaussian
mechanism on every cell followed by a threshold."""
import math

import numpy as np
import pytest

from dprec.errors import DprecError
from dprec.privacy import item_pairs


def _sequences(rng, users, num_items, max_len=12):
  return [rng.integers(1, num_items + 1, size=rng.integers(1, max_len + 1))
          for _ in range(users)]


def test_pair_weights_by_brute_force():
  rows, cols, weights = item_pairs.pair_weights(np.array([3, 5, 3, 3, 5]), window=2, decay=0.5)
  expected = {}
  sequence = [3, 5, 3, 3, 5]
  for gap, factor in ((1, 1.0), (2, 0.5)):
    for t in range(len(sequence) - gap):
      pair = (sequence[t], sequence[t + gap])
      if pair[0] != pair[1]:
        expected[pair] = expected.get(pair, 0.0) + factor
  assert dict(zip(zip(rows.tolist(), cols.tolist()), weights.tolist())) == expected


def test_removing_one_user_moves_the_statistics_by_at_most_one():
  num_items = 9
  sequences = _sequences(np.random.default_rng(0), 30, num_items)
  sequences[0] = np.array([1, 2, 1, 2, 1, 2, 1, 2, 3, 4, 1, 2])  # repeated pairs: weight > 1
  full = item_pairs.pair_statistics(sequences, num_items, window=3, decay=0.7)
  moves = [math.sqrt(((full - item_pairs.pair_statistics(sequences[:u] + sequences[u + 1:],
                                                         num_items, window=3, decay=0.7))
                      .power(2)).sum()) for u in range(len(sequences))]
  assert max(moves) <= item_pairs.SENSITIVITY + 1e-9
  assert np.isclose(moves[0], 1.0)  # the bound is reached, not loose
  # Without the per-user scaling the same user moves the counts by far more than 1.
  _, _, raw = item_pairs.pair_weights(sequences[0], window=3, decay=0.7)
  assert np.linalg.norm(raw) > 3.0


def test_max_items_keeps_the_last_items():
  full = item_pairs.pair_statistics([np.array([1, 2, 3, 4])], 4, window=1, max_items=2)
  assert full.nnz == 1 and full[3, 4] == pytest.approx(1.0)
  with pytest.raises(DprecError, match="1..4"):
    item_pairs.pair_statistics([np.array([0, 2])], 4)


def test_without_a_threshold_it_is_the_gaussian_mechanism_on_every_cell():
  num_items, sigma = 30, 0.7
  statistics = item_pairs.pair_statistics(_sequences(np.random.default_rng(1), 20, num_items),
                                          num_items)
  released = item_pairs.release(statistics, sigma, -math.inf, np.random.default_rng(2))
  dense = released.matrix.toarray()
  noise = (dense - statistics.toarray())[1:, 1:][~np.eye(num_items, dtype=bool)]
  assert released.matrix.nnz == num_items * (num_items - 1)  # every off-diagonal cell once
  assert np.all(np.diag(dense) == 0) and not dense[0].any() and not dense[:, 0].any()
  assert abs(noise.std() - sigma) < 0.05 and abs(noise.mean()) < 0.05


def test_thresholded_release_matches_thresholding_the_dense_noisy_matrix():
  """Kept cells and their values have the distribution of N(0, σ²) on every cell, then ≥ τ:
  counts of kept touched and untouched cells, and the untouched values' mean (the normal's tail
  mean above τ), against the exact expectations."""
  num_items, sigma, threshold = 40, 1.0, 1.5
  statistics = item_pairs.pair_statistics(_sequences(np.random.default_rng(3), 15, num_items),
                                          num_items)
  clean = statistics.toarray()
  touched = clean != 0
  rng = np.random.default_rng(4)
  kept_untouched, kept_touched, values = [], [], []
  for _ in range(200):
    released = item_pairs.release(statistics, sigma, threshold, rng)
    assert released.matrix.data.min() >= threshold
    kept = released.matrix.toarray() != 0
    assert not np.diag(kept).any() and not kept[0].any() and not kept[:, 0].any()
    kept_untouched.append((kept & ~touched).sum())
    kept_touched.append((kept & touched).sum())
    values.append(released.matrix.toarray()[kept & ~touched])
  untouched = num_items * (num_items - 1) - touched.sum()
  rate = 0.5 * math.erfc(threshold / sigma / math.sqrt(2))
  assert released.false_positive_rate == pytest.approx(rate)
  assert np.mean(kept_untouched) == pytest.approx(untouched * rate, rel=0.03)
  survive = 0.5 * np.vectorize(math.erfc)((threshold - clean[touched]) / sigma / math.sqrt(2))
  assert np.mean(kept_touched) == pytest.approx(survive.sum(), rel=0.05)
  tail_mean = sigma * math.exp(-threshold ** 2 / 2) / math.sqrt(2 * math.pi) / rate
  assert np.concatenate(values).mean() == pytest.approx(tail_mean, rel=0.02)


def test_untouched_cells_are_distinct_and_never_touched():
  touched = np.array([0, 3, 4, 9])
  cells = item_pairs._untouched_cells(touched, 6, 10, np.random.default_rng(0))
  assert sorted(cells.tolist()) == [1, 2, 5, 6, 7, 8]


def test_refuses_a_zero_noise_multiplier():
  with pytest.raises(DprecError, match="> 0"):
    item_pairs.release(item_pairs.pair_statistics([np.array([1, 2])], 2), 0.0, 1.0,
                       np.random.default_rng(0))
