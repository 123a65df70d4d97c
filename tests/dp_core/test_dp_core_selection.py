"""Contribution maps and DP-AdaFEST selection (Ghazi et al., "Sparsity-Preserving Differentially
Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1 lines 5–6, App. B.2)."""
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dprec.optimizers import DPAdaFEST, DPAdaFESTPlus
from dprec.sparse import contribution as contribution_lib
from dprec.sparse import kept_rows as kept_rows_lib
from dprec.sparse import selection
from dprec.clipping.embedding import Pairs
from dprec.privacy.noise_key import NoiseKey

# Default mode (Philox) and secure mode (exact sampling from a keyed SHAKE-256 stream).
MODES = ["default", "secure"]


def _generator(mode, seed):
  if mode == "secure":
    return NoiseKey(bytes(32)).secure_generator("test", seed)
  return tf.random.Generator.from_seed(seed)


def _pairs(example_rows):
  """Distinct (example, row) pairs from {example: rows}."""
  example = [i for i, rows in example_rows.items() for _ in set(rows)]
  row = [r for rows in example_rows.values() for r in sorted(set(rows))]
  return tf.constant(example, tf.int64), tf.constant(row, tf.int64)


def _dense_map(example_rows, universe, clip):
  total = np.zeros(universe)
  for rows in example_rows.values():
    v = np.zeros(universe)
    v[list(set(rows))] = 1.0
    total += v * min(1.0, clip / np.linalg.norm(v))
  return total


def test_contribution_map_matches_dense_clipped_maps():
  rng = np.random.default_rng(0)
  batch = {i: list(rng.integers(0, 40, rng.integers(1, 12))) for i in range(30)}
  example, row = _pairs(batch)
  cmap = contribution_lib.contribution_map(example, row, 30, clip=2.0)
  dense = np.zeros(40)
  dense[cmap.rows.numpy()] = cmap.values.numpy()
  np.testing.assert_allclose(dense, _dense_map(batch, 40, 2.0), rtol=1e-6)
  assert np.all(np.diff(cmap.rows.numpy()) > 0)
  np.testing.assert_array_equal(tf.gather(cmap.rows, cmap.pair_slot).numpy(), row.numpy())


