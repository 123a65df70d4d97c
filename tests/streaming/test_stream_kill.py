"""`kill -9` mid-period and restart: `dprec stream` ends exactly where an uninterrupted run does.

Both runs train the pCTR model with DP-AdaFEST on periods written by the Beam streaming job. The
killed run is restarted with the same command; its final ledger, the (period, step) pairs it
trained, its final weights and its per-period metrics must equal the uninterrupted run's. Both
run directories hold the same run id and secret noise key (one run started, then its directory
cloned before training): the key, reloaded on restart, is what makes the resumed noise exact.
Tables have no headroom (`--headroom 1`), so the ids new in period 1 grow them: the killed run
resumes from tables that grew after their widths were fixed, and so does a finished stream when
new days arrive.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import tensorflow as tf

from dprec import privacy
from dprec.data.synthetic import generate_criteo
from dprec.models.ctr import embedding_dim
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.training.period_source import BeamStreamSource
from dprec.workflows.ctr import WorseThanBaseRateWarning
from dprec.workflows.run import Run
from pipelines import criteo_stream

pytestmark = pytest.mark.commands

STEPS = 100  # 1,000 rows per day at an expected batch of 10
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_DETERMINISTIC_OPS="1",
           TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")


@pytest.fixture
def stream_output(once_per_session):
  """Three days of synthetic Criteo, through the streaming Beam job (one window per day), once a
  session (tests read it or copy it)."""
  def run(root):
    generate_criteo(str(root / "days"), rows=3000, days=3, seed=0, vocab="scaled:2k",
                    progress=False)
    job = criteo_stream.StreamJob(input_dir=str(root / "days"), output=str(root / "out"),
                                  poll_seconds=0.2, stop_after_day=2, idle_timeout=60)
    criteo_stream.run(job, ["--direct_num_workers=1", "--direct_running_mode=in_memory"])

  return str(once_per_session("stream_kill_days", run)[0] / "out")


def _command(data, run_dir, batch_size=10):
  """The stream's command; the kill test's batch of 10 gives `STEPS` steps a period, the other
  tests pass a larger one (a few steps a period: they check plans and keys, not training)."""
  return [sys.executable, "-m", "dprec.cli", "stream", "--data", data, "--run-dir", run_dir,
          "--algorithm", "dp_adafest", "--epsilon", "20", "--noise-multiplier", "1.0",
          "--accountant", "rdp", "--train-days", "2", "--batch-size", str(batch_size),
          "--hidden-units", "8", "--headroom", "1",
          "--checkpoint-every", "7", "--no-progress", "--diagnostics",
          "--summary-json", os.path.join(run_dir, "cli_summary.json")]


def _journal(run_dir):
  path = os.path.join(run_dir, "steps.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def _ledger(run_dir):
  with open(os.path.join(run_dir, "ledger.json")) as f:
    ledger = json.load(f)
  return [{k: v for k, v in c.items() if k not in ("time", "updated")} for c in ledger["charges"]]


def _latest(run_dir):
  with open(os.path.join(run_dir, "checkpoints", "LATEST")) as f:
    return os.path.join(run_dir, "checkpoints", f.read())


def _weights(run_dir):
  reader = tf.train.load_checkpoint(os.path.join(_latest(run_dir), "model"))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if "OBJECT_GRAPH" not in name}


def _assert_tables_keep_their_widths(run_dir):
  """The newest checkpoint's tables have the rows and widths its state records, widths fixed
  by period 0 that differ from those of the grown tables' rows in some table."""
  with open(os.path.join(_latest(run_dir), "state.json")) as f:
    state = json.load(f)
  rows, widths = state["table_rows"], state["model_shapes"]["embedding_dims"]
  weights = _weights(run_dir)
  for i, name in enumerate(state["table_names"]):
    key = f"model/embedding/tables/{i}/embeddings/.ATTRIBUTES/VARIABLE_VALUE"
    assert weights[key].shape == (rows[name], widths[name]), name
  assert any(widths[n] != embedding_dim(rows[n] - 1) for n in rows), "no table outgrew its width"


