"""`dprec train ctr` end to end on tiny generated Criteo data: summary, ledger, errors, resume."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from dprec import cli
from dprec import privacy
from dprec.errors import DprecError
from dprec.models import ctr as ctr_model
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.training.checkpoint import CheckpointFallbackWarning
from dprec.workflows import ctr as ctr_workflow

pytestmark = pytest.mark.commands

STEPS, BATCH, EPSILON = 6, 64, 2.0
REQUIRED = {"algorithm", "auc", "epsilon", "delta", "gradient_size_reduction", "steps_per_second"}


@pytest.fixture(scope="module")
def data_dir(criteo_days):
  return criteo_days(1500, 3)


def _train(data_dir, tmp_path, algorithm, *extra):
  summary_path = tmp_path / "summary.json"
  argv = ["train", "ctr", "--data", data_dir, "--algorithm", algorithm, "--batch-size",
          str(BATCH), "--steps", str(STEPS), "--hidden-units", "8", "--no-progress",
          "--summary-json", str(summary_path), "--charge-every", "4", *extra]
  if algorithm != "non_private":
    argv += ["--epsilon", str(EPSILON), "--ledger", str(tmp_path / "ledger.json")]
  assert cli.main(argv) == 0
  with open(summary_path, encoding="utf-8") as stream:
    return json.load(stream)


@pytest.fixture
def dp_sgd_run(data_dir, once_per_session):
  """(directory, summary) of one DP-SGD run (RDP accountant, a run directory and TensorBoard
  logs) that three tests read: its charges, its secret key kept out of every output, its default
  noise."""
  return once_per_session("train_ctr_dp_sgd", lambda out: _train(
      data_dir, out, "dp_sgd", "--accountant", "rdp", "--run-dir", str(out / "run"), "--log-dir",
      str(out / "logs")))


@pytest.fixture
def dp_sgd_diagnostics_run(data_dir, once_per_session):
  """(directory, summary) of one DP-SGD run with --diagnostics and --calibration-share 0, read by
  the tests of those two options (apart: the summary's diagnostics fields; the calibration's
  fields and charge)."""
  return once_per_session("train_ctr_dp_sgd_diagnostics", lambda out: _train(
      data_dir, out, "dp_sgd", "--diagnostics", "--calibration-share", "0"))


@pytest.mark.parametrize("algorithm, extra", [
    ("dp_sgd", ()),
    ("dp_adafest_plus", ("--top-k-total", "260", "--top-k-epsilon", "0.2", "--threshold", "2")),
    ("dp_sgd_lazy", ("--optimizer", "table_sgd", "--momentum", "0.9")),
])
def test_private_run_spends_what_dprec_privacy_computes(data_dir, tmp_path, algorithm, extra,
                                                       request):
  if algorithm == "dp_sgd":  # the shared run: its run directory and logs charge nothing more
    tmp_path, summary = request.getfixturevalue("dp_sgd_run")
  else:
    summary = _train(data_dir, tmp_path, algorithm, "--accountant", "rdp", *extra)
  assert REQUIRED <= set(summary) and summary["algorithm"] == algorithm
  assert summary["learning_rate"] == ctr_workflow.DEFAULT_LEARNING_RATES["private"]
  assert summary["hidden_units"] == [8]
  assert 0.0 <= summary["auc"] <= 1.0 and summary["steps"] == STEPS
  assert summary["delta"] == pytest.approx(1.0 / summary["train_rows"])
  assert summary["sampling_rate"] == pytest.approx(BATCH / summary["train_rows"])
  sigma = summary["sigma2"]
  if algorithm.startswith("dp_adafest"):
    assert summary["sigma1"] == pytest.approx(ctr_workflow.CTRTrainOptions.ratio * sigma)
    sigma = privacy.composed_noise_multiplier(summary["sigma1"], summary["sigma2"])
  selection = 0.2 if "--top-k-total" in extra else 0.0
  # Training composed with the DP base rate (one Gaussian mechanism on the label sum) and the
  # DP Platt scaling (its releases compose to one Gaussian mechanism).
  expected = privacy.gaussian_epsilon(
      [privacy.gaussian_mechanism_period(summary["base_rate_noise_multiplier"]),
       privacy.gaussian_mechanism_period(summary["calibration_noise_multiplier"]),
       privacy.TrainingPeriod(sigma, summary["sampling_rate"], STEPS)],
      summary["delta"], accountant="rdp") + selection
  ledger = privacy.PrivacyLedger(str(tmp_path / "ledger.json"))
  assert ledger.epsilon_spent() == pytest.approx(expected, rel=1e-9)
  assert summary["epsilon"] == pytest.approx(expected, rel=1e-9)
  assert expected <= EPSILON * (1 + 1e-6) and expected > 0.95 * EPSILON  # calibrated, not loose
  if algorithm == "dp_sgd":
    assert summary["gradient_size_reduction"] == pytest.approx(1.0, rel=1e-3)
  elif algorithm == "dp_sgd_lazy":  # accounted as DP-SGD; its gradient: the rows touched
    assert summary["gradient_size_reduction"] > 1.0 and summary["sigma1"] is None
  else:
    assert summary["gradient_size_reduction"] > 1.0


def test_secure_noise_run_is_accounted_as_the_gaussian_mechanism_it_rounds(data_dir, tmp_path,
                                                                          dp_sgd_run):
  """--secure-noise releases the Gaussian mechanism rounded to a grid (post-processing), so ε is
  the Gaussian accountant's: here dp_accounting's RDP accountant called directly on the run's
  events (the DP base rate, DP Platt scaling, then T Poisson-sampled Gaussian steps at the
  composed σ)."""
  import dp_accounting
  summary = _train(data_dir, tmp_path, "dp_adafest", "--secure-noise", "--threshold", "2",
                   "--accountant", "rdp")
  assert summary["secure_noise"] is True and summary["private"] is True
  sigma = privacy.composed_noise_multiplier(summary["sigma1"], summary["sigma2"])
  accountant = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  accountant.compose(dp_accounting.GaussianDpEvent(summary["base_rate_noise_multiplier"]))
  accountant.compose(dp_accounting.GaussianDpEvent(summary["calibration_noise_multiplier"]))
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      summary["sampling_rate"], dp_accounting.GaussianDpEvent(sigma)), STEPS)
  assert summary["epsilon"] == pytest.approx(accountant.get_epsilon(summary["delta"]), rel=1e-9)
  assert summary["gradient_size_reduction"] > 1.0  # still sparse
  assert dp_sgd_run[1]["secure_noise"] is False  # the default


def test_non_private_run_and_summary(data_dir, tmp_path):
  summary = _train(data_dir, tmp_path, "non_private", "--optimizer", "adam")
  assert REQUIRED <= set(summary)
  assert summary["learning_rate"] == ctr_workflow.DEFAULT_LEARNING_RATES["non_private"]
  assert summary["epsilon"] is None and summary["steps"] == STEPS
  assert summary["gradient_size_reduction"] > 1.0  # the plain gradient is row-sparse
  assert summary["eval_rows"] > 0 and summary["train_rows"] > summary["eval_rows"]



def test_bad_inputs_are_one_line_errors(data_dir, tmp_path, cli_error):
  base = ["train", "ctr", "--steps", "2", "--no-progress"]
  assert "needs a positive --epsilon" in cli_error(
      base + ["--data", data_dir, "--algorithm", "dp_sgd"])
  assert "needs --top-k" in cli_error(
      base + ["--data", data_dir, "--algorithm", "dp_fest", "--epsilon", "1"])
  assert f"{tmp_path / 'nowhere'}: --data does not exist" in cli_error(
      base + ["--data", str(tmp_path / "nowhere"), "--algorithm", "non_private"])
  (tmp_path / "a_file").write_text("")
  assert "must be a directory" in cli_error(
      base + ["--data", str(tmp_path / "a_file"), "--algorithm", "non_private"])
  broken = tmp_path / "broken"
  broken.mkdir()
  for day in (0, 1):
    with open(os.path.join(data_dir, f"day_{day}"), encoding="utf-8") as source:
      lines = source.readlines()[:50]
    if day == 0:
      lines[6] = "2" + lines[6][1:]  # label must be 0/1
    (broken / f"day_{day}").write_text("".join(lines), encoding="utf-8")
  assert "day_0:7" in cli_error(base + ["--data", str(broken), "--algorithm",
                                             "non_private"])
  lines = (broken / "day_0").read_bytes().split(b"\n")
  lines[6] = b"\x00\x01\xff\xfe\x80"  # a binary line: pyarrow's reader located nothing
  (broken / "day_0").write_bytes(b"\n".join(lines))
  assert f"{broken / 'day_0'}:7: field label: not UTF-8 text" in cli_error(
      base + ["--data", str(broken), "--algorithm", "non_private"])


def test_refuses_a_ledger_with_nothing_useful_left(data_dir, tmp_path, cli_error):
  ledger_path = tmp_path / "ledger.json"
  rows = sum(1 for _ in open(os.path.join(data_dir, "day_0"), encoding="utf-8")) + \
      sum(1 for _ in open(os.path.join(data_dir, "day_1"), encoding="utf-8"))
  ledger = privacy.PrivacyLedger(str(ledger_path), epsilon_budget=EPSILON, delta=1.0 / rows,
                                 accountant="rdp")
  ledger.charge_pure(EPSILON - 0.01, label="an earlier release")
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd", "--epsilon",
                        str(EPSILON), "--steps", "2", "--batch-size", "64", "--accountant", "rdp",
                        "--ledger",
                        str(ledger_path), "--no-progress", "--hidden-units", "4"])
  assert "already spent epsilon 1.99" in err and "nothing useful is left" in err
  assert privacy.PrivacyLedger(str(ledger_path)).epsilon_spent() == pytest.approx(EPSILON - 0.01)


def test_beam_manifest_directory_loads_like_the_tsv_days(data_dir, tmp_path):
  """`--data` given the Beam job's layout (manifest + per-day TFRecords) yields the same arrays
  as the TSV days it was made from (written here with the Beam helper's own encoder)."""
  from dprec.data import criteo, criteo_tfrecord
  from_tsv = ctr_workflow.load_data(data_dir)
  out = tmp_path / "beam"
  days = []
  for day, arrays in enumerate((from_tsv.train, from_tsv.eval)):
    (out / f"day_{day}").mkdir(parents=True)
    rows = criteo_tfrecord.write_tfrecord(str(out / f"day_{day}" / "part-0.tfrecord"),
                                          criteo_tfrecord.encode_examples(arrays))
    days.append({"day": day, "dir": f"day_{day}", "files": ["part-0.tfrecord"], "rows": rows})
  manifest = {"format": criteo_tfrecord.FORMAT, "integer_features": criteo.INTEGER_FEATURES,
              "categorical_features": criteo.CATEGORICAL_FEATURES, "days": days,
              "vocab_sizes": dict(zip(criteo.CATEGORICAL_FEATURES, from_tsv.vocab_sizes)),
              "vocab_dir": "vocab"}
  (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
  from_beam = ctr_workflow.load_data(str(out))
  assert from_beam.source == "beam-manifest" and from_beam.vocab_sizes == from_tsv.vocab_sizes
  for split in ("train", "eval"):
    for key, value in getattr(from_tsv, split).items():
      np.testing.assert_array_equal(getattr(from_beam, split)[key], value)


NOT_PRIVATE_FIELDS = {"train_loss", "train_auc"}


def _train_keeping_model(data_dir, tmp_path, monkeypatch, *extra):
  """`_train` (DP-AdaFEST) that also returns the trained model's weights."""
  from dprec.models import ctr
  built, build = [], ctr.build_ctr_model
  monkeypatch.setattr(ctr, "build_ctr_model", lambda *a, **k: built.append(build(*a, **k))
                      or built[-1])
  tmp_path.mkdir(exist_ok=True)
  summary = _train(data_dir, tmp_path, "dp_adafest", "--threshold", "2", *extra)
  return summary, built[-1].get_weights()


def test_a_secure_and_an_insecure_run_of_the_same_arguments_draw_different_noise(
    data_dir, tmp_path, monkeypatch):
  """The noise key is all that differs between two runs of the same arguments: a secure run and
  one with an insecure seed end apart. (Same key, same result: the SIGKILL test below, whose
  runs share one insecure key; an insecure seed gives one key every time: test_noise_key.)"""
  secure, secure_weights = _train_keeping_model(data_dir, tmp_path / "a", monkeypatch, "--seed",
                                                "7")
  with pytest.warns(InsecureNoiseWarning):
    insecure, insecure_weights = _train_keeping_model(data_dir, tmp_path / "b", monkeypatch,
                                                      "--seed", "7", "--insecure-noise-seed", "3")
  assert secure["private"] and secure["run_id"] != insecure["run_id"]
  assert not all(np.array_equal(a, b) for a, b in zip(secure_weights, insecure_weights))
  assert insecure["private"] is False and "--insecure-noise-seed 3" in insecure["privacy_note"]
  charges = privacy.PrivacyLedger(str(tmp_path / "b" / "ledger.json")).charges
  assert charges and all(c["private"] is False and c["run_id"] == insecure["run_id"]
                         for c in charges)


def test_run_dir_keeps_a_private_key_that_no_output_contains(dp_sgd_run):
  tmp_path, summary = dp_sgd_run
  run_dir, logs = tmp_path / "run", tmp_path / "logs"
  key_path = run_dir / "secret" / "noise_key"
  assert os.stat(key_path).st_mode & 0o777 == 0o600 and len(key_path.read_bytes()) == 32
  key = key_path.read_bytes()
  run = json.loads((run_dir / "run.json").read_text())
  assert run["run_id"] == summary["run_id"] and run["command"] == "train ctr"
  outputs = [p for p in tmp_path.rglob("*") if p.is_file() and "secret" not in p.parts]
  assert len(outputs) >= 4  # summary, ledger, run.json, TensorBoard events
  for path in outputs:
    content = path.read_bytes()
    assert key not in content and key.hex().encode() not in content, path
  # No class-(c) field by default; no Keras TensorBoard scalars of the training loss either.
  assert not set(summary) & NOT_PRIVATE_FIELDS and "diagnostics_nonprivate" not in summary
  assert set(summary["epsilon_covers"]) >= {"epsilon", "covered", "public",
                                            "held_out_evaluation"}
  assert not (logs / "diagnostics_nonprivate").exists()


def test_diagnostics_are_reported_under_a_name_that_says_so(dp_sgd_diagnostics_run):
  summary = dp_sgd_diagnostics_run[1]
  assert not set(summary) & NOT_PRIVATE_FIELDS
  assert {"train_loss", "train_auc"} <= set(summary["diagnostics_nonprivate"])


def test_a_second_run_on_a_shared_ledger_pays_and_is_refused_at_the_budget(
    data_dir, tmp_path, cli_error):
  """One dp_sgd run (--calibration-share 0.1) serves three checks: DP Platt scaling is
  charged once, a second run on its ledger is refused at the budget, and a rerun after the
  ledger was deleted says so."""
  run_dir = tmp_path / "a"
  first = _train(data_dir, tmp_path, "dp_sgd", "--run-dir", str(run_dir), "--calibration-share",
                 "0.1")
  charges = privacy.PrivacyLedger(str(tmp_path / "ledger.json")).charges
  assert {c["run_id"] for c in charges} == {first["run_id"]}
  _assert_platt_scaling_charged_once(first, charges)
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd",
                        "--epsilon", str(EPSILON), "--batch-size", str(BATCH), "--steps",
                        str(STEPS), "--hidden-units", "8", "--no-progress", "--charge-every",
                        "4", "--ledger", str(tmp_path / "ledger.json"), "--run-dir",
                        str(tmp_path / "b")])
  assert "already spent" in err
  # A run whose ledger was deleted says so.
  (tmp_path / "ledger.json").unlink()
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd",
                        "--batch-size", str(BATCH), "--steps", str(STEPS), "--hidden-units", "8",
                        "--no-progress", "--charge-every", "4", "--epsilon", str(EPSILON),
                        "--ledger", str(tmp_path / "ledger.json"), "--run-dir", str(run_dir)])
  assert "holds 0 steps of run" in err and f"have trained {STEPS}" in err
  assert "ledger was deleted or replaced" in err and "Put the run's ledger back" in err


