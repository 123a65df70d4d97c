"""DP recalibration of a binary classifier's logit level (issue 14): the shift b of every logit
that makes the mean predicted probability equal the label mean on the training examples,
mean_i σ(z_i + b) = mean_i y_i (the maximum-likelihood logit bias, i.e. Platt scaling with the
scale fixed at 1).

Why a DP pCTR model needs it: DP-SGD with a clip C2 below the typical per-example gradient norm
clips every example to the same norm, so the logit's clipped gradient is C2·sign(p − y) times a
unit direction and training balances the logit level at the label *median* instead of its mean;
the ranking (AUC) survives, the probabilities do not (BENCHMARKS.md, "Calibrated DP pCTR").

The mechanism: T rounds, each releasing D_t = Σ_i (σ(z_i + b_t) − y_i) + N(0, σ_step²) over
the N training examples (sensitivity 1 for adding or removing one example: σ(·) − y ∈ [−1, 1];
N is public), then

    b_{t+1} = b_t + logit(r) − logit(r + D_t / N),

with r the (DP) base rate. Without noise this is a fixed-point step on G(b) = logit(mean σ(z_i+b))
whose slope G' = mean p(1 − p) / (F(1 − F)) lies in (0, 1] (Jensen), so it converges
monotonically from any start, in one step when the logits differ by a constant; its fixed point
is D = 0, the exact condition above (r only sets the step, its noise does not move the fixed
point). The estimate is the mean of the last half of the iterates (Polyak–Ruppert), whose noise is
within about √2 of one release with all the budget. T Gaussian mechanisms of σ_step compose to
exactly one Gaussian mechanism of σ_step/√T (Gaussian DP, Dong, Roth & Su 2019, Cor. 3.3), which
is the noise multiplier to calibrate and charge.
"""
import math

import numpy as np

from dprec.errors import DprecError

STEPS = 20  # T: the last 10 rounds averaged are converged to < 1e-5 at a contraction of 0.3


def _logit(p):
  return math.log(p) - math.log1p(-p)


def dp_logit_shift(logits, labels, noise_multiplier, base_rate, rng=None, steps=STEPS) -> float:
  """The DP logit shift b (module docstring) of classifier logits `logits` [N] for 0/1 `labels`
  [N], at composed noise multiplier `noise_multiplier` (each of the `steps` rounds adds
  N(0, (noise_multiplier·√steps)²) to its sum; 0: exact). `base_rate` in (0, 1) sets the step
  (use the DP or public click rate). `rng` (numpy Generator) must be secret in a private run."""
  logits = np.asarray(logits, np.float64).reshape(-1)
  labels = np.asarray(labels, np.float64).reshape(-1)
  if logits.shape != labels.shape or not logits.size:
    raise DprecError(f"need as many logits as labels (> 0), got {logits.size} and {labels.size}")
  if not 0 < base_rate < 1:
    raise DprecError(f"base_rate must be in (0, 1), got {base_rate}")
  if not noise_multiplier >= 0 or steps < 1:
    raise DprecError(f"need noise_multiplier >= 0 and steps >= 1, got {noise_multiplier}, {steps}")
  n = logits.size
  step_sigma = noise_multiplier * math.sqrt(steps)
  rng = rng if rng is not None else np.random.default_rng()
  target, floor = _logit(base_rate), 0.5 / n  # keeps r + D/N inside (0, 1)
  shift, iterates = 0.0, []
  for _ in range(steps):
    residual = float(np.sum(_sigmoid(logits + shift) - labels))
    if step_sigma:
      residual += step_sigma * rng.normal()
    mean_prediction = min(max(base_rate + residual / n, floor), 1.0 - floor)
    shift += target - _logit(mean_prediction)
    iterates.append(shift)
  return float(np.mean(iterates[steps // 2:]))


def _sigmoid(x):
  return 0.5 * (1.0 + np.tanh(0.5 * x))
