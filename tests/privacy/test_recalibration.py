"""`dprec.privacy.dp_platt_scaling`: DP Platt scaling of a classifier's logits."""
import math

import numpy as np
import pytest

from dprec.errors import DprecError
from dprec.privacy import dp_platt_scaling
from dprec.privacy import recalibration


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_exact_fit_meets_the_maximum_likelihood_conditions():
  rng = np.random.default_rng(1)
  logits = rng.normal(-4.0, 2.0, 20000)  # ranked, too low and too spread (C2 = 1 training)
  labels = (rng.random(20000) < _sigmoid(0.4 * logits + 0.5)).astype(float)
  scale, shift = dp_platt_scaling(logits, labels, 0.0, 0.3, prior_examples=0)
  residual = _sigmoid(scale * logits + shift) - labels  # all |logits| < 10: no clipping
  assert abs(residual.mean()) < 1e-5 and abs((residual * logits).mean()) < 1e-4
  assert scale == pytest.approx(0.4, abs=0.03) and shift == pytest.approx(0.5, abs=0.1)


def test_a_pure_offset_is_undone():
  rng = np.random.default_rng(2)
  logits = rng.normal(-4.0, 1.0, 20000)
  labels = (rng.random(20000) < _sigmoid(logits + 3.0)).astype(float)
  scale, shift = dp_platt_scaling(logits, labels, 0.0, 0.3, prior_examples=0)
  assert scale == pytest.approx(1.0, abs=0.05) and shift == pytest.approx(3.0, abs=0.15)


def test_centring_keeps_the_slope_of_narrow_logits_under_the_stream_noise():
  # A DP stream's logits (docs/experiments/streaming.md): a narrow band around the base rate's
  # logit, σ_c of 10% of ε = 1 per period, 25k rows. Uncentred with L = 10, u is a sliver of
  # [−1, 1], the variance floor swamps it and the slope stays near the floor; centred at
  # logit(r) with L = 1 the fit finds it. Centring moves nothing else: (a, b) apply to z.
  rng = np.random.default_rng(3)
  rate, n = 0.25, 25000
  center = math.log(rate / (1 - rate))
  logits = rng.normal(center, 0.2, n)
  labels = (rng.random(n) < _sigmoid(2.0 * (logits - center) + center)).astype(float)
  wide, _ = dp_platt_scaling(logits, labels, 40.0, rate, np.random.default_rng(4))
  scale, _ = dp_platt_scaling(logits, labels, 40.0, rate, np.random.default_rng(4),
                              logit_bound=1.0, center=center)
  assert wide < 0.1 and scale > 0.6  # (0.03 and 0.99: the prior of 10k rows pulls it too)
  exact = dp_platt_scaling(logits, labels, 0.0, rate, logit_bound=1.0, center=center,
                           prior_examples=0)
  assert exact[0] == pytest.approx(2.0, abs=0.15) and exact[1] == pytest.approx(-center, abs=0.1)
  residual = _sigmoid(exact[0] * logits + exact[1]) - labels  # |z − c| < 1 almost everywhere
  assert abs(residual.mean()) < 1e-3


