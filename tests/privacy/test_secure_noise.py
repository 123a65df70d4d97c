"""Secure noise: exact normal and geometric sampling, the rounded Gaussian mechanism, keying."""
import mpmath
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dprec.optimizers import DPSGD, DPOptimizer
from dprec.privacy import exact_sampling
from dprec.privacy import secure_noise
from dprec.privacy.noise_key import NoiseKey


def _sampler(seed, digit_bits=32):
  return exact_sampling._Sampler(
      secure_noise.KeyedStream(bytes([seed]) * 32, 0), digit_bits)


def _chi_square_pvalue(samples, probabilities):
  """χ² p-value of integer `samples` against {value: probability} (tail values pooled)."""
  values = sorted(probabilities)
  expected = np.array([probabilities[v] for v in values]) * samples.size
  observed = np.array([np.sum(samples == v) for v in values], np.float64)
  rest = samples.size - observed.sum()
  observed, expected = np.append(observed, rest), np.append(expected, samples.size - expected.sum())
  return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("sampler", ["floor_normal", "karney_floor_normal"])
@pytest.mark.parametrize("digit_bits", [32, 1], ids=["32-bit digits", "1-bit digits (ties)"])
@pytest.mark.parametrize("places", [0, 2, 8])
def test_floor_normal_matches_the_normal_at_its_grid(sampler, digit_bits, places):
  """M = ⌊2^p·N⌋ against Pr[M = m] = Φ((m+1)/2^p) − Φ(m/2^p) (χ²), with 32-bit digits and
  with 1-bit digits, where half the u-rand comparisons tie and go digit by digit (and p = 2
  reads several digits of x). Both the table sampler and Karney's (its tail sampler)."""
  n = 20000 if digit_bits == 32 else 4000
  samples = getattr(_sampler(1 + places, digit_bits), sampler)(n, places)
  scale = 2.0 ** places
  probabilities = {m: stats.norm.cdf((m + 1) / scale) - stats.norm.cdf(m / scale)
                   for m in range(int(-3 * scale), int(3 * scale))}
  assert _chi_square_pvalue(samples, probabilities) > 1e-3


def test_floor_normal_at_40_places_passes_kolmogorov_smirnov():
  samples = _sampler(7).floor_normal(50000, 40) * 2.0 ** -40
  assert stats.kstest(samples, "norm").pvalue > 1e-3
  assert abs(samples.mean()) < 0.03 and abs(samples.std() - 1) < 0.02


@pytest.mark.parametrize("entry", [10, 64, 300])
def test_a_prefix_tying_a_table_entry_is_refined_exactly(entry):
  """When U's 64-bit prefix p equals entry i = ⌊2^64·F⌋ (probability 2^−64 in use), U is below
  F with probability 2^64·F − p: `_bin_exact` (U refined by fresh bits) must match that."""
  sampler = _sampler(8)
  bins = exact_sampling._half_normal_bins()
  prefix = int(bins[entry])
  with mpmath.workprec(256):
    below = float(exact_sampling._half_normal_cdf(entry + 1) * mpmath.mpf(2) ** 64 - prefix)
  bins_found = np.array([sampler._bin_exact(prefix, entry, entry + 1)
                         for _ in range(3000)])
  assert set(bins_found) <= {entry, entry + 1}
  share = np.mean(bins_found == entry)
  assert abs(share - below) < 5 * np.sqrt(below * (1 - below) / 3000) + 1e-3


def test_rounded_gaussian_is_the_rounded_mechanism():
  """Δ·round((s + σ·N)/Δ) for s = 0.3, σ = 2: KS against N(0.3, 4), values on the grid Δ."""
  noise = NoiseKey(bytes(32)).secure_generator("test")
  std = 2.0
  values = np.full(20000, 0.3, np.float32)
  out = noise.noisy(values, std)
  assert out.dtype == np.float32
  assert stats.kstest(out, "norm", args=(0.3, std)).pvalue > 1e-3
  grid = noise.rounded_gaussian(np.full(5, 0.3), std)
  assert grid.dtype == np.int64
  with pytest.raises(OverflowError, match="fixed-point range"):
    noise.noisy(np.array([1e7], np.float32), 1.0)


def _geometric_probabilities(p, top=30):
  return {g: (1 - p) ** g * p for g in range(top)}


@pytest.mark.parametrize("rate", [exact_sampling.Rate(0.3),
                                  exact_sampling.Rate.gaussian_tail(1.0)], ids=["0.3", "Ψ(1)"])
