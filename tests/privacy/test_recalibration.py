"""`dprec.privacy.dp_logit_shift`: the DP recalibration of a classifier's logit level."""
import math

import numpy as np
import pytest

from dprec.errors import DprecError
from dprec.privacy import dp_logit_shift


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _labels(n, rate, seed=0):
  labels = np.zeros(n)
  labels[np.random.default_rng(seed).choice(n, int(rate * n), replace=False)] = 1.0
  return labels


def test_exact_shift_solves_mean_prediction_equals_label_mean():
  rng = np.random.default_rng(1)
  logits = rng.normal(-4.0, 1.0, 5000)  # ranked, but far too low (like C2 = 1 training)
  labels = (rng.random(5000) < _sigmoid(logits + 2.5)).astype(float)
  shift = dp_logit_shift(logits, labels, 0.0, base_rate=0.3)  # the rate only sets the step
  assert np.mean(_sigmoid(logits + shift)) == pytest.approx(labels.mean(), abs=1e-6)
  assert shift == pytest.approx(2.5, abs=0.15)


def test_constant_offset_is_undone_in_one_round():
  labels = _labels(1000, 0.25)
  logits = np.full(1000, math.log(0.25 / 0.75) - 3.0)
  assert dp_logit_shift(logits, labels, 0.0, 0.25, steps=1) == pytest.approx(3.0, abs=1e-12)


def test_noise_of_the_estimate_is_what_the_composed_sigma_gives():
  # Equal logits: every round lands on the fixed point plus its own noise, so the mean of the
  # last T/2 iterates has std σ·√T/(N·r(1 − r))/√(T/2) = √2·σ/(N·r(1 − r)), σ the composed σ
  # (each round adds σ·√T): a wrong per-round scale (σ, or σ·T) would miss it by √T or more.
  n, rate, sigma = 10000, 0.25, 5.0
  labels = _labels(n, rate)
  logits = np.full(n, math.log(rate / (1 - rate)))
  shifts = [dp_logit_shift(logits, labels, sigma, rate, np.random.default_rng(seed))
            for seed in range(400)]
  expected = math.sqrt(2) * sigma / (n * rate * (1 - rate))
  assert np.mean(shifts) == pytest.approx(0.0, abs=4 * expected / math.sqrt(400))
  assert np.std(shifts) == pytest.approx(expected, rel=0.15)


def test_noise_comes_from_the_given_generator():
  labels = _labels(500, 0.3)
  logits = np.random.default_rng(2).normal(-1.0, 1.0, 500)
  first, again, other = (dp_logit_shift(logits, labels, 3.0, 0.3, np.random.default_rng(seed))
                         for seed in (7, 7, 8))
  assert first == again and first != other


@pytest.mark.parametrize("logits, labels, sigma, rate, steps", [
    ([0.0, 1.0], [1.0], 1.0, 0.5, 10),
    ([], [], 1.0, 0.5, 10),
    ([0.0], [1.0], 1.0, 0.0, 10),
    ([0.0], [1.0], -1.0, 0.5, 10),
    ([0.0], [1.0], 1.0, 0.5, 0),
])
def test_bad_input_is_refused(logits, labels, sigma, rate, steps):
  with pytest.raises(DprecError):
    dp_logit_shift(logits, labels, sigma, rate, steps=steps)
