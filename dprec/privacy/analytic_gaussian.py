"""The analytic Gaussian mechanism and its matrix form, aMGM (Balle & Wang 2018; Du et al.,
"DP-Forward: Fine-tuning and Inference on Language Models with Differential Privacy in Forward
Pass", arXiv:2309.06746, §4.2).

One release f(X) + Z with ‖f(X) − f(X')‖_F ≤ S is (ε, δ)-DP iff the exact privacy profile
(Eq. 4, with D = ‖Δ'‖_F = S/σ for i.i.d. noise N(0, σ²))

    g(D) = Φ(D/2 − ε/D) − e^ε Φ(−D/2 − ε/D) ≤ δ,

and g increases with D. Algorithm 1 solves g(ℬ) = δ for the largest admissible D = ℬ, so the
smallest σ is S/ℬ. aMGM (Theorem 6) noises a matrix with Z = U Z' Vᵀ, Z' i.i.d. N(0, 1): it is
(ε, δ)-DP iff S/ℬ ≤ σ_min(U)·σ_min(V), so only the smallest singular values of the row and column
factors matter. The classical σ = √(2 ln(1.25/δ))·S/ε is valid for ε < 1 only (Dwork & Roth
Thm A.1); it is reported beside the analytic one for comparison, with the δ it actually achieves.
"""
import dataclasses
import math

import numpy as np
from scipy import optimize
from scipy import special

from dprec.errors import DprecError

# Root-finding tolerance on Algorithm 1's v*/u* (relative), far below the 1e-6 the tests ask of δ.
_XTOL = 1e-14


def _check(epsilon, delta, sensitivity):
  if not epsilon > 0 or not math.isfinite(epsilon):
    raise DprecError(f"epsilon must be positive and finite, got {epsilon}")
  if not 0 < delta < 1:
    raise DprecError(f"delta must be in (0, 1), got {delta}")
  if not sensitivity > 0:
    raise DprecError(f"sensitivity must be positive, got {sensitivity}")


def _phi_difference(a, b, epsilon):
  """Φ(a) − e^ε Φ(b), the second term in log space so that a large ε does not overflow."""
  return float(special.ndtr(a) - math.exp(epsilon + special.log_ndtr(b)))


def profile(distance, epsilon):
  """g(D) of Eq. 4: the exact δ at ε of a Gaussian release whose whitened shift has norm D."""
  if distance <= 0:
    return 0.0
  return _phi_difference(distance / 2 - epsilon / distance, -distance / 2 - epsilon / distance,
                         epsilon)


def exact_delta(sigma, epsilon, sensitivity=1.0):
  """The smallest δ for which i.i.d. N(0, σ²) noise on a sensitivity-S query is (ε, δ)-DP."""
  return profile(sensitivity / sigma, epsilon)


def _root(function, target, increasing):
  """x ≥ 0 with function(x) = target, for a monotone function; brackets by doubling."""
  high = 1.0
  while (function(high) < target) == increasing:
    high *= 2.0
    if high > 1e300:
      raise DprecError("analytic Gaussian calibration did not bracket its root")
  return optimize.brentq(lambda x: function(x) - target, 0.0, high, xtol=1e-300, rtol=_XTOL)


def distance_bound(epsilon, delta):
  """ℬ = A(ε, δ) of Algorithm 1: the largest ‖Δ'‖_F with g(‖Δ'‖_F) ≤ δ."""
  _check(epsilon, delta, 1.0)
  delta0 = _phi_difference(0.0, -math.sqrt(2 * epsilon), epsilon)
  if delta >= delta0:
    v = _root(lambda v: _phi_difference(math.sqrt(epsilon * v), -math.sqrt(epsilon * (v + 2)),
                                        epsilon), delta, increasing=True)
    alpha = math.sqrt(1 + v / 2) - math.sqrt(v / 2)
  else:
    u = _root(lambda u: _phi_difference(-math.sqrt(epsilon * u), -math.sqrt(epsilon * (u + 2)),
                                        epsilon), delta, increasing=False)
    alpha = math.sqrt(1 + u / 2) + math.sqrt(u / 2)
  return math.sqrt(2 * epsilon) / alpha


