"""The one-run ε lower bound (Steinke, Nasr & Jagielski 2023) against values computed by hand."""
import math

import numpy as np
import pytest
from scipy import stats

from dprec.audit import bounds
from dprec.privacy import calibrate_noise_multiplier


def test_p_value_without_delta_is_the_binomial_tail():
  q = math.exp(1.0) / (1 + math.exp(1.0))
  assert bounds.one_run_p_value(100, 40, 30, 1.0) == pytest.approx(
      sum(math.comb(40, j) * q**j * (1 - q)**(40 - j) for j in range(30, 41)), rel=1e-12)
  assert bounds.one_run_p_value(10, 4, 0, 3.0) == 1.0


def test_p_value_delta_term_by_hand():
  # m = 10, r = 3, v = 2, ε = 0: q = 1/2; β = Pr[Bin ≥ 2] = 1/2;
  # α = max(Pr[Bin = 1]/1, (Pr[Bin = 1] + Pr[Bin = 0])/2) = max(3/8, 1/4) = 3/8.
  assert bounds.one_run_p_value(10, 3, 2, 0.0, delta=0.01) == pytest.approx(
      0.5 + 2 * 10 * 0.01 * 3 / 8, rel=1e-12)


def test_all_guesses_right_gives_the_closed_form():
  # v = r, δ = 0: q^r = 1 − c at the bound, ε = log(q/(1 − q)).
  for r in (20, 100):
    q = 0.05 ** (1 / r)
    assert bounds.epsilon_lower_bound(4 * r, r, r, confidence=0.95) == pytest.approx(
        math.log(q / (1 - q)), abs=1e-5)
  assert bounds.epsilon_lower_bound(400, 100, 100, confidence=0.95) == pytest.approx(3.4930,
                                                                                     abs=1e-3)


def test_bound_is_the_boundary_of_rejection():
  m, r, v, delta = 1000, 200, 150, 1e-5
  epsilon = bounds.epsilon_lower_bound(m, r, v, delta, confidence=0.95)
  assert 0 < epsilon < 2
  assert bounds.one_run_p_value(m, r, v, epsilon - 1e-4, delta) < 0.05
  assert bounds.one_run_p_value(m, r, v, epsilon + 1e-4, delta) >= 0.05
  # δ only weakens it; chance-level guessing proves nothing.
  assert epsilon <= bounds.epsilon_lower_bound(m, r, v, 0.0, confidence=0.95)
  assert bounds.epsilon_lower_bound(m, r, 100, delta) == 0.0


def test_bound_is_valid_for_randomized_response():
  # ε-DP randomised response on each canary's membership: the 95% bound exceeds ε in at most
  # ~5% of trials (here: count them over 200 trials, Binomial(200, 0.05) tail at 20 is < 1e-3).
  rng = np.random.default_rng(0)
  epsilon, m, over = 1.0, 200, 0
  for _ in range(200):
    included = rng.random(m) < 0.5
    truthful = rng.random(m) < math.exp(epsilon) / (1 + math.exp(epsilon))
    scores = np.where(truthful, included, ~included).astype(float)
    r, v = bounds.guess_membership(scores, included, 50, 50, rng)
    over += bounds.epsilon_lower_bound(m, r, v, confidence=0.95) > epsilon
  assert over <= stats.binom.isf(1e-3, 200, 0.05)


def test_guesses_break_ties_at_random():
  included = np.array([True, False] * 50)
  r, v = bounds.guess_membership(np.zeros(100), included, 25, 25, np.random.default_rng(1))
  assert r == 50 and 10 <= v <= 40
  r, v = bounds.guess_membership(included.astype(float), included, 25, 25)
  assert (r, v) == (50, 50)
  with pytest.raises(ValueError):
    bounds.guess_membership(np.zeros(4), np.zeros(4, bool), 3, 3)