def test_rerunning_a_finished_run_evaluates_it_again_and_other_settings_are_refused(
    data_dir, tmp_path, cli_error, capsys):
  first = _train(data_dir, tmp_path, "non_private", "--run-dir", str(tmp_path / "run"))
  assert "finished" not in capsys.readouterr().err
  again = _train(data_dir, tmp_path, "non_private", "--run-dir", str(tmp_path / "run"))
  assert f"finished its {STEPS} steps before: evaluating its model again (nothing charged)" \
      in capsys.readouterr().err
  assert first["resumed_from_step"] == 0 and again["resumed_from_step"] == STEPS
  assert again["run_id"] == first["run_id"] and again["auc"] == first["auc"]
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "non_private",
                        "--steps", "2", "--batch-size", str(BATCH), "--hidden-units", "8",
                        "--no-progress", "--run-dir", str(tmp_path / "run")])
  assert f"steps: {STEPS} there, 2 now" in err
  # A run written before an option existed (its fingerprint lacks it) resumes while the option
  # is at its default, which keeps the old behaviour; at another value it is refused.
  for state_path in (tmp_path / "run" / "checkpoints").glob("ckpt-*/state.json"):
    state = json.loads(state_path.read_text())
    del state["fingerprint"]["stack_tables"]
    state_path.write_text(json.dumps(state))
  older = _train(data_dir, tmp_path, "non_private", "--run-dir", str(tmp_path / "run"))
  assert older["resumed_from_step"] == STEPS and older["auc"] == first["auc"]
  capsys.readouterr()
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "non_private",
                        "--steps", str(STEPS), "--batch-size", str(BATCH), "--hidden-units", "8",
                        "--no-progress", "--stack-tables", "--run-dir", str(tmp_path / "run")])
  assert "stack_tables: 0 there, 8 now" in err


