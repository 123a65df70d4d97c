"""DP Platt scaling: recalibrate a binary classifier's logits z as a·z + b, with a and
b fitted on the training examples by maximum likelihood under DP.

Why a DP pCTR model needs it: DP-SGD with a clip C2 below the typical per-example gradient norm
clips every example to the same norm, so the logit's clipped gradient is C2·sign(p − y) times a
unit direction: training balances the logit level at the label *median* instead of its mean, and
noise spreads the logits; the ranking (AUC) survives, the probabilities do not (BENCHMARKS.md,
"Calibrated DP pCTR").

The mechanism, on the bounded feature u = clip(z, −L, L)/L (so a = α/L, b = β for |z| ≤ L):
1. one release of the moments (Σ u_i, Σ u_i²) + noise, giving M̂ ≈ mean [u, 1]ᵀ[u, 1];
2. T rounds, each releasing g_t = Σ_i (σ(α u_i + β) − y_i)·(u_i, 1) + noise and stepping
   w ← w − P⁻¹ (g_t + n0·c·M̂ (w − w0)) / N with P = c·M̂·(1 + n0/N), starting from the
   (DP) base rate w0 = (α, β) = (0, logit r): Newton-like steps on the log loss plus a prior
   worth n0 examples that predict the base rate (maximum a posteriori; Platt 1999 smooths its
   targets against the same small-sample overfitting), so with few rows the fit stays near the
   base rate and with many it is the maximum-likelihood fit;
3. the estimate is the mean of the last half of the iterates (Polyak–Ruppert).
A second prior, worth n1 = `level_prior_examples` rows, pulls only the level, the logit at the
mean feature (α·ū + β, ū from the released M̂), towards logit r: the fixed point is the maximum
a posteriori fit under the added penalty n1·c/2·(α·ū + β − logit r)² (step 2's n0·c·M̂/N becomes
n0·c·M̂/N + n1·c·[ū, 1]ᵀ[ū, 1]/N in the gradient and P); the releases are the same. A stream
fits on one period and predicts the next, after the click rate moved (docs/experiments/
streaming.md). The scale's floor keeps the fitted level (β moves by (α − α_floor)·ū).
Each release has L2 sensitivity √2 for adding or removing one example (|u| ≤ 1, |σ − y| ≤ 1; N
is public) and noise N(0, 2σ_step²) per coordinate; the T + 1 releases compose to exactly one
Gaussian mechanism with noise multiplier σ_step/√(T + 1) (Gaussian DP, Dong, Roth & Su 2019,
Cor. 3.3): the σ to calibrate and charge. The log loss's Hessian is mean p(1 − p)[u, 1]ᵀ[u, 1] ≼
M/4, so with c = 0.15 > 1/8 every step is stable (the step's eigenvalues stay below 0.25/c < 2)
and near a calibrated fit at a click rate of 0.2–0.3 (p(1 − p) ≈ 0.16–0.21) it is almost Newton's;
the fixed point is the exact maximum a posteriori condition whatever P is. M̂'s variance is
floored at ten times the noise's standard deviation over N (public) so that P stays positive.
"""
import math
from typing import Tuple

import numpy as np

from dprec.errors import DprecError

STEPS = 20  # T: the last 10 rounds averaged are converged on DP pCTR logits (BENCHMARKS.md)
LOGIT_BOUND = 10.0  # L: logits beyond ±10 (p < 5e-5) count as ±10 in the fit
CURVATURE = 0.15  # c: the preconditioner's p(1 − p), > 1/8 so that no step overshoots twofold
NOISE_FLOOR = 10.0  # M̂'s variance is at least this many noise standard deviations over N
PRIOR_EXAMPLES = 10000  # n0: the base rate's weight (a 2.5% pull at 400k rows, 91% at 1k)
MIN_SCALE = 0.01  # a ≤ 0 (noise, at a few thousand rows) would reverse or erase the ranking


