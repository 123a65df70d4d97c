"""`dprec train ctr --strategy multi_worker --local-workers 2` and `--strategy parameter_server
--local-workers 2 --local-ps 2`: the ledger paid once per global step by the chief, the secret
key shared through the run directory (multi_worker) or kept by the chief (parameter_server). (That
a distributed step
equals the one-device step: test_mirrored_step, test_multi_worker_step.)"""
import json
import os
import subprocess
import sys

import pytest

from dprec import cli
from dprec import privacy

STEPS, BATCH, EPSILON = 4, 64, 2.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def data_dir(criteo_days):
  return criteo_days(800, 2)


def _train(data_dir, out, *extra):
  summary = out / "summary.json"
  assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_adafest",
                   "--threshold", "2", "--epsilon", str(EPSILON), "--batch-size", str(BATCH),
                   "--steps", str(STEPS), "--hidden-units", "8", "--no-progress",
                   "--summary-json", str(summary), *extra]) == 0
  return json.loads(summary.read_text())


@pytest.mark.multiprocess
def test_local_multi_worker_run_pays_each_step_once_with_the_chiefs_secret_key(data_dir, tmp_path):
  run_dir = tmp_path / "run"
  summary = _train(data_dir, tmp_path, "--strategy", "multi_worker", "--local-workers", "2",
                   "--run-dir", str(run_dir))
  assert summary["private"] and summary["steps"] == STEPS
  assert summary["strategy"] == "multi_worker" and summary["replicas"] == 2
  charges = privacy.PrivacyLedger(str(run_dir / "ledger.json")).charges
  assert {c["run_id"] for c in charges} == {summary["run_id"]}
  steps_paid = sum(c.get("steps", 0) for c in charges if c["label"] == "train ctr dp_adafest")
  assert steps_paid == STEPS  # once per global step, not once per worker
  assert summary["epsilon"] == pytest.approx(EPSILON, rel=1e-3)
  assert len(list((run_dir / "checkpoints").iterdir())) >= 1


def test_multi_worker_without_a_shared_run_dir_is_refused(data_dir, tmp_path, capsys):
  assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd", "--epsilon",
                   "1", "--strategy", "multi_worker", "--local-workers", "2"]) != 0
  assert "--run-dir" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_local_parameter_server_run_pays_each_step_once_and_summarises_like_one_device(
    data_dir, tmp_path):
  """In a process of its own: the in-process cluster stays connected to the process."""
  run_dir, summary_json = tmp_path / "run", tmp_path / "summary.json"
  args = ["--data", data_dir, "--algorithm", "dp_adafest", "--threshold", "2", "--epsilon",
          str(EPSILON), "--batch-size", str(BATCH), "--steps", str(STEPS), "--hidden-units", "8",
          "--no-progress"]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
      "PYTHONPATH")])), TF_CPP_MIN_LOG_LEVEL="2")
  subprocess.run([sys.executable, "-m", "dprec.cli", "train", "ctr", *args, "--strategy",
                  "parameter_server", "--local-workers", "2", "--local-ps", "2",
                  "--min-shard-rows", "64",  # the largest tables (140–164 rows) in 2 shards
                  "--run-dir",
                  str(run_dir), "--summary-json", str(summary_json)], env=env, check=True,
                 timeout=600)
  summary = json.loads(summary_json.read_text())
  assert summary["private"] and summary["steps"] == STEPS
  assert summary["strategy"] == "parameter_server" and summary["replicas"] == 2
  charges = privacy.PrivacyLedger(str(run_dir / "ledger.json")).charges
  assert {c["run_id"] for c in charges} == {summary["run_id"]}
  assert sum(c.get("steps", 0) for c in charges if c["label"] == "train ctr dp_adafest") == STEPS
  assert summary["epsilon"] == pytest.approx(EPSILON, rel=1e-3)
  assert 0 <= summary["auc"] <= 1 and summary["gradient_size"] > 0
  (tmp_path / "one").mkdir()
  one_device = _train(data_dir, tmp_path / "one")
  assert set(summary) - set(one_device) == {"sharded_tables"} and set(one_device) <= set(summary)
  assert summary["sharded_tables"] == 3  # the tables of 140, 161 and 164 rows


def test_parameter_server_flags_are_checked(data_dir, capsys):
  for extra in (["--local-workers", "2"], ["--local-ps", "2"],
                ["--local-workers", "2", "--local-ps", "1", "--secure-noise"]):
    assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd", "--epsilon",
                     "1", "--strategy", "parameter_server", *extra]) != 0
    assert "--local-ps" in capsys.readouterr().err or "--secure-noise" in extra
