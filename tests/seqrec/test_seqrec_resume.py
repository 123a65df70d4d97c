"""`train seqrec --run-dir`: a killed run resumes to the uninterrupted result, paying no step
twice; runs sharing a ledger, earlier charges on the data set composed."""
import os
import shutil

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from dprec.data import identity
from dprec.errors import BudgetExceededError, DprecError
from dprec.workflows.seqrec import SeqRecTrainOptions, options_from_checkpoint
from dprec.workflows.seqrec import run as train_seqrec
from dprec.privacy import PrivacyLedger
from dprec.privacy.ledger import PREPROCESSING
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.training import callbacks as callbacks_lib

pytestmark = pytest.mark.commands

KILL_AFTER_STEP = 5


def _options(sequences_dir, **overrides):
  # dropout 0: Keras' dropout masks are not part of the checkpoint; everything else is.
  options = dict(model="dpformer", data=sequences_dir, epsilon=5.0, epochs=2, batch_size=32,
                 max_len=8, dim=8, num_blocks=1, dropout=0.0, progress=False, checkpoint_every=3,
                 charge_every=2)
  return SeqRecTrainOptions(**dict(options, **overrides))


def _latest(run_dir):
  with open(os.path.join(run_dir, "checkpoints", "LATEST"), encoding="utf-8") as f:
    return os.path.join(run_dir, "checkpoints", f.read().strip())


def _final_variables(run_dir):
  reader = tf.train.load_checkpoint(os.path.join(_latest(run_dir), "model"))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if name.startswith(("model/", "optimizer/", "generator/"))}


def _charges(run_dir):
  return PrivacyLedger(os.path.join(run_dir, "ledger.json")).charges


def _steps_in_ledger(run_dir):
  return sum(charge["steps"] for charge in _charges(run_dir)
             if not charge["label"].endswith("item frequencies"))


def _clone_run(source, target):
  """A new run directory holding `source`'s run id and secret key (nothing else): it draws the
  same noise and batches, so it must end where `source` ended."""
  os.makedirs(target)
  shutil.copy(os.path.join(source, "run.json"), target)
  shutil.copytree(os.path.join(source, "secret"), os.path.join(target, "secret"))


def _kill_after_step(monkeypatch, step):
  timer_step_end = callbacks_lib.StepTimer.on_train_batch_end

  def killed_after_step(timer, batch, logs=None):
    timer_step_end(timer, batch, logs)
    if timer.steps == step:
      raise KeyboardInterrupt("killed")

  monkeypatch.setattr(callbacks_lib.StepTimer, "on_train_batch_end", killed_after_step)


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(sequences_dir, frequency_file, tmp_path,
                                                        monkeypatch):
  # Public p_i: the DP histogram's noise is secret, so two runs would differ (see below).
  path = frequency_file[0]
  whole = train_seqrec(_options(sequences_dir, run_dir=str(tmp_path / "whole"),
                                keep_checkpoints=None, item_frequencies=path))
  assert whole["steps"] == 7 and whole["resumed_from_step"] == 0
  kept = sorted(os.listdir(tmp_path / "whole" / "checkpoints"))
  # steps 3, 6, 7 (validation items held out)
  assert kept == ["LATEST"] + [f"ckpt-{n:06d}" for n in range(3)]
  saved_options = options_from_checkpoint(_latest(str(tmp_path / "whole")))
  assert saved_options.run_fingerprint() == _options(
      sequences_dir, item_frequencies=path).run_fingerprint()

  # The secret key, reloaded from the run directory, is what makes the resumed noise exact.
  _kill_after_step(monkeypatch, KILL_AFTER_STEP)
  killed_dir = str(tmp_path / "killed")
  _clone_run(str(tmp_path / "whole"), killed_dir)
  with pytest.raises(KeyboardInterrupt):
    train_seqrec(_options(sequences_dir, run_dir=killed_dir, item_frequencies=path))
  # Steps 4 and 5 were trained and paid for (in blocks of 2: through step 6) after the last
  # checkpoint (step 3); the resumed run trains them again without paying again.
  assert _steps_in_ledger(killed_dir) == 6
  monkeypatch.undo()

  resumed = train_seqrec(_options(sequences_dir, run_dir=killed_dir, item_frequencies=path))
  assert resumed["resumed_from_step"] == 3
  assert len(os.listdir(os.path.join(killed_dir, "checkpoints"))) == 1 + 2  # LATEST, newest 2
  assert _steps_in_ledger(killed_dir) == whole["steps"]
  assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-12)
  expected, got = _final_variables(str(tmp_path / "whole")), _final_variables(killed_dir)
  assert expected.keys() == got.keys() and any(k.startswith("model/") for k in got)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, atol=1e-5, err_msg=name)
  assert resumed["ndcg_at_10"] == pytest.approx(whole["ndcg_at_10"])

  # evaluates again
  again = train_seqrec(_options(sequences_dir, run_dir=killed_dir, item_frequencies=path))
  assert again["resumed_from_step"] == whole["steps"] and again["epsilon"] == resumed["epsilon"]
  with pytest.raises(DprecError, match="epochs: 2 there, 3 now"):
    train_seqrec(_options(sequences_dir, run_dir=killed_dir, item_frequencies=path, epochs=3))