@pytest.mark.parametrize("clip", [0.5, 2.0, 100.0])
def test_contribution_map_sensitivity_at_most_c1(clip):
  """Removing any one example moves V̂ by at most C1 in ℓ2 (and by exactly min(√k, C1))."""
  rng = np.random.default_rng(1)
  batch = {i: list(rng.integers(0, 25, rng.integers(1, 30))) for i in range(12)}
  full = _dense_map(batch, 25, clip)
  example, row = _pairs(batch)
  cmap = contribution_lib.contribution_map(example, row, 12, clip)
  got_full = np.zeros(25)
  got_full[cmap.rows.numpy()] = cmap.values.numpy()
  np.testing.assert_allclose(got_full, full, rtol=1e-6)
  for removed in batch:
    rest = {i: rows for i, rows in batch.items() if i != removed}
    example, row = _pairs(rest)
    cmap = contribution_lib.contribution_map(example, row, 12, clip)
    neighbour = np.zeros(25)
    neighbour[cmap.rows.numpy()] = cmap.values.numpy()
    shift = np.linalg.norm(got_full - neighbour)
    assert shift <= clip + 1e-5
    assert shift == pytest.approx(min(np.sqrt(len(set(batch[removed]))), clip), rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_false_positive_rate_in_a_billion_row_universe(mode):
  """Binomial test of the number of untouched rows selected; no V-sized tensor is built
  (a 10⁹-row int64 vector alone would need 8 GB)."""
  universe = 10 ** 9
  rng = np.random.default_rng(2)
  touched = np.unique(rng.integers(0, universe, 5000))
  threshold, sigma1, clip1 = 3.0, 1.5, 0.5          # τ/(σ1·C1) = 4
  rate = stats.norm.sf(threshold / (sigma1 * clip1))  # Ψ(4) ≈ 3.2e-5 → ≈ 3.2e4 rows
  assert selection.false_positive_rate(threshold, sigma1 * clip1) == pytest.approx(rate)
  generator = _generator(mode, 3)
  contributions = tf.zeros([touched.size])
  keep, false_positives = selection.select_rows(
      tf.constant(touched), contributions, selection.RowUniverse(size=universe), threshold,
      sigma1 * clip1, generator)
  picked = false_positives.numpy()
  trials = universe - touched.size
  mean, std = trials * rate, np.sqrt(trials * rate * (1 - rate))
  assert abs(picked.size - mean) < 5 * std
  assert np.all(np.diff(picked) > 0) and picked[0] >= 0 and picked[-1] < universe
  assert not np.intersect1d(picked, touched).size
  # Positions are uniform over the universe (chi-square over 20 bins).
  counts = np.bincount(picked * 20 // universe, minlength=20)
  assert stats.chisquare(counts).pvalue > 1e-4
  # Touched rows with zero contribution pass with the same probability.
  assert keep.numpy().sum() < 20


@pytest.mark.parametrize("mode", MODES)
def test_untouched_sampling_is_bernoulli_per_row(mode):
  """Every untouched row is selected with probability p; touched rows never are."""
  touched = tf.constant([0, 5, 6, 29], tf.int64)
  generator = _generator(mode, 4)
  sample = tf.function(lambda: selection.sample_untouched(touched, 30, 0.3, generator))
  hits = np.zeros(30)
  runs = 2000
  for _ in range(runs):
    hits[sample().numpy()] += 1
  assert np.all(hits[[0, 5, 6, 29]] == 0)
  free = np.setdiff1d(np.arange(30), [0, 5, 6, 29])
  np.testing.assert_array_less(np.abs(hits[free] / runs - 0.3), 5 * np.sqrt(0.3 * 0.7 / runs))
  everything = selection.sample_untouched(touched, 30, 1.0, generator).numpy()
  np.testing.assert_array_equal(everything, free)
  assert selection.sample_untouched(touched, 30, 0.0, generator).numpy().size == 0


@pytest.mark.parametrize("mode", MODES)
def test_selection_threshold_on_touched_rows(mode):
  """Touched rows pass with probability Ψ((τ − V̂)/(σ1·C1)) (the corrected App. B.2 formula)."""
  generator = _generator(mode, 5)
  contributions = tf.fill([20000], 2.0)
  keep, _ = selection.select_rows(tf.range(20000, dtype=tf.int64), contributions,
                                  selection.RowUniverse(size=20000), 2.5, 0.5, generator)
  rate = stats.norm.sf((2.5 - 2.0) / 0.5)
  assert abs(keep.numpy().mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / 20000)


@pytest.mark.parametrize("mode", MODES)
def test_adafest_plus_selects_only_inside_the_fest_set(mode):
  layout = kept_rows_lib.TableLayout(["a", "b"], [10 ** 6, 10 ** 6])
  fest = {"a": np.arange(0, 10 ** 6, 3), "b": np.arange(5, 200)}
  config = DPAdaFESTPlus(1.0, 1.0, contribution_clip=1.0, contribution_noise_multiplier=1.0,
                         threshold=2.0, selected_rows=fest)
  pairs = [Pairs(tf.constant([0, 0, 1], tf.int64), tf.constant([3, 4, 3], tf.int64),
                 tf.constant([0, 1, 2], tf.int64)),
           Pairs(tf.constant([0, 1], tf.int64), tf.constant([7, 10 ** 6 - 1], tf.int64),
                 tf.constant([0, 1], tf.int64))]
  kept = kept_rows_lib.select_kept_rows(config, layout, pairs, 2,
                                        _generator(mode, 6))
  for table, result in zip(["a", "b"], kept):
    rows = result.rows.numpy()
    assert np.all(np.isin(rows, fest[table])) and np.all(np.diff(rows) > 0)
  # Rows outside the set are never kept, whatever the noise.
  assert not kept[0].pair_kept.numpy()[1] and not kept[1].pair_kept.numpy()[1]
  expected = (len(fest["a"]) + len(fest["b"]) - 2) * stats.norm.sf(2.0)
  total = sum(r.rows.numpy().size for r in kept)
  assert abs(total - expected) < 6 * np.sqrt(expected) + 2


def test_adafest_config_validation():
  with pytest.raises(ValueError):
    DPAdaFEST(1.0, 1.0, contribution_clip=1.0, contribution_noise_multiplier=1.0, threshold=0.0)
  with pytest.raises(ValueError):
    DPAdaFEST(1.0, 1.0, contribution_clip=float("inf"), contribution_noise_multiplier=1.0,
              threshold=1.0)


def test_adafest_noise_split_keeps_the_accounted_sigma():
  config = DPAdaFEST.from_noise_multiplier(1.0, 0.8, ratio=5.0, contribution_clip=1.0,
                                           threshold=2.0)
  sigma1, sigma2 = config.contribution_noise_multiplier, config.noise_multiplier
  assert sigma1 == pytest.approx(5.0 * sigma2)
  assert (sigma1 ** -2 + sigma2 ** -2) ** -0.5 == pytest.approx(0.8)
  assert config.accounting_noise_multiplier == pytest.approx(0.8)


def test_fest_rows_public_and_private(tmp_path):
  from dprec.errors import BudgetExceededError
  from dprec.privacy import PrivacyLedger
  from dprec.sparse.fest import fest_rows
  counts = {"a": np.array([5, 0, 9, 9, 1]), "b": np.arange(100) ** 2}
  public = fest_rows(counts, {"a": 2, "b": 3})
  np.testing.assert_array_equal(public.rows["a"], [2, 3])
  np.testing.assert_array_equal(public.rows["b"], [97, 98, 99])
  assert public.epsilon == 0
  ledger = PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=1.0, delta=1e-6)
  private = fest_rows(counts, 3, epsilon=0.5, rng=np.random.default_rng(0), ledger=ledger)
  assert private.epsilon == pytest.approx(0.5)
  assert ledger.epsilon_spent() == pytest.approx(0.5)
  assert all(len(rows) == 3 and np.all(np.diff(rows) > 0) for rows in private.rows.values())
  with pytest.raises(BudgetExceededError):
    fest_rows(counts, 3, epsilon=0.6, rng=np.random.default_rng(1), ledger=ledger)
  assert ledger.epsilon_spent() == pytest.approx(0.5)