def test_gdp_curve_round_trips_and_matches_dp_accounting():
  from dp_accounting.pld import privacy_loss_mechanism
  for epsilon in (0.5, 2.0, 8.0):
    mu = bounds.gdp_mu(epsilon, 1e-5)
    assert bounds.gdp_epsilon(mu, 1e-5) == pytest.approx(epsilon, rel=1e-6)
    # μ-GDP is the Gaussian mechanism with σ = 1/μ (Dong et al. Thm. 2.7): its exact δ(ε)
    # (dp_accounting 0.4 on the legacy leg has no get_sigma_gaussian).
    gaussian = privacy_loss_mechanism.GaussianPrivacyLoss(standard_deviation=1.0 / mu)
    assert gaussian.get_delta_for_epsilon(epsilon) == pytest.approx(1e-5, rel=1e-4)
  assert bounds.gdp_epsilon(0.0, 1e-5) == 0.0


def test_gdp_bound_grows_with_right_guesses_up_to_the_ceiling():
  m, k = 2000, 250
  values = [bounds.gdp_epsilon_lower_bound(m, k, c, 1e-5) for c in (125, 200, 240, 250)]
  assert values[0] == 0.0 and values == sorted(values) and values[-1] > 5
  # Tighter than Steinke et al. on the same guesses.
  assert values[2] > bounds.epsilon_lower_bound(m, k, 240, 1e-5)


def test_gdp_bound_is_valid_for_the_gaussian_mechanism():
  # Each canary's score is N(μ, 1) if in, N(0, 1) if out: exactly μ-GDP, i.e. (ε, δ)-DP at
  # ε = gdp_epsilon(μ, δ). The 95% bound (with its Bonferroni over k) exceeds ε in at most ~5%.
  rng = np.random.default_rng(0)
  mu, delta, m, over, trials = 1.5, 1e-5, 300, 0, 40
  epsilon = bounds.gdp_epsilon(mu, delta)
  for _ in range(trials):
    included = rng.random(m) < 0.5
    scores = {"s": mu * included + rng.standard_normal(m)}
    over += bounds.best_bounds(scores, included, delta, 0.95, rng)["gdp"].epsilon > epsilon
  assert over <= stats.binom.isf(1e-3, trials, 0.05)


def test_best_bounds_reports_the_ceiling_and_the_best_guesses():
  rng = np.random.default_rng(1)
  included = rng.random(400) < 0.5
  result = bounds.best_bounds({"perfect": included.astype(float), "noise": rng.random(400)},
                              included, 1e-5, 0.95, rng)
  gdp = result["gdp"]
  assert gdp.score == "perfect" and gdp.correct == gdp.guesses
  assert gdp.epsilon == pytest.approx(gdp.ceiling)
  assert bounds.guess_counts(400) == [200, 100, 50, 25]
  assert result["steinke"].epsilon <= result["steinke"].ceiling


def test_clopper_pearson_upper_limit_by_hand():
  # 0 of n: the limit solves (1 − p)^n = α; n of n: 1.
  assert bounds.clopper_pearson_upper(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100))
  assert bounds.clopper_pearson_upper(7, 7, 0.05) == 1.0


def test_threshold_error_counts_by_hand():
  false_positives, false_negatives = bounds.threshold_error_counts([1.0, 3.0], [0.0, 2.0])
  # thresholds 0, 1, 2, 3, +inf: "in" if score >= t
  np.testing.assert_array_equal(false_positives, [2, 1, 1, 0, 0])
  np.testing.assert_array_equal(false_negatives, [0, 0, 1, 1, 2])