def _summary(run_dir):
  with open(os.path.join(run_dir, "cli_summary.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_sigkill_mid_period_and_restart_equals_an_uninterrupted_run(stream_output, tmp_path):
  plain, killed = str(tmp_path / "plain"), str(tmp_path / "killed")
  Run("stream", plain).close()  # run id and secret key, shared by both directories
  shutil.copytree(plain, killed)
  assert os.stat(os.path.join(killed, "secret", "noise_key")).st_mode & 0o777 == 0o600
  # The uninterrupted run and the run to be killed side by side (one core each).
  errors = open(tmp_path / "plain.err", "wb")
  reference = subprocess.Popen(_command(stream_output, plain), env=ENV,
                               stdout=subprocess.DEVNULL, stderr=errors)
  process = subprocess.Popen(_command(stream_output, killed), env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 300
    while len(_journal(killed)) < STEPS + 10 and time.monotonic() < deadline:
      assert process.poll() is None, "the trainer finished before it could be killed"
      time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
  finally:
    process.wait()
  trained_at_kill = len(_journal(killed))
  assert STEPS < trained_at_kill < 2 * STEPS, "killed in the middle of period 1"
  subprocess.run(_command(stream_output, killed), env=ENV, check=True, timeout=600,
                 stdout=subprocess.DEVNULL)
  reference.wait(timeout=600)
  errors.close()
  assert reference.returncode == 0, (tmp_path / "plain.err").read_text()[-2000:]

  # No spent budget forgotten, none paid twice: the same charges, period by period.
  assert _ledger(killed) == _ledger(plain)
  assert [c["label"] for c in _ledger(plain)] == [
      "stream period 0 calibration", "stream base rate", "stream period 0",
      "stream period 1 calibration", "stream period 1"]
  # Every (period, step) trained once, none skipped, with the same Poisson batch.
  def batches(run_dir):
    return [(r["period"], r["step"], r["diagnostics_nonprivate"]["batch_size"])
            for r in _journal(run_dir)]
  steps = batches(killed)
  assert steps == batches(plain)
  assert [(p, s) for p, s, _ in steps] == [(p, s) for p in range(2) for s in range(STEPS)]
  # The same model (weights, optimizer slots; no generator state) and the same metrics.
  plain_weights, killed_weights = _weights(plain), _weights(killed)
  assert plain_weights.keys() == killed_weights.keys()
  for name, value in plain_weights.items():
    np.testing.assert_allclose(killed_weights[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  plain_summary, killed_summary = _summary(plain), _summary(killed)
  assert killed_summary["resumed"] and not plain_summary["resumed"]
  for mine, theirs in zip(killed_summary["periods"], plain_summary["periods"]):
    assert {"period", "auc", "epsilon_so_far", "gradient_size_reduction"} <= mine.keys()
    for key in ("period", "auc", "epsilon_so_far", "gradient_size_reduction", "log_loss",
                "calibration_scale", "calibration_shift"):
      assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert mine["diagnostics_nonprivate"] == pytest.approx(theirs["diagnostics_nonprivate"],
                                                           rel=1e-5)
  assert killed_summary["holdout"]["auc"] == pytest.approx(plain_summary["holdout"]["auc"],
                                                           rel=1e-5)
  _assert_tables_keep_their_widths(killed)


def test_a_secure_and_an_insecure_cli_run_of_the_same_arguments_differ(stream_output, tmp_path):
  """The noise key is all that differs: a secure run and an insecure-seed run end apart. (Same
  key, same result: the SIGKILL test above; an insecure seed gives one key every time:
  test_noise_key; the stand-in's four-run version: test_stream_privacy.)"""
  from dprec import cli

  def run(name, *extra):
    run_dir = str(tmp_path / name)
    command = _command(stream_output, run_dir, batch_size=250)[3:] + ["--train-days", "1",
                                                                       "--seed", "7", *extra]
    assert cli.main(command) == 0
    return _summary(run_dir), _weights(run_dir)

  (secure, secure_weights) = run("a")
  with pytest.warns(InsecureNoiseWarning):
    (insecure, insecure_weights) = run("b", "--insecure-noise-seed", "3")
  assert secure["private"] and secure_weights.keys() == insecure_weights.keys()
  assert any(not np.array_equal(secure_weights[k], insecure_weights[k]) for k in secure_weights)
  assert insecure["private"] is False and "--insecure-noise-seed 3" in insecure["privacy_note"]


@pytest.mark.slow  # three streams of 2-3 periods: starts first
def test_a_finished_stream_continues_when_days_arrive_and_says_when_none_did(
    stream_output, tmp_path, capfd):
  """Not a live stream (--idle-timeout 0) and neither --expected-periods nor --train-days: the
  budget lasts the periods of the days present, and the summary says where that came from. Run
  on two days, the same command continues with the third once it arrives (tables grown by its
  new ids keep their widths; each period paid once, as by one run of three days), and says in
  one line that there is nothing new to train when no day arrived, charging nothing (also
  from a checkpoint that does not record the widths, as earlier versions wrote)."""
  from dprec import cli
  data, run_dir = str(tmp_path / "out"), str(tmp_path / "run")
  shutil.copytree(stream_output, data)
  manifest = os.path.join(data, "manifest.json")
  with open(manifest) as f:
    full = json.load(f)
  with open(manifest, "w") as f:  # as the Beam job's manifest was before day 2 closed
    json.dump(dict(full, days=full["days"][:2]), f)
  command = _command(data, run_dir, batch_size=250)[3:]
  at = command.index("--train-days")
  command = command[:at] + command[at + 2:]
  assert cli.main(command) == 0
  assert _summary(run_dir)["periods_trained"] == 2
  with open(manifest, "w") as f:
    json.dump(full, f)  # day 2 arrived
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cli.main(command) == 0
  summary = _summary(run_dir)
  # As `train ctr`: the yardstick is the constant at the evaluated period's click rate, and a
  # model worse than it is flagged.
  labels = BeamStreamSource(data, 1).period(2).load()[1]
  assert summary["eval_log_loss"] == summary["periods"][1]["log_loss"]
  assert summary["eval_base_rate"] == pytest.approx(labels.mean())
  assert summary["base_rate_log_loss"] == pytest.approx(
      -np.mean(labels * np.log(labels.mean()) + (1 - labels) * np.log1p(-labels.mean())))
  assert summary["worse_than_base_rate"] == (
      summary["eval_log_loss"] > summary["base_rate_log_loss"])
  assert summary["worse_than_base_rate"] == any(
      issubclass(w.category, WorseThanBaseRateWarning) for w in caught)
  assert summary["expected_periods"] == 3 and summary["periods_trained"] == 3
  assert summary["expected_periods_from"].startswith("the 3 days in ")
  assert summary["resumed"] and [r["period"] for r in summary["periods"]] == [0, 1, 2]
  assert summary["periods"][1]["auc"] is not None  # evaluated on period 2 once it arrived
  charges = _ledger(run_dir)
  assert [(c["label"], c["steps"]) for c in charges if c["sampling_rate"] < 1] == [
      (f"stream period {p}", summary["plan"]["steps_per_period"]) for p in range(3)]
  assert [c["label"] for c in charges if c["sampling_rate"] == 1] == [
      "stream period 0 calibration", "stream base rate", "stream period 1 calibration",
      "stream period 2 calibration"]
  plan = summary["plan"]
  expected = privacy.gaussian_epsilon(  # rows live in one period: the costliest period's ε
      [privacy.gaussian_mechanism_period(c["noise_multiplier"]) for c in charges
       if c["days"] == [0] and c["sampling_rate"] == 1]
      + [privacy.TrainingPeriod(plan["noise_multiplier"], plan["sampling_rate"],
                                plan["steps_per_period"])], summary["delta"], "rdp")
  assert summary["epsilon"] == pytest.approx(expected, rel=1e-9)
  _assert_tables_keep_their_widths(run_dir)
  ledger = (tmp_path / "run" / "ledger.json").read_bytes()
  state_path = os.path.join(_latest(run_dir), "state.json")
  with open(state_path) as f:
    state = json.load(f)
  with open(state_path, "w") as f:  # as earlier versions wrote it: widths only in the model
    json.dump({k: v for k, v in state.items() if k != "model_shapes"}, f)
  capfd.readouterr()
  assert cli.main(command) == 0  # no new day
  lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("dprec")]
  assert lines == [f"dprec stream: nothing new to train in {run_dir} (no complete period 3 "
                   "appeared within 0 s; the stream is idle); nothing charged"]
  assert (tmp_path / "run" / "ledger.json").read_bytes() == ledger
  assert _summary(run_dir)["periods"] == summary["periods"]
  _assert_tables_keep_their_widths(run_dir)
