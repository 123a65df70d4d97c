"""`train ctr`'s DP base rate is `make_private`'s release (one mechanism), and its DP Platt
scaling fits the uncentred feature (the centred one, `stream`'s, measured worse here)."""
import math
import types

import numpy as np
import pytest

from dprec import privacy
from dprec.training import output_layer
from dprec.workflows import ctr as ctr_workflow


def test_the_base_rate_is_the_release_make_private_sets_its_bias_from():
  labels = (np.random.default_rng(1).random(5000) < 0.25).astype(np.float32)
  rate = ctr_workflow.base_rate(labels, 3.0, np.random.default_rng(7))
  assert rate == pytest.approx(privacy.dp_mean(labels, (0.0, 1.0), 3.0, np.random.default_rng(7)))
  bias = output_layer.initial_bias(output_layer.BCE, labels, 3.0, np.random.default_rng(7))
  assert bias[0] == pytest.approx(math.log(rate / (1 - rate)))
  assert ctr_workflow.base_rate_of_sum(float(labels.sum()), labels.size, 3.0,
                                       np.random.default_rng(7)) == pytest.approx(rate)
  assert ctr_workflow.base_rate(labels, None, None) == pytest.approx(labels.mean())


def test_platt_scaling_fits_the_uncentred_feature(monkeypatch):
  seen = {}

  def fit(logits, labels, sigma, rate, rng, **kwargs):
    seen.update(kwargs, rate=rate)
    return 1.0, 0.0

  monkeypatch.setattr(output_layer.privacy, "dp_platt_scaling", fit)
  monkeypatch.setattr(output_layer, "fold_affine", lambda layer, scale, shift: None)
  monkeypatch.setattr(ctr_workflow.ctr, "predict_logits", lambda model, rows, size: rows["z"])
  plan = types.SimpleNamespace(mechanisms={ctr_workflow.CALIBRATION_LABEL: 2.0},
                               release_noise_multiplier=lambda sigma: sigma)
  train = {"z": np.zeros(10), "label": np.ones(10)}
  ctr_workflow.recalibrate(types.SimpleNamespace(logit=None), train, plan, 0.2,
                           np.random.default_rng(0))
  assert "center" not in seen and "logit_bound" not in seen and seen["rate"] == 0.2
