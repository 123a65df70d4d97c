"""`dprec train ctr --strategy multi_worker --local-workers 2`: the ledger paid once per global
step by the chief, the secret key shared through the run directory. (That a distributed step
equals the one-device step: test_mirrored_step, test_multi_worker_step.)"""
import json

import pytest

from dprec import cli
from dprec import privacy
from dprec.data import synthetic

STEPS, BATCH, EPSILON = 4, 64, 2.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("criteo")
  synthetic.generate_criteo(str(directory), rows=800, days=2, seed=0, vocab="scaled:3k",
                            progress=False)
  return str(directory)


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