def test_stacked_tables_train_resume_only_stacked_and_the_audit_refuses_them(
    data_dir, tmp_path, cli_error):
  """`--stack-tables` (M alone: 8) trains DP-AdaFEST with one variable per stack width, which the
  checkpoint holds; a rerun without it is refused (not mis-restored), and so is the audit, whose
  canary scores read one table per column."""
  run_dir = tmp_path / "run"
  summary = _train(data_dir, tmp_path, "dp_adafest", "--stack-tables", "--run-dir", str(run_dir))
  assert summary["steps"] == STEPS and summary["gradient_size_reduction"] > 1.0
  latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
  tables = [shape for name, shape in tf.train.list_variables(
      str(run_dir / "checkpoints" / latest / "model"))
              if name.startswith("model/embedding/tables/")]
  # The tiny data's widths are all <= 8: one stack, holding more than the tables (padding).
  assert len(tables) == 1 and tables[0][1] == 8, tables
  assert tables[0][0] * 8 > summary["dense_embedding_size"]
  base = ["--data", data_dir, "--algorithm", "dp_adafest", "--batch-size", str(BATCH),
          "--steps", str(STEPS), "--hidden-units", "8", "--no-progress", "--epsilon",
          str(EPSILON)]
  err = cli_error(["train", "ctr", *base, "--charge-every", "4", "--ledger",
                        str(tmp_path / "ledger.json"), "--run-dir", str(run_dir)])
  assert "stack_tables: 8 there, 0 now" in err
  err = cli_error(["audit", *base, "--canaries", "8", "--stack-tables", "1"])
  assert "--stack-tables" in err and "audit without it" in err


