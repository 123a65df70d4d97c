"""Accounting a stream by the unit it protects (README "Privacy model"), checked against
dp_accounting directly: a row lives in one period (parallel composition of the periods), a user
recurs in every period (sequential composition, a user's rows per period bounded)."""
import json
import warnings

import dp_accounting
import numpy as np
import pytest

from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.training.period_source import ArrayPeriodSource
from dprec.training.streaming import bound_rows_per_user

DELTA = 1e-5
CLIP = 1.0
MECHANISMS = dict(mechanisms=[("base rate", 0.01)], period_mechanisms=[("calibration", 0.1)],
                  selection_epsilon=0.3)


def _direct(events):
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
  return accountant.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(DELTA)


def _sampled(sigma, q, steps):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _clipped_sum(features, labels, vocab=16):
  """Σ_i clip_C(g_i) of the stand-in logistic model at zero weights (g_i = (p − y_i)·x_i, x_i
  the one-hot ids of every table, the integer features and 1)."""
  ids, ints = features["cat_features"], features["int_features"]
  one_hot = np.concatenate([np.eye(vocab)[ids[:, j]] for j in range(ids.shape[1])], axis=1)
  x = np.concatenate([one_hot, ints, np.ones((len(labels), 1))], axis=1)
  g = (0.5 - labels)[:, None] * x
  return (g * np.minimum(1.0, CLIP / np.linalg.norm(g, axis=1))[:, None]).sum(axis=0)


def _trainer(standin, run_dir, days, **options):
  with warnings.catch_warnings():  # the same public key for both data sets: a coupling
    warnings.simplefilter("ignore", InsecureNoiseWarning)
    return standin.make_trainer(str(run_dir), 50.0, ArrayPeriodSource(days),
                                insecure_noise_seed=7, expected_periods=4, **options)


def _batches(trainer, index):
  period = trainer.source.period(index)
  return list(trainer._batches(period, *trainer._training_rows(period), 0,
                               trainer.plan.steps_per_period, []))


def test_removing_one_row_of_period_t_changes_only_period_t(tmp_path, standin):
  t = 2
  days = standin.make_days(4)
  features, labels = days[t]
  removed = ({k: v[-1:] for k, v in features.items()}, labels[-1:])
  neighbour = list(days)
  neighbour[t] = ({k: v[:-1] for k, v in features.items()}, labels[:-1])
  full, less = _trainer(standin, tmp_path / "d", days), _trainer(standin, tmp_path / "n", neighbour)
  for index in range(4):
    if index == t:
      continue  # every other period draws the very same batches: same clipped sums
    for (f1, y1), (f2, y2) in zip(_batches(full, index), _batches(less, index)):
      np.testing.assert_array_equal(y1, y2)
      np.testing.assert_array_equal(_clipped_sum(f1, y1), _clipped_sum(f2, y2))
  # Period t: each row is in a Poisson batch independently, so a batch of the neighbour is a
  # batch of the full period without the row; the clipped sums differ by ≤ C.
  row = _clipped_sum(*removed)
  assert 0 < np.linalg.norm(row) <= CLIP + 1e-9
  for f, y in _batches(full, t):
    assert np.linalg.norm(_clipped_sum(f, y) - (_clipped_sum(f, y) - row)) <= CLIP + 1e-9
  # Trained through period t − 1, both models are the same; period t's charge reads its day only.
  for trainer in (full, less):
    trainer.config = type(trainer.config)(checkpoint_every=50, train_periods=t)
    trainer.run()
  for a, b in zip(full.model.trackables().values(), less.model.trackables().values()):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  charges = json.loads((tmp_path / "d" / "ledger.json").read_text())["charges"]
  assert [c.get("days") for c in charges if c["mechanism"] == "poisson_gaussian"
          and c["label"] == f"stream period {t - 1}"] == [[t - 1]]


def test_a_row_unit_run_pays_one_period_plus_the_sequential_parts(tmp_path, standin):
  trainer = standin.make_trainer(str(tmp_path), 1.0, ArrayPeriodSource(standin.make_days(4)),
                                 noise_multiplier=None, expected_periods=4, **MECHANISMS)
  summary = trainer.run()
  plan = trainer.plan
  assert summary["periods_trained"] == 4 and summary["privacy_unit"] == "row"
  per_period = _direct([dp_accounting.GaussianDpEvent(plan.mechanisms["base rate"]),
                        dp_accounting.GaussianDpEvent(plan.period_mechanisms["calibration"]),
                        _sampled(plan.noise_multiplier, plan.sampling_rate,
                                 plan.steps_per_period)])
  sequential = 0.3  # the DP top-k refreshes of the 4 periods, on the running counts
  assert summary["epsilon"] == pytest.approx(per_period + sequential, rel=1e-6)
  assert summary["epsilon"] == pytest.approx(1.0, rel=5e-3)  # calibrated, not merely safe
  composition = summary["epsilon_composition"]
  assert composition["periods"] == "parallel"
  assert [d["days"] for d in composition["by_days"]] == [[0], [1], [2], [3]]
  assert max(d["epsilon"] for d in composition["by_days"]) == pytest.approx(summary["epsilon"])


def test_a_user_unit_run_pays_the_sequential_composition(tmp_path, standin):
  periods, rows = 3, 2
  trainer = standin.make_trainer(str(tmp_path), 2.0, ArrayPeriodSource(standin.make_days(3)),
                                 noise_multiplier=None, privacy_unit="user",
                                 max_rows_per_user=rows, **MECHANISMS)
  summary = trainer.run()
  plan = trainer.plan
  assert summary["privacy_unit"] == "user" and summary["max_rows_per_user"] == rows
  assert summary["epsilon_composition"]["periods"] == "sequential"
  # A user of ≤ 2 rows moves a sum by 2·C: σ/2 per user, sampled when any row is.
  sigma, q = plan.noise_multiplier / rows, 1 - (1 - plan.sampling_rate) ** rows
  events = [dp_accounting.GaussianDpEvent(plan.mechanisms["base rate"] / rows)]
  events += [dp_accounting.GaussianDpEvent(plan.period_mechanisms["calibration"] / rows)] * periods
  events += [_sampled(sigma, q, periods * plan.steps_per_period)]
  assert summary["epsilon"] == pytest.approx(_direct(events) + 0.3, rel=1e-6)
  assert summary["epsilon"] == pytest.approx(2.0, rel=5e-3)
  for index in range(periods):
    features, _ = trainer._training_rows(trainer.source.period(index))
    assert np.bincount(features["user_id"]).max() <= rows


def test_bound_rows_per_user_keeps_at_most_n_uniformly():
  users = np.repeat(np.arange(4), [1, 3, 5, 2])
  kept = [bound_rows_per_user(users, 2, np.random.default_rng(seed)) for seed in range(200)]
  assert all(np.array_equal(np.bincount(users[k], minlength=4), [1, 2, 2, 2]) for k in kept)
  share = np.bincount(np.concatenate(kept), minlength=len(users))[users == 2] / 200
  np.testing.assert_allclose(share, 2 / 5, atol=0.12)  # each of user 2's rows: 2 in 5


def test_user_unit_needs_user_ids(tmp_path, standin):
  days = [({k: v for k, v in f.items() if k != "user_id"}, y) for f, y in standin.make_days(2)]
  trainer = standin.make_trainer(str(tmp_path), 5.0, ArrayPeriodSource(days),
                                 privacy_unit="user")
  with pytest.raises(Exception, match="user_id"):
    trainer.run()