@pytest.mark.parametrize("mu", [1.0, 2.5])
def test_threshold_estimators_recover_a_known_gaussian_and_stay_below_it(mu):
  """Scores N(μ, 1) for "in" and N(0, 1) for "out" canaries (the μ-GDP mechanism). The GDP
  fit, valid at 95%, stays below ε(μ) in (nearly) every draw, and with 20,000 canaries comes
  within 25% of it; the counting bound stays below ε(μ) too."""
  rng = np.random.default_rng(3)
  delta, over_fit, over_counts, trials = 1e-5, 0, 0, 12
  epsilon = bounds.gdp_epsilon(mu, delta)
  fits = []
  for _ in range(trials):
    in_scores, out_scores = mu + rng.standard_normal(10_000), rng.standard_normal(10_000)
    fits.append(bounds.gdp_fit_epsilon(in_scores, out_scores, delta, 0.95))
    over_fit += fits[-1] > epsilon
    over_counts += bounds.clopper_pearson_epsilon(in_scores, out_scores, delta, 0.95) > epsilon
  assert over_fit <= 2 and over_counts <= 2
  assert np.median(fits) > 0.75 * epsilon


def test_best_bounds_carries_every_estimator():
  rng = np.random.default_rng(2)
  included = rng.random(2_000) < 0.5
  scores = {"signal": 3.0 * included + rng.standard_normal(2_000), "noise": rng.random(2_000)}
  result = bounds.best_bounds(scores, included, 1e-5, 0.95, rng)
  assert set(result) == {"gdp", "steinke", "gdp_fit", "clopper_pearson"}
  for name in ("gdp_fit", "clopper_pearson"):
    assert result[name].score == "signal" and 0 < result[name].epsilon <= result[name].ceiling


def _subsampled_gaussian_scores(claim, canaries, rng):
  """Log-likelihood-ratio scores of `canaries` "in" and as many "out" canaries of the claimed
  mechanism itself: at each step a canary is sampled with the claim's rate, and its coordinate
  is 1 if sampled plus N(0, σ²)."""
  q, sigma = claim.sampling_rate, claim.noise_multiplier

  def scores(inside):
    total = np.zeros(canaries)
    for _ in range(claim.steps):
      x = inside * (rng.random(canaries) < q) + sigma * rng.standard_normal(canaries)
      total += np.log1p(q * np.expm1((2 * x - 1) / (2 * sigma**2)))
    return total

  return scores(1.0), scores(0.0)


def test_family_fit_recovers_a_subsampled_gaussian_and_stays_below_it():
  """Canaries of the claimed mechanism (q = 0.02, T = 50: each canary is sampled in about one
  step, a curve far from Gaussian): the family fit, valid at 95%, stays below the claim's ε in
  (nearly) every draw and reaches over half of it, where the GDP fit reaches much less."""
  rng = np.random.default_rng(5)
  delta, epsilon = 1e-5, 4.0
  sigma = calibrate_noise_multiplier(epsilon, delta, 0.02, 50)
  claim = bounds.SubsampledGaussian(0.02, 50, sigma)
  fits, gdp_fits = [], []
  for _ in range(2):
    in_scores, out_scores = _subsampled_gaussian_scores(claim, 20_000, rng)
    fits.append(bounds.family_fit_epsilon(in_scores, out_scores, delta, 0.95, claim, 8))
    gdp_fits.append(bounds.gdp_fit_epsilon(in_scores, out_scores, delta, 0.95))
  assert max(fits) <= epsilon * 1.02  # the bisection's last step: within 2% of the claim
  assert min(fits) > 0.5 * epsilon and min(fits) > max(gdp_fits)


def test_subsampled_gaussian_tradeoff_is_gaussian_without_sampling():
  # q = 1, T = 1: the Gaussian mechanism at σ is (1/σ)-GDP, f(α) = Φ(Φ⁻¹(1 − α) − 1/σ).
  alpha = np.array([1e-4, 1e-2, 0.1, 0.5])
  curve = bounds.SubsampledGaussian(1.0, 1, 0.8).tradeoff(alpha)
  exact = stats.norm.cdf(stats.norm.ppf(1 - alpha) - 1 / 0.8)
  assert np.all(curve <= exact + 1e-6) and np.allclose(curve, exact, atol=0.02)
