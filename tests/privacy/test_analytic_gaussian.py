"""The analytic Gaussian mechanism (Du et al., "DP-Forward: Fine-tuning and Inference on Language
Models with Differential Privacy in Forward Pass", arXiv:2309.06746, §4.2): exact condition,
classical σ, dp_accounting."""
import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from scipy import stats

import dprec.cli
from dprec.errors import DprecError
from dprec.privacy import analytic_gaussian as agm


def brute_force_delta(sigma, epsilon, sensitivity):
  """δ(ε) = Φ(S/2σ − εσ/S) − e^ε Φ(−S/2σ − εσ/S) straight from scipy (Du et al. 2023)."""
  a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
  return stats.norm.cdf(a - b) - math.exp(epsilon) * stats.norm.cdf(-a - b)


@pytest.mark.parametrize("epsilon,delta,sensitivity", [
    (1.0, 1e-5, 1.0), (0.1, 1e-6, 2.0), (8.0, 1e-5, 2.0), (16.0, 1e-5, 2.0),
    (0.5, 0.4, 1.0),  # δ ≥ δ0: the other branch of Algorithm 1
])
def test_sigma_meets_the_exact_condition_and_no_smaller_sigma_does(epsilon, delta, sensitivity):
  sigma = agm.analytic_gaussian_sigma(epsilon, delta, sensitivity)
  assert brute_force_delta(sigma, epsilon, sensitivity) == pytest.approx(delta, rel=1e-6)
  assert brute_force_delta(sigma * (1 - 1e-4), epsilon, sensitivity) > delta


def test_both_branches_are_exercised():
  delta0 = lambda eps: stats.norm.cdf(0) - math.exp(eps) * stats.norm.cdf(-math.sqrt(2 * eps))
  assert 0.4 >= delta0(0.5) and 1e-5 < delta0(1.0)


def test_analytic_sigma_is_smaller_than_classical_at_epsilon_one():
  sigma = agm.analytic_gaussian_sigma(1.0, 1e-5, 1.0)
  classical = agm.classical_gaussian_sigma(1.0, 1e-5, 1.0)
  assert sigma < classical
  # Du et al. 2023 (S = 2): 7.461 vs 9.690.
  assert 2 * sigma == pytest.approx(7.461, abs=1e-3)
  assert 2 * classical == pytest.approx(9.690, abs=1e-3)


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 0.9])
def test_classical_sigma_satisfies_the_condition_below_epsilon_one(epsilon):
  classical = agm.classical_gaussian_sigma(epsilon, 1e-5, 1.0)
  assert brute_force_delta(classical, epsilon, 1.0) <= 1e-5
  assert agm.analytic_gaussian_sigma(epsilon, 1e-5, 1.0) <= classical


def test_classical_sigma_violates_delta_at_large_epsilon():
  report = agm.calibration_report(12.0, 1e-5, 2.0)
  assert not report["classical_valid"] and report["classical_exact_delta"] > 1e-5
  assert report["exact_delta"] == pytest.approx(1e-5, rel=1e-6)


def test_small_epsilon_limit():
  """ε → 0: ℬ → 2Φ⁻¹((1 + δ)/2) (Du et al. 2023, §4.2)."""
  assert agm.distance_bound(1e-10, 1e-5) == pytest.approx(
      2 * stats.norm.ppf((1 + 1e-5) / 2), rel=1e-3)


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_dp_accounting_pld_gives_back_epsilon(epsilon):
  sigma = agm.analytic_gaussian_sigma(epsilon, 1e-5, 2.0)
  pld = privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=sigma, sensitivity=2.0, value_discretization_interval=1e-4)
  assert pld.get_epsilon_for_delta(1e-5) == pytest.approx(epsilon, rel=1e-3)
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(sigma / 2.0))
  assert accountant.get_epsilon(1e-5) == pytest.approx(epsilon, rel=1e-3)


def test_matrix_gaussian_identity_shapes_reduce_to_iid_agm():
  noise = agm.matrix_gaussian(1.0, 1e-5, 2.0, np.eye(3), np.eye(4))
  sigma = agm.analytic_gaussian_sigma(1.0, 1e-5, 2.0)
  np.testing.assert_allclose(noise.row_factor * noise.col_factor[0, 0], sigma * np.eye(3))
  np.testing.assert_allclose(noise.col_factor, np.eye(4))


def test_matrix_gaussian_worst_case_shift_meets_delta_exactly():
  """Theorem 6: the worst Δ (‖Δ‖_F = S along the smallest singular directions) hits δ; random
  Δ of the same norm stay below it; the sample covariance is Σ ⊗ Ψ."""
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(3, 3)), rng.normal(size=(2, 2))
  row_cov, col_cov = a @ a.T + 0.5 * np.eye(3), b @ b.T + 0.5 * np.eye(2)
  noise = agm.matrix_gaussian(2.0, 1e-5, 1.0, row_cov, col_cov)
  u_vecs, v_vecs = np.linalg.svd(noise.row_factor)[0], np.linalg.svd(noise.col_factor)[0]
  worst = np.outer(u_vecs[:, -1], v_vecs[:, -1])  # ‖worst‖_F = 1 = S
  assert agm.profile(noise.whitened_norm(worst), 2.0) == pytest.approx(1e-5, rel=1e-6)
  for _ in range(20):
    shift = rng.normal(size=(3, 2))
    shift /= np.linalg.norm(shift)
    assert agm.profile(noise.whitened_norm(shift), 2.0) <= 1e-5 * (1 + 1e-9)
  samples = noise.sample(rng, (40000,)).reshape(40000, -1)
  expected = np.kron(noise.row_factor @ noise.row_factor.T, noise.col_factor @ noise.col_factor.T)
  np.testing.assert_allclose(np.cov(samples.T), expected, atol=0.03 * np.abs(expected).max())


def test_bad_input_is_a_clear_error():
  with pytest.raises(DprecError, match="epsilon"):
    agm.analytic_gaussian_sigma(0.0, 1e-5)
  with pytest.raises(DprecError, match="positive definite"):
    agm.matrix_gaussian(1.0, 1e-5, 1.0, np.zeros((2, 2)), np.eye(2))


def test_agm_command(capsys):
  code = dprec.cli.main(["privacy", "agm", "--epsilon", "1", "--delta", "1e-5",
                         "--sensitivity", "1"])
  out = json.loads(capsys.readouterr().out)
  assert code == 0
  assert out["sigma"] == pytest.approx(agm.analytic_gaussian_sigma(1.0, 1e-5, 1.0), rel=1e-12)
  assert out["classical_sigma"] == pytest.approx(math.sqrt(2 * math.log(1.25e5)), rel=1e-12)
  assert out["sigma"] < out["classical_sigma"] and out["classical_valid"]
