"""`dprec train ctr --strategy parameter_server` on a cluster of processes (TF_CONFIG: chief,
workers,
ps), with faults as tf.distribute promises to handle them: a worker killed mid-run and restarted
by its cluster manager is waited for and the coordinator reschedules its step (the run finishes,
every step paid once, ε as planned); a worker killed at a chosen step once its update is computed
(a deterministic hook, `parameter_server.FAULT_INJECTION_ENV`) leaves the run equal to an
uninterrupted one (the update is applied by the chief, once); a parameter server or the chief
killed ends the run, and the same command resumes from the last checkpoint and ends equal to an
uninterrupted run with the same insecure key (one worker: steps run in order, so the runs are
comparable bit for bit)."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from dprec import privacy
from dprec.distribute import cluster
from dprec.distribute import parameter_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY, EPSILON, LABEL = 6, 2, 2.0, "train ctr dp_adafest"
TIMEOUT = 900  # seconds for one chief run (about 1 min on a quiet 2-core machine)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.faults]


@pytest.fixture(scope="module")
def data_dir(criteo_days):
  return criteo_days(800, 2)


class Cluster:
  """Server processes (`dprec train ctr --strategy parameter_server` with a worker or ps
  TF_CONFIG) on fixed localhost ports, and chief runs of the full command against them."""

  def __init__(self, workers: int, ps: int = 1):
    ports = [f"localhost:{port}" for port in cluster.free_ports(1 + workers + ps)]
    self.spec = {"chief": ports[:1], "worker": ports[1:1 + workers], "ps": ports[1 + workers:]}
    self.env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    self.servers, self.chiefs = {}, []
    for kind in ("ps", "worker"):
      for index in range(len(self.spec[kind])):
        self.start(kind, index)

  def _popen(self, kind, index, args, env=None):
    config = json.dumps({"cluster": self.spec, "task": {"type": kind, "index": index}})
    return subprocess.Popen([sys.executable, "-m", "dprec.cli", "train", "ctr", *args],
                            env=dict(self.env, TF_CONFIG=config, **(env or {})))

  def start(self, kind, index):
    """(Re)starts a server on its address, as a cluster manager restarts a lost task."""
    self.servers[kind, index] = self._popen(
        kind, index, ["--data", "unused", "--strategy", "parameter_server"])

  def kill(self, kind, index):
    process = self.servers.pop((kind, index))
    process.kill()
    process.wait()

  def chief(self, args, env=None):
    self.chiefs.append(self._popen("chief", 0, args, env))
    return self.chiefs[-1]

  def stop(self):
    for process in [*self.chiefs, *self.servers.values()]:
      process.kill()
      process.wait()


@pytest.fixture
def make_cluster():
  made = []
  yield lambda *args: made.append(Cluster(*args)) or made[-1]
  for each in made:
    each.stop()


@pytest.fixture(scope="module")
def one_worker_two_ps():
  """One worker and two parameter servers, shared by the tests whose runs compare bit for bit
  (each starts its chiefs against them; a server a test kills it restarts). Those two tests come
  first in this file: the suite's first tests (this file's, tests/conftest.py) go out in pairs
  under pytest-xdist, so one worker runs both and starts these servers once."""
  servers = Cluster(1, 2)
  yield servers
  servers.stop()


def _command(data_dir, run_dir, *extra):
  return [*extra, "--data", data_dir, "--algorithm", "dp_adafest", "--threshold", "2", "--epsilon",
          str(EPSILON), "--batch-size", "64", "--steps", str(STEPS), "--hidden-units", "8",
          "--no-progress", "--strategy", "parameter_server", "--insecure-noise-seed", "5",
          "--checkpoint-every", str(EVERY), "--charge-every", "1", "--run-dir", str(run_dir),
          "--summary-json", str(run_dir / "summary.json")]


def _wait_for_checkpoint(process, run_dir, step):
  """Waits until a checkpoint of `step` or later is committed (the chief is then mid-run);
  fails if the chief ends first."""
  deadline = time.monotonic() + TIMEOUT
  while True:
    steps = []
    for path in (run_dir / "checkpoints").glob("ckpt-*"):
      try:
        steps.append(json.loads((path / "state.json").read_text())["step"])
      except FileNotFoundError:  # an old checkpoint removed since the listing
        pass
    if max(steps, default=0) >= step:
      return
    assert process.poll() is None, f"the chief ended (code {process.returncode}) before step {step}"
    assert time.monotonic() < deadline, f"no checkpoint of step {step} after {TIMEOUT} s"
    time.sleep(0.2)


def _steps_paid(run_dir):
  charges = privacy.PrivacyLedger(str(run_dir / "ledger.json")).charges
  return sum(charge.get("steps", 0) for charge in charges if charge["label"] == LABEL)


def _summary(run_dir):
  return json.loads((run_dir / "summary.json").read_text())


def _wait_for_file(process, path):
  deadline = time.monotonic() + TIMEOUT
  while not path.exists():
    assert process.poll() is None, f"the chief ended (code {process.returncode}) first"
    assert time.monotonic() < deadline, f"no {path} after {TIMEOUT} s"
    time.sleep(0.1)


OUT_OF_CORE = ("--out-of-core", "--beam-option", "direct_num_workers=1", "--beam-option",
               "direct_running_mode=in_memory")


def _run_faulted_worker(servers, data_dir, run_dir, source=()):
  """A run whose worker of step 3 is killed after computing its noisy update (the hook makes
  it hang there until killed) and restarted by its cluster manager."""
  marker = run_dir.parent / f"{run_dir.name}_worker_stopped"
  chief = servers.chief(_command(data_dir, run_dir, *source),
                        {parameter_server.FAULT_INJECTION_ENV: f"3:{marker}"})
  _wait_for_file(chief, marker)
  servers.kill("worker", 0)
  servers.start("worker", 0)
  assert chief.wait(timeout=TIMEOUT) == 0


def _assert_equal_runs(run_dir, reference):
  """Every step paid once, ε, the summary's numbers and the last checkpoint's weights and
  optimizer slots equal to the uninterrupted run's, bit for bit (not the training batches'
  metrics, e.g. gradient_size: a re-run step's count again, diagnostics)."""
  ended, uninterrupted = _summary(run_dir), _summary(reference)
  assert ended.get("out_of_core", False) is uninterrupted.get("out_of_core", False)
  assert _steps_paid(run_dir) == _steps_paid(reference) == STEPS
  assert ended["epsilon"] == uninterrupted["epsilon"]
  for key in ("auc", "eval_loss", "calibration_scale", "calibration_shift"):
    assert ended[key] == uninterrupted[key], key
  ended, uninterrupted = _final_checkpoint(run_dir), _final_checkpoint(reference)
  assert ended.keys() == uninterrupted.keys() and any("embeddings" in k for k in ended)
  for name, value in ended.items():
    np.testing.assert_array_equal(value, uninterrupted[name], err_msg=name)


