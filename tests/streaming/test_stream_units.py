"""Accounting a stream by the unit it protects (README "Privacy model"), checked against
dp_accounting directly: a row lives in one period (parallel composition of the periods), a user
recurs in every period (sequential composition; user-level sampling, each sampled user's at most
k rows clipped as one, and at most k rows of a user in each release)."""
import json
import warnings

import dp_accounting
import numpy as np
import pytest

from dprec.errors import DprecError
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.privacy_unit import UNIT_KEY
from dprec.training import user_sampling
from dprec.training.period_source import ArrayPeriodSource
from dprec.workflows.plan import plan_stream
from dprec.workflows.stream_options import StreamOptions

DELTA = 1e-5
CLIP = 1.0
USER_MECHANISMS = dict(mechanisms=[("base rate", 0.01)],
                       period_mechanisms=[("calibration", 0.1)])
MECHANISMS = dict(USER_MECHANISMS, selection_epsilon=0.3)


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
  return list(trainer.rows.batches(period, *trainer.rows.load(period), 0,
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


def _ledger(run_dir):
  return json.loads((run_dir / "ledger.json").read_text())


def test_a_user_unit_run_samples_users_and_pays_their_sequential_composition(tmp_path, standin):
  periods, rows = 3, 2
  trainer = standin.make_trainer(str(tmp_path), 2.0, ArrayPeriodSource(standin.make_days(3)),
                                 noise_multiplier=None, privacy_unit="user",
                                 max_rows_per_user=rows, **USER_MECHANISMS)
  summary = trainer.run()
  plan = trainer.plan
  assert summary["privacy_unit"] == summary["ledger_unit"] == "user"
  assert summary["max_rows_per_user"] == rows
  assert summary["epsilon_composition"]["periods"] == "sequential"
  ledger = _ledger(tmp_path)
  assert ledger["privacy_unit"] == "user" and {c["unit"] for c in ledger["charges"]} == {"user"}
  # q over the first period's users; a user moves a step by ≤ C (clipped as one) and a
  # release by ≤ k rows, noised at k·σ: the Gaussian at σ per user.
  users = np.unique(trainer.source.period(0).load()[0]["user_id"]).size
  assert plan.sampling_rate == pytest.approx(40 / users)
  events = [dp_accounting.GaussianDpEvent(plan.mechanisms["base rate"])]
  events += [dp_accounting.GaussianDpEvent(plan.period_mechanisms["calibration"])] * periods
  events += [_sampled(plan.noise_multiplier, plan.sampling_rate, periods * plan.steps_per_period)]
  assert summary["epsilon"] == pytest.approx(_direct(events), rel=1e-6)
  assert summary["epsilon"] == pytest.approx(2.0, rel=5e-3)
  releases = trainer.charges.releases(plan.period_mechanisms, "stream period 0", 0)
  assert releases["calibration"][0] == rows * plan.period_mechanisms["calibration"]
  for index in range(periods):
    period = trainer.source.period(index)
    features, _ = trainer.rows.release_rows(period)
    assert np.bincount(features["user_id"]).max() <= rows
    assert np.bincount(period.load()[0]["user_id"]).max() > rows  # the bound has work to do
    for batch, labels in _batches(trainer, index):
      unit, user = batch[UNIT_KEY], batch["user_id"]
      assert len(unit) == len(labels) and np.all(np.diff(unit) >= 0)
      assert np.bincount(unit).max() <= rows
      starts = np.r_[0, np.flatnonzero(np.diff(unit)) + 1]
      assert np.all(user == user[starts][unit])  # a unit is one user's rows
      assert len(np.unique(user)) == len(starts)  # and one user is one unit


def test_a_user_unit_run_resumed_after_a_crash_draws_the_same_batches_and_pays_once(
    tmp_path, standin):
  """A crash mid-period (an exception out of a step) and a rerun end where an uninterrupted
  run does: the same ledger, batches, journal and weights."""
  days = standin.make_days(3)

  def trainer(run_dir, crash_after=None):
    out = _trainer(standin, run_dir, days, privacy_unit="user", max_rows_per_user=2,
                   batch_size=10, **USER_MECHANISMS)
    out.model = Recording(out.model, crash_after)
    return out

  class Recording:
    """The stand-in, recording each batch (and raising after `crash_after` steps)."""

    def __init__(self, model, crash_after):
      self.model, self.crash_after, self.batches = model, crash_after, []

    def __getattr__(self, name):
      return getattr(self.model, name)

    def train_steps(self, batches, steps, on_step):
      for batch, labels in batches:
        if len(self.batches) == self.crash_after:
          raise RuntimeError("crash")
        self.batches.append((batch[UNIT_KEY].tobytes(), batch["user_id"].tobytes()))
        on_step(self.model._step(batch, labels))

  plain = trainer(tmp_path / "plain")
  plain.run()
  steps = plain.plan.steps_per_period
  crashed = trainer(tmp_path / "crashed", crash_after=steps + 10)
  with pytest.raises(RuntimeError, match="crash"):
    crashed.run()
  crashed.run_state.close()  # the process ends: its run directory is free again
  resumed = trainer(tmp_path / "crashed")
  summary = resumed.run()
  assert summary["resumed"] and summary["periods_trained"] == 3
  assert resumed.model.batches == plain.model.batches[-len(resumed.model.batches):]
  assert len(resumed.model.batches) == 2 * steps - 7  # from period 1's checkpoint at step 7

  def charges(run_dir):
    return [{k: v for k, v in c.items() if k not in ("time", "updated", "run_id")}
            for c in _ledger(run_dir)["charges"]]
  assert charges(tmp_path / "crashed") == charges(tmp_path / "plain")
  journal = [(tmp_path / d / "steps.jsonl").read_text() for d in ("plain", "crashed")]
  assert journal[0] == journal[1]
  for a, b in zip(plain.model.trackables().values(), resumed.model.trackables().values()):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_rows_per_user_keeps_at_most_n_uniformly():
  users = np.repeat(np.arange(4), [1, 3, 5, 2])
  grouped = user_sampling.UserRows.group(users)
  kept = [user_sampling.rows_per_user(grouped, 2, np.random.default_rng(seed))
          for seed in range(200)]
  assert all(np.array_equal(np.bincount(users[k], minlength=4), [1, 2, 2, 2]) for k in kept)
  share = np.bincount(np.concatenate(kept), minlength=len(users))[users == 2] / 200
  np.testing.assert_allclose(share, 2 / 5, atol=0.12)  # each of user 2's rows: 2 in 5


@pytest.mark.parametrize("ids, message", [
    (None, "needs a 'user_id' column"), (np.float64, "must be integers")])
def test_user_unit_refuses_rows_without_integer_user_ids_charging_nothing(tmp_path, standin,
                                                                          ids, message):
  days = standin.make_days(2)
  day = [({k: v for k, v in f.items() if k != "user_id"}, y) for f, y in days]
  if ids is not None:
    day = [(dict(f, user_id=f["user_id"].astype(ids)), y) for f, y in days]
  source = ArrayPeriodSource(days)
  trainer = standin.make_trainer(str(tmp_path), 5.0, source, privacy_unit="user")
  trainer.source = ArrayPeriodSource(day)
  with pytest.raises(DprecError, match=message) as error:
    trainer.run()
  assert "\n" not in str(error.value)
  assert not (tmp_path / "ledger.json").exists() or not _ledger(tmp_path)["charges"]


def test_user_unit_refuses_k_below_one_and_dp_top_k_of_row_counts(tmp_path, standin):
  with pytest.raises(DprecError, match="integer >= 1"):
    plan_stream(1.0, 1e-5, 2, 100, 10, privacy_unit="user", max_rows_per_user=0)
  with pytest.raises(DprecError, match="--max-rows-per-user"):
    StreamOptions(data="d", epsilon_total=1.0, privacy_unit="user",
                  max_rows_per_user=0).validate()
  with pytest.raises(DprecError, match="DP top-k"):
    standin.make_trainer(str(tmp_path), 5.0, ArrayPeriodSource(standin.make_days(2)),
                         privacy_unit="user", selection_epsilon=0.3)
  assert not (tmp_path / "ledger.json").exists()