def analytic_gaussian_sigma(epsilon, delta, sensitivity=1.0):
  """The smallest σ of i.i.d. Gaussian noise that makes a sensitivity-S release (ε, δ)-DP."""
  _check(epsilon, delta, sensitivity)
  return sensitivity / distance_bound(epsilon, delta)


def classical_gaussian_sigma(epsilon, delta, sensitivity=1.0):
  """σ = √(2 ln(1.25/δ))·S/ε (Du et al. 2023): a valid guarantee only for ε < 1."""
  _check(epsilon, delta, sensitivity)
  return math.sqrt(2 * math.log(1.25 / delta)) * sensitivity / epsilon


@dataclasses.dataclass(frozen=True)
class MatrixGaussian:
  """Noise Z = U Z' Vᵀ on an n×d matrix (Z' i.i.d. N(0, 1)): row covariance U Uᵀ, column
  covariance V Vᵀ; calibrated so that σ_min(U)·σ_min(V) = S/ℬ (Theorem 6)."""
  row_factor: np.ndarray  # U, n×n
  col_factor: np.ndarray  # V, d×d

  def sample(self, rng: np.random.Generator, size=()):
    """Draws `size` noise matrices [*size, n, d] (for tests and numpy users; the Keras layer
    draws from a `tf.random.Generator`)."""
    n, d = len(self.row_factor), len(self.col_factor)
    standard = rng.standard_normal(tuple(size) + (n, d))
    return self.row_factor @ standard @ self.col_factor.T

  def whitened_norm(self, difference):
    """‖U⁻¹ Δ V⁻ᵀ‖_F: the D whose profile g(D) is this pair's exact δ (Lemma 5)."""
    left = np.linalg.solve(self.row_factor, difference)
    return float(np.linalg.norm(np.linalg.solve(self.col_factor, left.T)))


def _factor(covariance, name):
  covariance = np.asarray(covariance, np.float64)
  if covariance.ndim != 2 or covariance.shape[0] != covariance.shape[1]:
    raise DprecError(f"{name} covariance must be a square matrix, got shape {covariance.shape}")
  if not np.allclose(covariance, covariance.T):
    raise DprecError(f"{name} covariance must be symmetric")
  try:
    return np.linalg.cholesky(covariance)
  except np.linalg.LinAlgError as error:
    raise DprecError(f"{name} covariance must be positive definite") from error


def matrix_gaussian(epsilon, delta, sensitivity, row_covariance, col_covariance):
  """aMGM with the given row/column covariance shapes, scaled to the smallest (ε, δ)-DP noise.

  The shapes Σ, Ψ fix the directions and relative sizes; one factor c multiplies U = chol(Σ) so
  that c·σ_min(U)·σ_min(V) = S/ℬ. Identity shapes give i.i.d. noise with the aGM σ (Eq. 6).
  """
  _check(epsilon, delta, sensitivity)
  row, col = _factor(row_covariance, "row"), _factor(col_covariance, "column")
  smallest = (np.linalg.svd(row, compute_uv=False)[-1] *
              np.linalg.svd(col, compute_uv=False)[-1])
  scale = sensitivity / distance_bound(epsilon, delta) / smallest
  return MatrixGaussian(scale * row, col)


def calibration_report(epsilon, delta, sensitivity=1.0):
  """aGM σ next to the classical σ, with the exact δ each achieves (`dprec privacy agm`)."""
  sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity)
  classical = classical_gaussian_sigma(epsilon, delta, sensitivity)
  return {
      "epsilon": epsilon, "delta": delta, "sensitivity": sensitivity,
      "sigma": sigma, "noise_multiplier": sigma / sensitivity,
      "exact_delta": exact_delta(sigma, epsilon, sensitivity),
      "classical_sigma": classical,
      "classical_exact_delta": exact_delta(classical, epsilon, sensitivity),
      "classical_valid": exact_delta(classical, epsilon, sensitivity) <= delta,
      "ratio": sigma / classical,
  }