def test_faults_of_the_chief_a_server_or_a_worker_leave_the_run_as_uninterrupted(
    data_dir, tmp_path, one_worker_two_ps):
  """One worker (steps run in order: runs comparable bit for bit), two parameter servers, one
  uninterrupted reference run, then two faulted runs against the same servers:
  - the chief killed after a checkpoint, the same command resumes from it; then a parameter
    server killed (its variables are lost: the chief fails), restarted, and the same command
    resumes again;
  - the fault of a step's update half-applied: step 3's worker killed once its noisy update is
    computed. Workers apply nothing (the chief applies each fetched update once), so the
    coordinator's re-run computes the same update on the same weights. (Before, workers applied
    their own updates: a re-run applied a step twice, a second release with the same noise.)
  Both end equal to the reference, every step paid once."""
  servers = one_worker_two_ps
  reference = tmp_path / "uninterrupted"
  assert servers.chief(_command(data_dir, reference)).wait(timeout=TIMEOUT) == 0

  run_dir = tmp_path / "chief_and_server_killed"
  chief = servers.chief(_command(data_dir, run_dir))
  _wait_for_checkpoint(chief, run_dir, EVERY)
  chief.kill()
  chief.wait()
  chief = servers.chief(_command(data_dir, run_dir))
  _wait_for_checkpoint(chief, run_dir, 2 * EVERY)
  servers.kill("ps", 0)
  assert chief.wait(timeout=TIMEOUT) != 0
  servers.start("ps", 0)
  assert servers.chief(_command(data_dir, run_dir)).wait(timeout=TIMEOUT) == 0
  _assert_equal_runs(run_dir, reference)
  assert _summary(run_dir)["gradient_size"] == _summary(reference)["gradient_size"]  # no re-run

  _run_faulted_worker(servers, data_dir, tmp_path / "worker_lost")
  _assert_equal_runs(tmp_path / "worker_lost", reference)


def test_out_of_core_a_worker_lost_once_its_update_is_computed_leaves_the_run_as_uninterrupted(
    data_dir, tmp_path, one_worker_two_ps):
  """Out of core, the worker processes read the steps' shards themselves, and the coordinator's
  re-run of step 3 reads its shard again: the same batch."""
  servers = one_worker_two_ps
  reference = tmp_path / "uninterrupted"
  assert servers.chief(_command(data_dir, reference, *OUT_OF_CORE)).wait(timeout=TIMEOUT) == 0
  _run_faulted_worker(servers, data_dir, tmp_path / "worker_lost", OUT_OF_CORE)
  assert _summary(reference)["out_of_core"] is True
  _assert_equal_runs(tmp_path / "worker_lost", reference)


def test_a_killed_worker_is_rescheduled_and_the_run_pays_each_step_once(data_dir, tmp_path,
                                                                         make_cluster):
  servers = make_cluster(2)
  run_dir = tmp_path / "run"
  chief = servers.chief(_command(data_dir, run_dir))
  _wait_for_checkpoint(chief, run_dir, EVERY)
  servers.kill("worker", 1)
  time.sleep(1)
  servers.start("worker", 1)
  assert chief.wait(timeout=TIMEOUT) == 0
  summary = _summary(run_dir)
  assert summary["steps"] == STEPS and summary["replicas"] == 2
  assert _steps_paid(run_dir) == STEPS  # each step paid when scheduled, not again when re-run
  assert summary["epsilon"] == pytest.approx(EPSILON, rel=1e-3)  # as planned: ε unchanged
  assert summary["private"] is False  # the insecure key says so


def _final_checkpoint(run_dir):
  """{name: value} of the last checkpoint's weights and optimizer variables (not the metrics of
  training batches: a re-run step's are counted again, diagnostics)."""
  last = sorted((run_dir / "checkpoints").glob("ckpt-*"))[-1]
  reader = tf.train.load_checkpoint(str(last / "model"))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if "VARIABLE_VALUE" in name and (name.startswith("optimizer/") or any(
              weight in name for weight in ("embeddings", "kernel", "bias")))}