def _ckpt_data_files(run_dir, number):
  directory = run_dir / "checkpoints" / f"ckpt-{number:06d}"
  return sorted(directory.glob("model.data-*"))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(data_dir, tmp_path, cli_error):
  """A truncated `model.data-*` in the newest checkpoint (a full disk, a broken copy): the rerun
  says so, resumes from the previous checkpoint, retrains the steps since without paying them
  again; with no checkpoint that restores it says what to do."""
  run_dir = tmp_path / "run"
  first = _train(data_dir, tmp_path, "dp_sgd", "--run-dir", str(run_dir), "--checkpoint-every",
                 "3")
  assert first["steps"] == STEPS
  ledger = (tmp_path / "ledger.json").read_bytes()
  for data_file in _ckpt_data_files(run_dir, 1):
    data_file.write_bytes(data_file.read_bytes()[:data_file.stat().st_size // 2])
  with pytest.warns(CheckpointFallbackWarning, match="ckpt-000001.*older checkpoint .*ckpt-000000"):
    again = _train(data_dir, tmp_path, "dp_sgd", "--run-dir", str(run_dir), "--checkpoint-every",
                   "3")
  assert again["resumed_from_step"] == 3 and again["steps"] == STEPS
  assert again["epsilon"] == first["epsilon"]
  assert (tmp_path / "ledger.json").read_bytes() == ledger  # every charge kept, none added
  for number in (2, 3):  # the new checkpoints; now damage every one
    for data_file in _ckpt_data_files(run_dir, number):
      data_file.write_bytes(b"")
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd",
                        "--batch-size", str(BATCH), "--steps", str(STEPS), "--hidden-units", "8",
                        "--no-progress", "--charge-every", "4", "--epsilon", str(EPSILON),
                        "--ledger", str(tmp_path / "ledger.json"), "--run-dir", str(run_dir),
                        "--checkpoint-every", "3"])
  assert "no checkpoint in" in err and "restores" in err and "move the directory aside" in err
  assert (tmp_path / "ledger.json").read_bytes() == ledger