def test_resumed_run_keeps_its_dp_frequencies_and_pays_for_them_once(sequences_dir, tmp_path,
                                                                     monkeypatch):
  run_dir = str(tmp_path / "run")
  _kill_after_step(monkeypatch, KILL_AFTER_STEP)
  with pytest.raises(KeyboardInterrupt):
    train_seqrec(_options(sequences_dir, run_dir=run_dir, keep_checkpoints=None))
  monkeypatch.undo()
  resumed = train_seqrec(_options(sequences_dir, run_dir=run_dir, keep_checkpoints=None))
  assert resumed["resumed_from_step"] == 3
  histogram = [c for c in _charges(run_dir)
               if c["label"] == resumed["item_frequencies"]["ledger_label"]]
  assert len(histogram) == 1 and _steps_in_ledger(run_dir) == resumed["steps"]
  first = tf.train.load_checkpoint(os.path.join(run_dir, "checkpoints", "ckpt-000000", "model"))
  last = tf.train.load_checkpoint(os.path.join(_latest(run_dir), "model"))
  name = next(n for n in last.get_variable_to_shape_map() if "item_variance" in n)
  np.testing.assert_array_equal(first.get_tensor(name), last.get_tensor(name))
  assert resumed["epsilon"] <= 5.0 + 1e-6


def test_runs_sharing_a_ledger_each_pay_with_or_without_a_run_dir(sequences_dir, tmp_path):
  ledger = str(tmp_path / "ledger.json")
  first = train_seqrec(_options(sequences_dir, epochs=0.5, ledger=ledger))  # no run directory
  assert first["epsilon"] <= 5.0 + 1e-6
  for run_dir in (None, str(tmp_path / "b")):
    with pytest.raises(BudgetExceededError, match="already spent"):
      train_seqrec(_options(sequences_dir, epochs=0.5, ledger=ledger, run_dir=run_dir))
  assert {c["run_id"] for c in PrivacyLedger(ledger).charges} == {first["run_id"]}


def _run_privately(sequences_dir, run_dir, **overrides):
  summary = train_seqrec(_options(sequences_dir, run_dir=run_dir, epochs=1, seed=7, **overrides))
  return summary, _final_variables(run_dir)


def test_the_key_is_secret_and_all_that_differs_between_runs_of_the_same_arguments(
    sequences_dir, tmp_path):
  """A secure run keeps its key in the secret file alone, and ends apart from an insecure-seed
  run of the same arguments. (Same key, same result: the killed-run test above; an insecure seed
  gives one key every time: test_noise_key.) An insecure run resumes only as it started."""
  run_dir = tmp_path / "a"
  secure, secure_weights = _run_privately(sequences_dir, str(run_dir),
                                          summary_json=str(tmp_path / "summary.json"))
  key_path = run_dir / "secret" / "noise_key"
  assert os.stat(key_path).st_mode & 0o777 == 0o600
  key = key_path.read_bytes()
  outputs = [p for p in tmp_path.rglob("*") if p.is_file() and "secret" not in p.parts]
  assert any("ckpt-" in str(p) for p in outputs) and len(outputs) > 5
  for path in outputs:
    content = path.read_bytes()
    assert key not in content and key.hex().encode() not in content, path
  variables = tf.train.list_variables(os.path.join(_latest(str(run_dir)), "model"))
  assert not any("generator" in name or "/state/" in name
                 for name, _ in variables)  # no Philox state in the checkpoint
  assert "final_loss" not in secure and "diagnostics_nonprivate" not in secure
  assert "training data of this run" in secure["epsilon_covers"]["held_out_evaluation"]

  with pytest.warns(InsecureNoiseWarning):
    insecure, insecure_weights = _run_privately(sequences_dir, str(tmp_path / "c"),
                                                insecure_noise_seed=3)
  assert secure["private"] and secure_weights.keys() == insecure_weights.keys()
  assert any(not np.array_equal(secure_weights[k], insecure_weights[k]) for k in secure_weights)
  assert insecure["private"] is False and "--insecure-noise-seed 3" in insecure["privacy_note"]
  assert all(c["private"] is False and c["run_id"] == insecure["run_id"]
             for c in _charges(str(tmp_path / "c")))
  with pytest.raises(DprecError, match="insecure_noise_seed"):  # resumes only as it started
    train_seqrec(_options(sequences_dir, run_dir=str(tmp_path / "c"), epochs=1, seed=7))


