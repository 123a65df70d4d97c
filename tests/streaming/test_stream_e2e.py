"""The third way in, end to end through the CLI: the streaming Beam job on its default runner
watches an empty directory, day files arrive one by one (temporary name, then rename; gaps longer
than a poll), `dprec stream` tails the output at the same time, is killed with SIGKILL in the
middle of a period and restarted; at the end every day is in the manifest, each period was
trained exactly once, the ledger holds one charge per period and the summary lists every one."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dprec import privacy
from dprec.data.synthetic import generate_criteo

pytestmark = pytest.mark.commands

DAYS, ROWS, BATCH = 4, 500, 10
STEPS = ROWS // BATCH  # per period: one expected pass at an expected batch of 10
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_NUM_INTRAOP_THREADS="1",
           TF_NUM_INTEROP_THREADS="1")


def _journal(run_dir):
  path = os.path.join(run_dir, "steps.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def _manifest_days(out):
  path = os.path.join(out, "manifest.json")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [entry["day"] for entry in json.load(f)["days"]]


def _wait_for(condition, what, processes, timeout=180):
  deadline = time.monotonic() + timeout
  while not condition():
    for name, process in processes.items():
      assert process.poll() is None, (f"{name} exited ({process.returncode}) before {what}:\n"
                                      + _tail(process.log_path))
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


def _start(command, log_path):
  """A CLI process writing its output to `log_path` (a pipe could fill up and stall it)."""
  with open(log_path, "wb") as stream:
    process = subprocess.Popen(command, env=ENV, stdout=stream, stderr=subprocess.STDOUT)
  process.log_path = log_path
  return process


def _tail(path):
  with open(path, errors="replace") as f:
    return f.read()[-3000:]


@pytest.mark.slow
def test_watcher_and_trainer_with_a_sigkill_in_the_middle_of_a_period(tmp_path):
  generate_criteo(str(tmp_path / "days"), rows=DAYS * ROWS, days=DAYS, seed=1,
                  vocab="scaled:2k", progress=False)
  incoming, out, run_dir = tmp_path / "incoming", tmp_path / "out", str(tmp_path / "run")
  incoming.mkdir()
  out.mkdir()  # as the README does, so the trainer may start first
  out = str(out)
  watcher = _start(
      [sys.executable, "-m", "dprec.cli", "preprocess", "criteo", "--streaming", "--input",
       str(incoming), "--output", out, "--poll-seconds", "0.2", "--settle-seconds", "0.3",
       "--stop-after-day", str(DAYS - 1), "--idle-timeout", "120"], tmp_path / "watcher.log")
  trainer_command = [
      sys.executable, "-m", "dprec.cli", "stream", "--data", out, "--run-dir", run_dir,
      "--algorithm", "dp_adafest", "--epsilon", "20", "--noise-multiplier", "1.0",
      "--accountant", "rdp", "--train-days", str(DAYS - 1), "--examples-per-period", str(ROWS),
      "--batch-size", str(BATCH), "--hidden-units", "8", "--checkpoint-every", "7",
      "--idle-timeout", "120", "--poll-seconds", "0.1", "--no-progress",
      "--summary-json", os.path.join(run_dir, "summary.json")]
  trainer = _start(trainer_command, tmp_path / "trainer.log")
  processes = {"the watcher": watcher, "the trainer": trainer}

  def deliver(day):
    shutil.copy(tmp_path / "days" / f"day_{day}", incoming / f"day_{day}.tmp")
    os.rename(incoming / f"day_{day}.tmp", incoming / f"day_{day}")

  try:
    time.sleep(1.0)  # five polls of an empty directory
    assert watcher.poll() is None, "the watcher must wait for the first file"
    deliver(0)
    time.sleep(1.0)
    assert watcher.poll() is None, "the watcher must keep watching after a file"
    deliver(1)  # closes day 0
    _wait_for(lambda: _journal(run_dir), "the trainer started on period 0", processes)
    deliver(2)  # closes day 1: the trainer is killed in the middle of it
    _wait_for(lambda: len(_journal(run_dir)) >= STEPS + 10, "the trainer started period 1",
              processes)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    trained_at_kill = len(_journal(run_dir))
    assert STEPS < trained_at_kill < 2 * STEPS, "killed in the middle of period 1"
    trainer = processes["the trainer"] = _start(trainer_command, tmp_path / "restarted.log")
    deliver(3)  # the last day: closes day 2, and the watcher stops after writing day 3
    watcher.wait(timeout=180)
    trainer.wait(timeout=300)
  finally:
    for process in processes.values():
      if process.poll() is None:
        process.kill()
  assert watcher.returncode == 0, _tail(watcher.log_path)
  with open(watcher.log_path, errors="replace") as f:
    written = [line for line in f if "periods written:" in line]
  # A line as each period is written: day N closes day N - 1's, the last day the last two.
  for count in (1, 2, DAYS):
    assert any(f"periods written: {count} period" in line for line in written), written
  assert trainer.returncode == 0, _tail(trainer.log_path)

  with open(os.path.join(out, "stats.json")) as f:
    preprocessed = json.load(f)
  assert preprocessed["periods"] == DAYS and preprocessed["rows_out"] == DAYS * ROWS
  assert _manifest_days(out) == list(range(DAYS))
  # Each period trained exactly once: every (period, step) once, in order, none skipped.
  assert [(r["period"], r["step"]) for r in _journal(run_dir)] == [
      (p, s) for p in range(DAYS - 1) for s in range(STEPS)]
  with open(os.path.join(run_dir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(run_dir, "ledger.json")) as f:
    charges = json.load(f)["charges"]
  # The ledger is exact: one charge per period (its steps and DP Platt scaling, the first's DP
  # base rate too), each reading its day, none repeated by the restart; its ε is one period's
  # (rows live in one period: parallel composition) composed directly.
  steps = [(c["label"], c["steps"], c["days"]) for c in charges if c["sampling_rate"] < 1]
  assert steps == [(f"stream period {p}", STEPS, [p]) for p in range(DAYS - 1)]
  assert [(c["label"], c["days"]) for c in charges if c["sampling_rate"] == 1] == [
      ("stream period 0 calibration", [0]), ("stream base rate", [0])] + [
      (f"stream period {p} calibration", [p]) for p in range(1, DAYS - 1)]
  assert len({c["run_id"] for c in charges}) == 1
  plan = summary["plan"]
  mechanisms = [c["noise_multiplier"] for c in charges if c["days"] == [0]
                and c["sampling_rate"] == 1]
  expected = privacy.gaussian_epsilon(
      [privacy.gaussian_mechanism_period(s) for s in mechanisms]
      + [privacy.TrainingPeriod(plan["noise_multiplier"], plan["sampling_rate"], STEPS)],
      summary["delta"], "rdp")
  assert summary["epsilon"] == pytest.approx(expected, rel=1e-9)
  assert summary["privacy_unit"] == "row"
  assert all(r["log_loss"] is not None and r["base_rate_log_loss"] is not None
             for r in summary["periods"])
  assert summary["resumed"] and summary["stopped"] == f"trained the {DAYS - 1} training periods"
  assert [row["period"] for row in summary["periods"]] == list(range(DAYS - 1))
  assert all(row["auc"] is not None for row in summary["periods"])  # each evaluated on the next
  assert summary["holdout"]["days"] == [DAYS - 1]