KILL_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_DETERMINISTIC_OPS="1",
                TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
KILL_STEPS = 24


def _kill_argv(data_dir, run_dir):
  """Checkpoints every 3 steps, charges every 5: a resumed run retrains prepaid steps."""
  return ["train", "ctr", "--data", data_dir, "--algorithm", "dp_adafest_plus", "--top-k-total",
          "260", "--threshold", "2", "--epsilon", str(EPSILON), "--accountant", "rdp",
          "--batch-size",
          "32", "--steps", str(KILL_STEPS), "--hidden-units", "8", "--charge-every", "5",
          "--checkpoint-every", "3", "--insecure-noise-seed", "3", "--no-progress", "--run-dir",
          run_dir, "--summary-json", os.path.join(run_dir, "summary.json")]


def _kill_command(data_dir, run_dir):
  return [sys.executable, "-m", "dprec.cli"] + _kill_argv(data_dir, run_dir)


def _final_weights(run_dir):
  """The model's weights and optimizer variables (slots, step) in the final checkpoint; not the
  Keras metric states (loss/AUC/gradient-size means since the process's `fit` began)."""
  checkpoints = os.path.join(run_dir, "checkpoints")
  with open(os.path.join(checkpoints, "LATEST"), encoding="utf-8") as f:
    reader = tf.train.load_checkpoint(os.path.join(checkpoints, f.read().strip(), "model"))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if name.startswith(("model/", "optimizer/"))
          and not any(metric in name for metric in ("_tracker/", "_metrics/"))}