def test_noise_of_the_estimate_is_what_the_composed_sigma_gives():
  # Two groups at u = ±1/2 whose click rates (0.184, 0.816) make p(1 − p) = 0.15 = c at the
  # fit: every round then lands on the fixed point plus (c·M)⁻¹ times its own noise, and the mean
  # of the last T/2 rounds has std √2·σ·√(T + 1)/(c·N·√(T/2)) in b (M = diag(1/4, 1)), four
  # times that in the slope α = L·a: a wrong per-round scale (σ instead of σ·√(T + 1)) misses
  # it by √21.
  n, sigma, steps, bound = 4000, 1.0, recalibration.STEPS, recalibration.LOGIT_BOUND
  rate = 0.5 - math.sqrt(0.25 - recalibration.CURVATURE)
  logits = np.repeat([-bound / 2, bound / 2], n // 2)
  half = np.arange(n // 2)
  labels = np.concatenate([half < rate * n / 2, half < (1 - rate) * n / 2]).astype(float)
  fits = np.array([dp_platt_scaling(logits, labels, sigma, 0.5, np.random.default_rng(seed),
                                    prior_examples=0) for seed in range(200)])
  shift_std = (math.sqrt(2) * sigma * math.sqrt(steps + 1)
               / (recalibration.CURVATURE * n * math.sqrt(steps / 2)))
  assert np.std(fits[:, 1]) == pytest.approx(shift_std, rel=0.15)
  assert np.std(fits[:, 0] * bound) == pytest.approx(4 * shift_std, rel=0.15)
  exact = dp_platt_scaling(logits, labels, 0.0, 0.3, prior_examples=0)
  np.testing.assert_allclose(fits.mean(axis=0), exact, atol=4 * shift_std)


def test_the_prior_pulls_few_rows_to_the_base_rate_and_many_to_the_data():
  """The fit is the maximum a posteriori one: the log loss's gradient equals the prior's pull
  n0·c·M·(w0 − w) (u = z/L, w = (α, β), w0 = (0, logit r)); n0 = 10,000 keeps 1,000 rows near
  the base rate and moves 1,000,000 rows almost all the way to the maximum-likelihood fit."""
  rng = np.random.default_rng(3)
  logits = rng.normal(-4.0, 1.0, 1_000_000)
  labels = (rng.random(logits.size) < _sigmoid(logits + 3.0)).astype(float)
  rate, bound = 0.3, recalibration.LOGIT_BOUND
  start = np.array([0.0, math.log(rate / (1 - rate))])
  for n, within in ((1000, lambda fit, free: abs(fit) < 0.15 * abs(free)),
                    (1_000_000, lambda fit, free: abs(fit - free) < 0.02 * abs(free))):
    z, y = logits[:n], labels[:n]
    scale, shift = dp_platt_scaling(z, y, 0.0, rate)
    weights, u = np.array([scale * bound, shift]), z / bound
    residual = _sigmoid(weights[0] * u + weights[1]) - y
    moments = np.array([[np.mean(u * u), np.mean(u)], [np.mean(u), 1.0]])
    prior = recalibration.PRIOR_EXAMPLES / n * recalibration.CURVATURE * moments
    np.testing.assert_allclose([np.mean(residual * u), np.mean(residual)],
                               prior @ (start - weights), atol=1e-6)
    assert within(scale, dp_platt_scaling(z, y, 0.0, rate, prior_examples=0)[0])


def test_a_level_prior_pulls_the_mean_logit_and_leaves_the_scale_to_the_data():
  """`level_prior_examples` n1 (no affine prior): the fit is the maximum a posteriori one under
  the penalty n1·c/2·(α·ū + β − logit r)² only, so the log loss's gradient equals
  n1·c·[ū, 1]·(logit r − α·ū − β)/N and the residual is uncorrelated with u − ū (the scale is
  the data's), while the affine prior of the same weight also shrinks the scale."""
  rng = np.random.default_rng(4)
  n, rate = 20000, 0.3
  logits = rng.normal(-1.0, 0.3, n)
  labels = (rng.random(n) < _sigmoid(2.0 * (logits + 1.0) - 1.5)).astype(float)
  center = math.log(rate / (1 - rate))
  scale, shift = dp_platt_scaling(logits, labels, 0.0, rate, logit_bound=1.0, center=center,
                                  prior_examples=0, level_prior_examples=50000)
  u = np.clip(logits - center, -1.0, 1.0)
  alpha, beta = scale, shift + scale * center  # σ(α·u + β)
  residual = _sigmoid(alpha * u + beta) - labels
  mean_u = u.mean()
  pull = 50000 / n * recalibration.CURVATURE * (center - alpha * mean_u - beta)
  np.testing.assert_allclose([np.mean(residual * u), np.mean(residual)],
                             [pull * mean_u, pull], atol=1e-6)
  np.testing.assert_allclose(np.mean(residual * (u - mean_u)), 0.0, atol=1e-6)
  affine = dp_platt_scaling(logits, labels, 0.0, rate, logit_bound=1.0, center=center,
                            prior_examples=50000)[0]
  free = dp_platt_scaling(logits, labels, 0.0, rate, logit_bound=1.0, center=center,
                          prior_examples=0)[0]
  assert affine < 0.6 * free and abs(pull) > 0.01  # the affine prior shrinks the scale


def test_the_scales_floor_keeps_the_fitted_level():
  """Logits that rank backwards: the scale is floored at `MIN_SCALE` (the ranking is kept), and
  the shift moves so that the logit at the mean feature is the fit's, not shifted by the
  discarded part of the scale."""
  rng = np.random.default_rng(5)
  n, rate = 20000, 0.3
  center = math.log(rate / (1 - rate))
  logits = rng.normal(center - 0.5, 0.2, n)  # u = z − c ≈ −0.5: without the fix, off by ~0.5
  labels = (rng.random(n) < _sigmoid(-1.0 * (logits - center + 0.5) - 0.8)).astype(float)
  scale, shift = dp_platt_scaling(logits, labels, 0.0, rate, logit_bound=1.0, center=center,
                                  prior_examples=0)
  assert scale == recalibration.MIN_SCALE
  u = np.clip(logits - center, -1.0, 1.0)
  level = scale * (u.mean() + center) + shift  # the output's logit at the mean feature
  assert level == pytest.approx(math.log(labels.mean() / (1 - labels.mean())), abs=0.02)


def test_noise_comes_from_the_given_generator():
  labels = (np.arange(500) % 3 == 0).astype(float)
  logits = np.random.default_rng(2).normal(-1.0, 1.0, 500)
  first, again, other = (dp_platt_scaling(logits, labels, 3.0, 0.3, np.random.default_rng(seed))
                         for seed in (7, 7, 8))
  assert first == again and first != other


@pytest.mark.parametrize("logits, labels, sigma, rate, steps", [
    ([0.0, 1.0], [1.0], 1.0, 0.5, 10),
    ([], [], 1.0, 0.5, 10),
    ([0.0], [1.0], -1.0, 0.5, 10),
    ([0.0], [1.0], 1.0, 0.5, 0),
    ([0.0], [1.0], 1.0, 1.0, 10),
])
def test_bad_input_is_refused(logits, labels, sigma, rate, steps):
  with pytest.raises(DprecError):
    dp_platt_scaling(logits, labels, sigma, rate, steps=steps)