def dp_platt_scaling(logits, labels, noise_multiplier, base_rate, rng=None, steps=STEPS,
                     logit_bound=LOGIT_BOUND, prior_examples=PRIOR_EXAMPLES,
                     center=0.0, level_prior_examples=0.0) -> Tuple[float, float]:
  """(a, b) of DP Platt scaling σ(a·z + b) (module docstring) for classifier logits `logits`
  [N] and 0/1 `labels` [N], at composed noise multiplier `noise_multiplier` (each of the
  `steps` + 1 releases adds N(0, 2·noise_multiplier²·(steps + 1)) per coordinate; 0: exact),
  from and towards the constant prediction `base_rate` in (0, 1) (a DP or public click rate)
  with the weight of `prior_examples` examples (0: maximum likelihood).
  `rng` (a numpy Generator) must be secret in a private run. The scale is at least `MIN_SCALE`
  (post-processing), so the ranking is kept. `center` c (public or DP, e.g. logit(base_rate)):
  the feature is u = clip(z − c, −L, L)/L instead, so logits that sit in a narrow band away
  from 0 are not a sliver of [−L, L] (whose variance the noise floor swamps); the sensitivity
  is the same, and (a, b) still apply to z. `level_prior_examples`: the weight of a second
  prior that pulls only the level, the logit at the mean feature, towards logit(base_rate)
  (module docstring)."""
  logits = np.asarray(logits, np.float64).reshape(-1)
  labels = np.asarray(labels, np.float64).reshape(-1)
  if logits.shape != labels.shape or not logits.size:
    raise DprecError(f"need as many logits as labels (> 0), got {logits.size} and {labels.size}")
  if not 0 < base_rate < 1:
    raise DprecError(f"base_rate must be in (0, 1), got {base_rate}")
  if (not noise_multiplier >= 0 or steps < 1 or not logit_bound > 0 or prior_examples < 0
      or level_prior_examples < 0):
    raise DprecError(f"need noise_multiplier >= 0, steps >= 1, logit_bound > 0 and "
                     f"prior_examples, level_prior_examples >= 0, got {noise_multiplier}, "
                     f"{steps}, {logit_bound}, {prior_examples}, {level_prior_examples}")
  n = logits.size
  rng = rng if rng is not None else np.random.default_rng()
  noise_std = math.sqrt(2.0) * noise_multiplier * math.sqrt(steps + 1)  # per coordinate

  def release(vector):
    return (vector + noise_std * rng.normal(size=2)) / n if noise_std else vector / n

  u = np.clip(logits - center, -logit_bound, logit_bound) / logit_bound
  mean_u, mean_u2 = release(np.array([u.sum(), np.square(u).sum()]))
  mean_u = float(np.clip(mean_u, -1.0, 1.0))
  variance = max(mean_u2 - mean_u ** 2, NOISE_FLOOR * noise_std / n, 1e-12)
  curvature = CURVATURE * np.array([[variance + mean_u ** 2, mean_u], [mean_u, 1.0]])
  level = np.array([mean_u, 1.0])  # the logit at the mean feature is level @ (α, β)
  prior = (prior_examples * curvature
           + level_prior_examples * CURVATURE * np.outer(level, level)) / n
  start = np.array([0.0, math.log(base_rate) - math.log1p(-base_rate)])
  weights, iterates = start, []
  for _ in range(steps):
    residual = _sigmoid(weights[0] * u + weights[1]) - labels
    gradient = release(np.array([residual @ u, residual.sum()])) + prior @ (weights - start)
    weights = weights - np.linalg.solve(curvature + prior, gradient)
    iterates.append(weights)
  alpha, beta = np.mean(iterates[steps // 2:], axis=0)
  scale = max(float(alpha / logit_bound), MIN_SCALE)
  beta += (alpha - scale * logit_bound) * mean_u  # the floor keeps the level α·ū + β
  return scale, float(beta) - scale * center  # σ(a·(z − c) + β) = σ(a·z + β − a·c)


def _sigmoid(x):
  return 0.5 * (1.0 + np.tanh(0.5 * x))


MIN_VARIANCE_STDS = 10.0  # the predictions' DP variance is floored at this many noise stds / N


def dp_affine_recalibration(predictions, labels, label_range, noise_multiplier,
                            rng=None) -> Tuple[float, float]:
  """(a, b) of the least-squares fit y ≈ a·z + b of labels on a regression model's predictions
  z, under DP: with both clipped to the (public or DP) `label_range` [lo, hi] and centred at
  c = (lo + hi)/2, so |z − c|, |y − c| ≤ R = (hi − lo)/2, one release of the sums of
  (z, y, z², z·y) (centred), whose L2 sensitivity is R·√(2 + 2R²), with N(0, (σ·R·√(2 + 2R²))²)
  per coordinate; a = cov(z, y)/var(z) (the variance floored at `MIN_VARIANCE_STDS` noise
  standard deviations over N), at least `MIN_SCALE` so the ranking is kept. Why a DP
  regression model needs it: clipping pulls its output towards the label median, and noise
  spreads its predictions (docs/experiments/make_private.md)."""
  z = np.asarray(predictions, np.float64).reshape(-1)
  y = np.asarray(labels, np.float64).reshape(-1)
  if z.shape != y.shape or not z.size:
    raise DprecError(f"need as many predictions as labels (> 0), got {z.size} and {y.size}")
  if not noise_multiplier >= 0:
    raise DprecError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
  lo, hi = map(float, label_range)
  center, radius = (lo + hi) / 2, (hi - lo) / 2
  z, y = np.clip(z, lo, hi) - center, np.clip(y, lo, hi) - center
  sums = np.array([z.sum(), y.sum(), (z * z).sum(), (z * y).sum()])
  noise_std = noise_multiplier * radius * math.sqrt(2 + 2 * radius ** 2)
  if noise_std:
    rng = rng if rng is not None else np.random.default_rng()
    sums += noise_std * rng.normal(size=4)
  n = z.size
  mean_z, mean_y, mean_zz, mean_zy = sums / n
  variance = max(mean_zz - mean_z ** 2, MIN_VARIANCE_STDS * noise_std / n, 1e-12)
  scale = max((mean_zy - mean_z * mean_y) / variance, MIN_SCALE)
  shift = mean_y - scale * mean_z
  # back to uncentred predictions: y − c ≈ a·(z − c) + s
  return float(scale), float(center + shift - scale * center)
