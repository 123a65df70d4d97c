"""`--privacy-unit user` end to end on synthetic data: `dprec synth criteo --users N` writes a
trailing user_id column, the streaming Beam job carries it into the records (`--user-column`),
and a user-unit `dprec stream` trains on them with each user's rows per period bounded."""
import json

import numpy as np
import pytest

from dprec.data import criteo_tfrecord
from dprec.data.synthetic import CriteoSynthConfig, generate_criteo
from dprec.training.period_source import BeamStreamSource
from dprec.workflows import run as run_lib
from dprec.workflows import stream
from pipelines import criteo_stream

DAYS, ROWS, USERS, MAX_ROWS = 3, 300, 40, 2


@pytest.mark.slow  # a Beam job and two training periods: minutes on a loaded 2-core machine
def test_user_unit_stream_on_synthetic_users_bounds_rows_per_user(tmp_path):
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

  options = stream.StreamOptions(
      data=out, run_dir=str(tmp_path / "run"), train_days=DAYS - 1, algorithm="dp_adafest",
      epsilon_total=8.0, privacy_unit="user", max_rows_per_user=MAX_ROWS, batch_size=30,
      hidden_units=(8,), progress=False)
  options.validate()
  source = BeamStreamSource(out, 1, options.train_days)
  with run_lib.Run(stream.COMMAND, options.run_dir, None, None, False, out) as run:
    plan = stream.plan_privacy(options, source, DAYS - 1, run)
    trainer = stream.build_trainer(options, source, plan, run)
    result = trainer.run()
    assert result["privacy_unit"] == "user" and result["max_rows_per_user"] == MAX_ROWS
    assert result["epsilon_composition"]["periods"] == "sequential"
    assert 0 < result["epsilon"] <= 8.0
    for index in range(DAYS - 1):
      features, labels = source.period(index).load()
      assert np.bincount(features["user_id"]).max() > MAX_ROWS  # the bound has work to do
      kept, kept_labels = trainer._training_rows(source.period(index))  # pylint: disable=protected-access
      counts = np.bincount(kept["user_id"])
      assert counts.max() <= MAX_ROWS and len(kept_labels) == len(kept["user_id"])
      # every user present keeps min(rows, MAX_ROWS) of them
      np.testing.assert_array_equal(counts, np.minimum(np.bincount(features["user_id"]),
                                                       MAX_ROWS))