def _charges(run_dir):
  return [{k: v for k, v in c.items() if k not in ("time", "updated", "run_id")}
          for c in privacy.PrivacyLedger(os.path.join(run_dir, "ledger.json")).charges]


@pytest.mark.slow
def test_sigkill_mid_run_and_rerun_equals_an_uninterrupted_run(data_dir, tmp_path):
  """`train ctr --run-dir D` killed (SIGKILL) mid-run and rerun: the same weights, optimizer
  slots and ledger as an uninterrupted run (exact with --insecure-noise-seed: same noise,
  batches, DP top-k rows and DP base rate), no step paid twice, no charge repeated."""
  plain, killed = str(tmp_path / "plain"), str(tmp_path / "killed")
  reference = subprocess.Popen(_kill_command(data_dir, plain), env=KILL_ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  process = subprocess.Popen(_kill_command(data_dir, killed), env=KILL_ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    first_checkpoint = os.path.join(killed, "checkpoints", "ckpt-000000")
    deadline = time.monotonic() + 300
    while not os.path.exists(first_checkpoint) and time.monotonic() < deadline:
      assert process.poll() is None, "the run finished before it could be killed"
      time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
  finally:
    process.wait()
  assert not os.path.exists(os.path.join(killed, "summary.json")), "killed mid-run"
  subprocess.run(_kill_command(data_dir, killed), env=KILL_ENV, check=True, timeout=600,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  _, errors = reference.communicate(timeout=600)
  assert reference.returncode == 0, errors.decode()[-2000:]

  with open(os.path.join(killed, "summary.json"), encoding="utf-8") as f:
    resumed = json.load(f)
  with open(os.path.join(plain, "summary.json"), encoding="utf-8") as f:
    whole = json.load(f)
  assert 0 < resumed["resumed_from_step"] < KILL_STEPS and whole["resumed_from_step"] == 0
  assert resumed["steps"] == whole["steps"] == KILL_STEPS
  # The same charges: base rate, Platt scaling, DP top-k once each, and every step paid once.
  assert _charges(killed) == _charges(plain)
  labels = [c["label"] for c in _charges(plain)]
  assert labels == ["train ctr base rate", "train ctr calibration", "dp-fest top-k",
                    "train ctr dp_adafest_plus"]
  assert _charges(plain)[-1]["steps"] == KILL_STEPS
  assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-12)
  expected, got = _final_weights(plain), _final_weights(killed)
  assert expected.keys() == got.keys() and any(k.startswith("optimizer/") for k in got)
  assert any("embeddings" in k for k in got) and any("_iterations" in k for k in got)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  assert resumed["auc"] == pytest.approx(whole["auc"], rel=1e-5)
  # A finished run rerun evaluates again and pays nothing more.
  ledger = (tmp_path / "killed" / "ledger.json").read_bytes()
  with pytest.warns(InsecureNoiseWarning):
    assert cli.main(_kill_argv(data_dir, killed)) == 0
  assert (tmp_path / "killed" / "ledger.json").read_bytes() == ledger


def test_adambc_bias_correction_costs_no_privacy(data_dir, tmp_path):
  """DP-AdamBC post-processes the noisy gradients: its run charges the ledger exactly what the
  same run with DP-Adam charges."""
  runs = {}
  for optimizer in ("adam", "adambc"):
    directory = tmp_path / optimizer
    directory.mkdir()
    summary = _train(data_dir, directory, "dp_adafest", "--optimizer", optimizer,
                     "--adambc-floor", "1e-7", "--accountant", "rdp")
    ledger = privacy.PrivacyLedger(str(directory / "ledger.json"))
    charges = [{k: v for k, v in c.items() if k not in ("time", "updated", "run_id")}
               for c in ledger.charges]
    runs[optimizer] = (summary["epsilon"], ledger.epsilon_spent(), charges)
    assert summary["steps"] == STEPS and np.isfinite(summary["eval_loss"])
  assert runs["adam"] == runs["adambc"]


def test_dp_run_is_calibrated_like_the_base_rate(data_dir, tmp_path):
  """With the CLI's defaults a DP-AdaFEST model's held-out log loss is not above that of
  predicting the (DP) training click rate. The earlier defaults (Glorot logit layer,
  C2 = 1, Adam 3e-3, no recalibration) ended 0.17 above it here (0.743 vs 0.570); the same
  training with DP Platt scaling ended between 0.0018 below and 0.0002 above it in four runs:
  on 1,000 training rows the model does not rank held-out rows (AUC 0.43–0.46) and the fit
  stays at the base rate, so "below" is up to 0.002; the strict "below" is measured on 400k rows
  (BENCHMARKS.md, "Calibrated DP pCTR")."""
  summary = _train(data_dir, tmp_path, "dp_adafest", "--steps", "30")
  assert summary["eval_log_loss"] == summary["eval_loss"]
  assert 0.3 < summary["base_rate_log_loss"] < 0.7 and 0.0 < summary["base_rate"] < 1.0
  # The constant at the DP training rate (the model's starting point), not the summary's
  # yardstick at the held-out rate, which on 1,000 training rows no model need reach.
  training_rate = ctr_model.log_loss_of_constant([summary["eval_base_rate"]],
                                                 summary["base_rate"])
  assert summary["base_rate_log_loss"] <= training_rate
  assert summary["eval_log_loss"] < training_rate + 0.002


def _assert_platt_scaling_charged_once(summary, ledger_charges):
  """`--calibration-share` > 0 charges the ledger one Gaussian mechanism at
  the planned σ_c (labelled) and reports the Platt scale and shift."""
  charges = [c for c in ledger_charges if c.get("label") == "train ctr calibration"]
  assert len(charges) == 1 and charges[0]["noise_multiplier"] == pytest.approx(
      summary["calibration_noise_multiplier"])
  assert charges[0]["sampling_rate"] == 1.0 and charges[0]["steps"] == 1
  assert np.isfinite(summary["calibration_shift"]) and summary["calibration_scale"] > 0


def test_dp_platt_scaling_is_charged_once_or_not_at_all(dp_sgd_diagnostics_run):
  """`--calibration-share` 0 plans, charges and applies none; 0.1 charges it once (checked on the
  run of test_a_second_run_on_a_shared_ledger_pays_and_is_refused_at_the_budget)."""
  tmp_path, summary = dp_sgd_diagnostics_run
  charges = [c for c in privacy.PrivacyLedger(str(tmp_path / "ledger.json")).charges
             if c.get("label") == "train ctr calibration"]
  assert not charges and summary["calibration_shift"] is None
  assert summary["calibration_scale"] is None
  assert summary["calibration_noise_multiplier"] is None


@pytest.mark.parametrize("rows, batch_size, steps", [
    (5_000_000, 16384, 306),  # BENCHMARKS' >= 5M-row setting (N/150 capped at 16,384)
    (400_000, 2048, 196),  # the 400k-row setting of docs/experiments/ctr_calibration.md
    (100_000, 512, 196),  # `make demo`'s training days
    (1000, 64, 16),  # this file's data
    (10, 1, 10),  # at most N/8
])
def test_batch_size_and_steps_come_from_the_training_rows(rows, batch_size, steps):
  """Without --batch-size, B is the power of two nearest N/150 in [64, 16384] (at most N/8);
  without --steps, one epoch; a given value is kept."""
  sized = ctr_workflow.sized_for(ctr_workflow.CTRTrainOptions(data=""), rows)
  assert (sized.batch_size, sized.steps) == (batch_size, steps)
  given = ctr_workflow.sized_for(ctr_workflow.CTRTrainOptions(data="", batch_size=2, steps=3), rows)
  assert (given.batch_size, given.steps) == (2, 3)
  two = ctr_workflow.CTRTrainOptions(data="", batch_size=2)
  assert ctr_workflow.sized_for(two, rows).steps == -(-rows // 2)


def test_cli_without_batch_size_and_steps_trains_one_epoch(data_dir, tmp_path):
  summary_path = tmp_path / "summary.json"
  assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_adafest", "--epsilon",
                   str(EPSILON), "--hidden-units", "8", "--no-progress", "--summary-json",
                   str(summary_path)]) == 0
  with open(summary_path, encoding="utf-8") as stream:
    summary = json.load(stream)
  assert summary["train_rows"] == 1000 and summary["batch_size"] == 64
  assert summary["steps"] == summary["steps_requested"] == 16
  assert summary["batch_size_chosen"] and summary["steps_chosen"]
  assert summary["sampling_rate"] == pytest.approx(64 / 1000)


def test_platt_scaling_fits_on_at_most_the_row_cap(monkeypatch):
  """Above `CALIBRATION_ROWS` the fit sees a uniform subset of distinct rows, aligned across the
  features and labels; below it, every row."""
  monkeypatch.setattr(ctr_workflow, "CALIBRATION_ROWS", 100)
  train = {"label": np.arange(1000) % 2, "cat_features": np.arange(2000).reshape(1000, 2)}
  rng = np.random.default_rng(0)
  subset = ctr_workflow.calibration_rows(train, rng)
  rows = subset["cat_features"][:, 0] // 2
  assert len(subset["label"]) == 100 and len(np.unique(rows)) == 100
  assert (subset["label"] == rows % 2).all()
  small = {key: values[:100] for key, values in train.items()}
  assert ctr_workflow.calibration_rows(small, rng) is small


def test_validation_rows_are_held_out_of_training_and_evaluated(data_dir):
  from dprec.data import ctr_data
  data = ctr_workflow.load_data(data_dir)
  n = len(data.train["label"])
  split = ctr_data.hold_out_validation(data, 200)
  assert len(split.train["label"]) == n - 200 and len(split.validation["label"]) == 200
  np.testing.assert_array_equal(split.validation["label"], data.train["label"][n - 200:])
  summary = ctr_workflow.run(ctr_workflow.CTRTrainOptions(
      data=data_dir, algorithm="dp_sgd", epsilon=EPSILON, batch_size=BATCH, steps=STEPS,
      hidden_units=(8,), progress=False), split)
  assert summary["train_rows"] == n - 200 and summary["validation_rows"] == 200
  assert 0 <= summary["validation_auc"] <= 1 and summary["validation_log_loss"] > 0
  with pytest.raises(DprecError, match="validation rows"):
    ctr_data.hold_out_validation(data, n)
