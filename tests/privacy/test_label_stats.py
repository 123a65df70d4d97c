"""DP label statistics and DP affine recalibration: exact without noise, noise of
the stated scale (measured from samples), sensitivity as stated (one label moves the sum by at
most the bound), and a label range that holds the labels."""
import numpy as np
import pytest

from dprec import privacy

SIGMA, DRAWS = 3.0, 4000


def _spread(release):
  return np.std([release(np.random.default_rng(seed)) for seed in range(DRAWS)])


def test_dp_mean_is_exact_without_noise_and_its_noise_is_sigma_times_half_the_range_over_n():
  labels = np.array([1.0, 2.0, 5.0, 9.0])  # 9 is clipped to 5
  assert privacy.dp_mean(labels, (1, 5), 0.0, None) == pytest.approx(13 / 4)
  sigma = 0.5  # small enough that the released mean is never clipped to the range
  measured = _spread(lambda rng: privacy.dp_mean(labels, (1, 5), sigma, rng))
  assert measured == pytest.approx(sigma * 2 / 4, rel=0.05)


def test_one_label_moves_the_clipped_centred_sum_by_at_most_half_the_range():
  labels = np.array([1.0, 3.0, 4.0])
  for extra in (-100.0, 1.0, 5.0, 100.0):
    with_extra = privacy.dp_mean(np.append(labels, extra), (1, 5), 0.0, None) * 4 - 3 * 4
    without = privacy.dp_mean(labels, (1, 5), 0.0, None) * 3 - 3 * 3
    assert abs(with_extra - without) <= 2.0 + 1e-9


def test_class_counts_have_unit_noise_per_class():
  labels = np.array([0, 1, 1, 2])
  np.testing.assert_array_equal(privacy.dp_class_counts(labels, 4, 0.0, None), [1, 2, 1, 1])
  many = np.repeat(labels, 100)  # counts far above the floor of 1
  draws = [privacy.dp_class_counts(many, 4, SIGMA, np.random.default_rng(s))[1]
           for s in range(DRAWS)]
  assert np.std(draws) == pytest.approx(SIGMA, rel=0.05)


def test_label_range_holds_the_labels():
  labels = np.random.default_rng(0).integers(1, 6, 50_000).astype(float)
  lo, hi = privacy.dp_label_range(labels, 50.0, np.random.default_rng(1))
  assert lo <= 1 and hi >= 5 and hi <= 8 and lo >= 0.5


def test_affine_recalibration_is_least_squares_without_noise():
  rng = np.random.default_rng(0)
  predictions = rng.uniform(2, 4, 1000)
  labels = np.clip(0.5 * predictions + 1.7 + rng.normal(0, 0.1, 1000), 1, 5)
  scale, shift = privacy.dp_affine_recalibration(predictions, labels, (1, 5), 0.0)
  np.testing.assert_allclose([scale, shift], np.polyfit(predictions, labels, 1), rtol=1e-9)
  noisy = privacy.dp_affine_recalibration(predictions, labels, (1, 5), 1.0,
                                          np.random.default_rng(1))
  np.testing.assert_allclose(noisy, [scale, shift], atol=0.1)
