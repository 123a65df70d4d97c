"""`--privacy-unit user` end to end on synthetic data: `dprec synth criteo --users N` writes a
trailing user_id column, the streaming Beam job carries it into the records (`--user-column`),
and a user-unit `dprec stream` trains the pCTR model on user batches (users Poisson-sampled, at
most k rows each, `UNIT_KEY` for the per-user clip) in a user-level ledger."""
import json

import dp_accounting
import numpy as np
import pytest

from dprec.data import criteo_tfrecord
from dprec.data.synthetic import CriteoSynthConfig, generate_criteo
from dprec.privacy_unit import UNIT_KEY
from dprec.training.period_source import BeamStreamSource
from dprec.workflows import run as run_lib
from dprec.workflows import stream
from dprec.workflows.stream_options import StreamOptions
from pipelines import criteo_stream

DAYS, ROWS, USERS, MAX_ROWS = 3, 300, 40, 2


@pytest.mark.slow  # a Beam job and two training periods: minutes on a loaded 2-core machine
def test_user_unit_stream_on_synthetic_users_samples_users_in_a_user_ledger(tmp_path):
  days = tmp_path / "days"
  summary = generate_criteo(str(days), rows=DAYS * ROWS, days=DAYS, seed=1, vocab="scaled:2k",
                            config=CriteoSynthConfig(users=USERS), progress=False)
  assert summary["max_rows_per_user"] > MAX_ROWS and summary["active_users"] <= USERS
  line = (days / "day_0").read_text().splitlines()[0].split("\t")
  assert len(line) == 41 and 1 <= int(line[40]) <= USERS
  out = str(tmp_path / "out")
  criteo_stream.run(criteo_stream.StreamJob(str(days), out, idle_timeout=0.0, poll_seconds=0.1,
                                            settle_seconds=0.0, user_column=True),
                    ["--direct_running_mode=in_memory", "--direct_num_workers=1"])
  with open(f"{out}/manifest.json") as f:
    assert json.load(f)[criteo_tfrecord.USER_COLUMN_KEY] is True
  records = next(iter(criteo_tfrecord.criteo_tfrecord_dataset(out, days=[0], batch_size=ROWS)))
  written = [int(l.split("\t")[40]) for l in (days / "day_0").read_text().splitlines()]
  np.testing.assert_array_equal(records["user_id"].numpy(), written)  # line order kept

  options = StreamOptions(
      data=out, run_dir=str(tmp_path / "run"), train_days=DAYS - 1, algorithm="dp_adafest",
      epsilon_total=8.0, privacy_unit="user", max_rows_per_user=MAX_ROWS, batch_size=10,
      hidden_units=(8,), progress=False, accountant="pld")
  options.validate()
  source = BeamStreamSource(out, 1, options.train_days)
  with run_lib.Run(stream.COMMAND, options.run_dir, None, None, False, out) as run:
    plan = stream.plan_privacy(options, source, DAYS - 1, run)
    trainer = stream.build_trainer(options, source, plan, run)
    result = trainer.run()
    # q over the first period's users (public, as N is), expected users as the normaliser.
    users = np.unique(source.period(0).load()[0]["user_id"]).size
    assert plan.sampling_rate == pytest.approx(10 / users)
    assert trainer.model.expected_batch_size == pytest.approx(10.0)
    assert result["privacy_unit"] == result["ledger_unit"] == "user"
    assert result["max_rows_per_user"] == MAX_ROWS
    assert result["epsilon_composition"]["periods"] == "sequential"
    with open(f"{options.run_dir}/ledger.json") as f:
      ledger = json.load(f)
    assert ledger["privacy_unit"] == "user"
    assert {c["unit"] for c in ledger["charges"]} == {"user"}
    periods = DAYS - 1
    events = [dp_accounting.GaussianDpEvent(plan.mechanisms[stream.BASE_RATE])]
    events += [dp_accounting.GaussianDpEvent(plan.period_mechanisms[stream.CALIBRATION])] * periods
    events += [dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        plan.sampling_rate, dp_accounting.GaussianDpEvent(plan.noise_multiplier)),
        periods * plan.steps_per_period)]
    direct = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4).compose(
            dp_accounting.ComposedDpEvent(events)).get_epsilon(plan.delta)
    assert result["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert result["epsilon"] == pytest.approx(8.0, rel=5e-3)
    for index in range(periods):
      period = source.period(index)
      features, labels = period.load()
      assert np.bincount(features["user_id"]).max() > MAX_ROWS  # the bound has work to do
      kept, _ = trainer.rows.release_rows(period)
      np.testing.assert_array_equal(np.bincount(kept["user_id"]),
                                    np.minimum(np.bincount(features["user_id"]), MAX_ROWS))
      batches = trainer.rows.batches(period, features, labels, 0, 5, [])
      for batch, _ in batches:
        unit, user = batch[UNIT_KEY], batch["user_id"]
        assert np.bincount(unit).max() <= MAX_ROWS
        starts = np.r_[0, np.flatnonzero(np.diff(unit)) + 1]
        assert np.all(user == user[starts][unit]) and len(np.unique(user)) == len(starts)