def test_diagnostics_are_reported_under_a_name_that_says_so(sequences_dir):
  diagnosed = train_seqrec(_options(sequences_dir, epochs=0.5, diagnostics=True))
  assert "final_loss" in diagnosed["diagnostics_nonprivate"]


def test_a_preprocessing_charge_on_the_data_set_is_composed_with_training(sequences_dir, tmp_path):
  ledger = str(tmp_path / "ledger.json")
  dataset = identity.dataset_identity(sequences_dir)
  PrivacyLedger(ledger, 5.0, 1e-3, run_id=dataset["id"], marks={
      "stage": PREPROCESSING, "dataset": dataset}).charge_pure(1.0, label="item vocabulary")
  summary = train_seqrec(_options(sequences_dir, epochs=0.5, ledger=ledger))
  assert summary["delta"] == 1e-3  # the ledger's
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(summary["item_frequencies"][
      "noise_multiplier"]))
  accountant.compose(dp_accounting.PoissonSampledDpEvent(summary["sampling_rate"],
      dp_accounting.GaussianDpEvent(summary["noise_multiplier"])), summary["steps"])
  training = accountant.get_epsilon(1e-3)
  assert 4.0 * (1 - 5e-3) < training <= 4.0 + 1e-9  # calibrated for what the charge left
  assert summary["epsilon"] == pytest.approx(1.0 + training, rel=1e-6)
  parts = summary["epsilon_parts"]
  assert parts["preprocessing_selection"]["epsilon"] == 1.0
  assert parts["training"]["epsilon"] == pytest.approx(training, rel=1e-6)
  assert summary["dataset"]["id"] == dataset["id"] is not None


def test_ctrl_c_keeps_a_checkpoint_says_how_to_resume_and_the_rerun_goes_on(sequences_dir,
                                                                          tmp_path):
  """Ctrl-C (SIGINT) mid-training: one line naming the run directory and the command, exit 130,
  a checkpoint of the last whole step (its charge already in the ledger); the same command
  resumes past step 0 and charges no step twice."""
  import json
  import signal
  import subprocess
  import sys
  import time
  run_dir = str(tmp_path / "run")
  argv = ["train", "seqrec", "--data", sequences_dir, "--model", "dpformer", "--epsilon", "5",
          "--epochs", "3", "--batch-size", "8", "--max-len", "8", "--dim", "8", "--blocks", "1",
          "--dropout", "0", "--charge-every", "1000", "--run-dir", run_dir]
  command = [sys.executable, "-m", "dprec.cli", *argv]
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  ledger = os.path.join(run_dir, "ledger.json")
  while not (os.path.exists(ledger) and _steps_in_ledger(run_dir)):  # training has begun
    assert process.poll() is None, process.communicate()
    time.sleep(0.05)
  process.send_signal(signal.SIGINT)
  out, err = process.communicate(timeout=300)
  assert process.returncode == 130 and out == "", err
  line = err.strip().splitlines()[-1]
  assert "Traceback" not in err and line.startswith("dprec: interrupted: "), err
  assert f"{run_dir} keeps its checkpoint at step" in line and ledger in line
  assert line.endswith("dprec " + " ".join(argv))
  paid = _steps_in_ledger(run_dir)
  subprocess.run(command, capture_output=True, text=True, check=True)  # the same command
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:  # --run-dir's summary
    summary = json.load(f)
  assert 0 < summary["resumed_from_step"] < summary["steps"] == paid == _steps_in_ledger(run_dir)


def test_the_default_checkpoint_cadence_fits_a_short_run():
  """A run shorter than 100 steps checkpoints four times, not only at its end."""
  assert _options("d").checkpoint_every == 3
  default = SeqRecTrainOptions(data="d", epsilon=1.0)
  assert [default.checkpoint_interval(steps) for steps in (64, 3, 1000)] == [16, 1, 100]