def test_geometric_gaps_match_the_geometric_law(rate):
  gaps = _sampler(3).geometric(20000, rate, cap=10 ** 9)
  assert _chi_square_pvalue(gaps, _geometric_probabilities(rate.probability)) > 1e-3
  assert rate.probability == pytest.approx(stats.norm.sf(1.0) if rate.probability < 0.2 else 0.3)


def test_geometric_slow_path_is_exact(monkeypatch):
  """With a fast-path margin of 5%, about a third of the gaps are decided in mpmath."""
  monkeypatch.setattr(exact_sampling, "_FAST_MARGIN", 0.05)
  rate = exact_sampling.Rate(0.2)
  gaps = _sampler(4).geometric(5000, rate, cap=10 ** 9)
  assert _chi_square_pvalue(gaps, _geometric_probabilities(0.2)) > 1e-3
  assert _sampler(5).geometric(100, rate, cap=3).max() == 3  # capped


def test_bernoulli_positions_are_sorted_bits_at_the_rate():
  noise = NoiseKey(bytes(32)).secure_generator("test")
  positions = noise.bernoulli_positions(200000, 0.01)
  assert np.all(np.diff(positions) > 0) and positions[0] >= 0 and positions[-1] < 200000
  assert abs(positions.size - 2000) < 5 * np.sqrt(2000 * 0.99)
  assert noise.bernoulli_positions(0, 0.5).size == 0


def test_tail_rate_is_the_rate_of_an_untouched_row():
  """An untouched row passes τ when round(2^g·N) ≥ ⌈τ/Δ⌉: the rate is Ψ(τ/(σC)) up to 2^−24,
  and what `passes` does on zeros."""
  rate = secure_noise.tail_rate(1.0, 1.0)
  assert rate.probability == pytest.approx(stats.norm.sf(1.0), rel=1e-6)
  noise = NoiseKey(bytes(32)).secure_generator("test")
  passed = noise.passes(np.zeros(40000), 1.0, 1.0)
  assert abs(passed.mean() - rate.probability) < 5 * np.sqrt(rate.probability / 40000)


def test_secure_noise_is_keyed_per_step_and_draw():
  key = NoiseKey(bytes(range(32)))
  generator = key.secure_generator("dp step")
  first = generator.noisy(np.zeros(4), 1.0)
  second = generator.noisy(np.zeros(4), 1.0)
  assert not np.array_equal(first, second)  # each draw its own stream
  key.reset(generator, "dp step")
  np.testing.assert_array_equal(generator.noisy(np.zeros(4), 1.0), first)
  key.reset(generator, "dp step", 1)
  assert not np.array_equal(generator.noisy(np.zeros(4), 1.0), first)
  assert "secret" in repr(generator)


def test_dp_optimizer_secure_noise_inside_tf_function():
  optimizer = DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1), secure_noise=True)
  assert secure_noise.is_secure(optimizer.generator) and optimizer.private
  noisy = tf.function(lambda v: optimizer.generator.add_noise(v, 1.0))(tf.zeros([3, 2]))
  assert noisy.shape == (3, 2) and np.all(noisy.numpy() != 0)
  with pytest.raises(ValueError, match="SecureNoise"):
    DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1), secure_noise=True,
                generator=tf.random.Generator.from_seed(0))


def test_slot_lookup_equals_a_full_search_of_the_table():
  bins = exact_sampling._half_normal_bins()
  rng = np.random.default_rng(0)
  prefixes = rng.integers(0, 2 ** 64, 100000, dtype=np.uint64)
  prefixes[:1000] = bins[rng.integers(0, bins.size, 1000)]  # on entries
  prefixes[1000:2000] = np.uint64(2 ** 64 - 1) - rng.integers(0, 2 ** 50, 1000, dtype=np.uint64)
  np.testing.assert_array_equal(exact_sampling._entries_below(bins, prefixes),
                                np.searchsorted(bins, prefixes, side="left"))


def test_large_draws_are_sampled_chunk_by_chunk_on_distinct_streams(monkeypatch):
  monkeypatch.setattr(secure_noise, "CHUNK", 1000)
  key = NoiseKey(bytes(32))
  noise = key.secure_generator("test")
  out = noise.noisy(np.zeros(5500, np.float32), 1.0)
  assert stats.kstest(out, "norm").pvalue > 1e-3
  assert len({tuple(out[i:i + 5]) for i in range(0, 5500, 1000)}) == 6  # no chunk repeats
  key.reset(noise, "test")
  np.testing.assert_array_equal(noise.noisy(np.zeros(5500, np.float32), 1.0), out)
