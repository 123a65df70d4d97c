"""The white-box audit against deliberately broken DP steps (test-only substitutions, never
options): each broken step's bound exceeds the claimed ε by every estimator (one-run f-DP and
Steinke, GDP fit, counting bound), the correct step's stays at or below by every one; at the user
level too, where canaries are users of k rows clipped as one."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.audit import bounds
from dprec.audit import white_box
from dprec.clipping import units
from dprec.optimizers import config as config_lib
from dprec.privacy import calibrate_noise_multiplier
from dprec.privacy_unit import UNIT_KEY
from dprec.sparse import gaussian
from dprec.sparse import selection

EPSILON, DELTA, RATE, STEPS, CANARIES, CLIP = 1.0, 1e-5, 0.5, 10, 4000, 1.0
SIGMA = calibrate_noise_multiplier(EPSILON, DELTA, RATE, STEPS)


def _config(algorithm):
  if algorithm == "dp_sgd":
    return config_lib.DPSGD(CLIP, SIGMA)
  # τ below a lone canary's count (1): kept when sampled unless the noise says otherwise.
  return config_lib.DPAdaFEST.from_noise_multiplier(CLIP, SIGMA, contribution_clip=1.0,
                                                    threshold=0.5)


ESTIMATORS = ("gdp", "steinke", "gdp_fit", "clopper_pearson")


def _bounds(algorithm):
  rng = np.random.default_rng()
  scores, included = white_box.run_canaries(_config(algorithm), CANARIES, RATE, STEPS, 64.0, rng)
  return bounds.best_bounds(scores, included, DELTA, 0.95, rng)


def _caught(result):
  """The estimators whose bound exceeds the claim."""
  return {name for name, bound in result.items() if bound.epsilon > EPSILON}


@pytest.mark.parametrize("algorithm", ["dp_sgd", "dp_adafest"])
def test_correct_step_stays_below_its_claim(algorithm):
  result = _bounds(algorithm)
  assert not _caught(result)
  assert all(0.0 <= result[name].epsilon <= EPSILON < result[name].ceiling
             for name in ("gdp", "gdp_fit"))


def test_noise_divided_by_four_is_caught(monkeypatch):
  noise_std = config_lib.noise_std
  monkeypatch.setattr(config_lib, "noise_std", lambda clip, sigma: noise_std(clip, sigma) / 4)
  assert _caught(_bounds("dp_sgd")) == set(ESTIMATORS)


def test_skipped_clipping_is_caught(monkeypatch):
  monkeypatch.setattr(config_lib.DPSGD, "clip_factors",
                      lambda self, squared_norms, share=1.0, clip=None: tf.ones_like(squared_norms))
  assert _caught(_bounds("dp_sgd")) == set(ESTIMATORS)


def test_noise_reused_at_every_step_is_caught(monkeypatch):
  # Same draw each step (a generator reset to one state): same shape, same noise.
  monkeypatch.setattr(gaussian, "normal", lambda generator, shape, stddev=1.0, dtype=tf.float32:
                      tf.random.stateless_normal(shape, [3, 7], stddev=stddev, dtype=dtype))
  result = _bounds("dp_sgd")
  assert _caught(result) == set(ESTIMATORS) and result["gdp"].score == "spread"


def test_dropped_selection_noise_is_caught(monkeypatch):
  select_rows = selection.select_rows
  monkeypatch.setattr(selection, "select_rows",
                      lambda touched, contributions, universe, threshold, noise_std, generator:
                      select_rows(touched, contributions, universe, threshold, 0.0, generator))
  assert _caught(_bounds("dp_adafest")) == set(ESTIMATORS)


def test_claim_of_each_algorithm():
  claim = white_box.Claim.of(_config("dp_adafest"), RATE)
  # σ2 of the released rows is above the composed σ the plan accounts (σ⁻² = σ1⁻² + σ2⁻²).
  assert 0 < claim.keep_out < claim.keep_in < 1 and claim.noise_multiplier > SIGMA
  assert white_box.Claim.of(_config("dp_sgd"), RATE) == white_box.Claim(RATE, SIGMA)
  assert white_box.Claim.of(config_lib.NonPrivate(), RATE).noise_multiplier == 0.0


K = 4  # rows of a canary user


def test_canary_users_have_k_rows():
  ids = np.array([3, 5, 8], np.int32)
  for batch in white_box.canary_batches(ids, 1.0, 2, rows_per_user=K):  # q = 1: every user
    unit, rows = batch[UNIT_KEY], batch[white_box.CANARY_IDS]
    assert np.array_equal(unit, np.repeat(np.arange(3), K))  # each user's k rows together
    assert np.array_equal(rows, np.repeat(ids, K))  # all on the user's own coordinate


def _user_bounds(config):
  rng = np.random.default_rng()
  scores, included = white_box.run_canaries(config, CANARIES, RATE, STEPS, 64.0, rng,
                                            rows_per_user=K)
  return bounds.best_bounds(scores, included, DELTA, 0.95, rng)


@pytest.mark.parametrize("algorithm", ["dp_sgd", "dp_adafest"])
def test_user_level_step_stays_below_its_claim(algorithm):
  # A user of k rows whose summed gradient is clipped to C2 is a row-level canary at q over users.
  result = _user_bounds(_config(algorithm))
  assert not _caught(result)
  assert _user_bounds(config_lib.NonPrivate())["gdp_fit"].epsilon > 10 * EPSILON


def test_rows_clipped_one_by_one_are_caught(monkeypatch):
  # The user's k rows each clipped to C2 (the unit ignored): the user moves the sum by k·C2.
  monkeypatch.setattr(units, "split_units", lambda features: (
      {key: value for key, value in features.items() if key != UNIT_KEY}, None))
  assert _caught(_user_bounds(_config("dp_sgd"))) == set(ESTIMATORS)
