"""`dprec privacy ...`: JSON outputs agree with the library, bad input is one line and exit 2."""
import json
import os

import pytest

import dprec.cli
from dprec import privacy

pytestmark = pytest.mark.commands


@pytest.fixture(name="run")
def fixture_run(capsys):
  """Run `dprec privacy ...` in process (the CLI imports only the privacy module for it)."""

  def run(*argv):
    code = dprec.cli.main(["privacy", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err

  return run


def test_epsilon_command_matches_library(run):
  code, out, _ = run("epsilon", "--noise-multiplier", "1.1", "--delta", "1e-5",
                     "--sampling-rate", "0.01", "--steps", "300")
  assert code == 0
  expected = privacy.compute_epsilon(1.1, 0.01, 300, 1e-5)
  assert out["epsilon"] == pytest.approx(expected.epsilon, rel=1e-12)
  assert out["accountant"] == "pld" and out["poisson"] and out["note"] == ""
  assert out["sampling_rate"] == 0.01 and out["steps"] == 300


def test_epsilon_from_dataset_size_defaults_delta_and_flags_fixed_batches(run):
  code, out, _ = run("epsilon", "--noise-multiplier", "1.0", "--dataset-size", "60000",
                     "--batch-size", "256", "--epochs", "3", "--accountant", "rdp",
                     "--fixed-batches")
  assert code == 0
  q, steps = privacy.dataset_sampling(60000, 256, 3)
  expected = privacy.compute_epsilon(1.0, q, steps, 1 / 60000, accountant="rdp")
  assert out["delta"] == pytest.approx(1 / 60000) and out["steps"] == steps == 704
  assert out["epsilon"] == pytest.approx(expected.epsilon, rel=1e-12)
  assert not out["poisson"] and out["note"] == privacy.NOT_POISSON_NOTE


def test_epsilon_composes_periods_and_selection(run):
  code, out, _ = run("epsilon", "--noise-multiplier", "1.0", "--delta", "1e-5", "--period",
                     "0.01:100", "--period", "0.02:50", "--selection-epsilon", "0.1")
  assert code == 0
  periods = [privacy.TrainingPeriod(1.0, 0.01, 100), privacy.TrainingPeriod(1.0, 0.02, 50)]
  expected = privacy.compose_periods(periods, 1e-5, selections=[(0.1, 0)])
  assert out["epsilon"] == pytest.approx(expected.epsilon, rel=1e-12)
  assert out["selection_epsilon"] == 0.1
  assert out["training_epsilon"] + 0.1 == pytest.approx(out["epsilon"])


def test_sigma_command_reproduces_target_and_splits_for_adafest(run):
  code, out, _ = run("sigma", "--epsilon", "2.0", "--delta", "1e-5", "--sampling-rate", "0.01",
                     "--steps", "1000", "--accountant", "rdp", "--selection-epsilon", "0.2",
                     "--adafest-ratio", "5")
  assert code == 0
  sigma = out["noise_multiplier"]
  training = privacy.compute_epsilon(sigma, 0.01, 1000, 1e-5, accountant="rdp").epsilon
  assert out["training_epsilon"] == pytest.approx(training, rel=1e-12)
  assert training <= 1.8 and out["epsilon"] <= 2.0 and out["target_epsilon"] == 2.0
  assert privacy.compute_epsilon(sigma * 0.999, 0.01, 1000, 1e-5, "rdp").epsilon > 1.8
  split = out["adafest"]
  assert privacy.composed_noise_multiplier(
      split["contribution_noise_multiplier"], split["gradient_noise_multiplier"]
  ) == pytest.approx(sigma)


def test_ledger_command(run, tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=2.0, delta=1e-5,
                                 accountant="rdp")
  ledger.charge_pure(0.25, label="top-k")
  code, out, _ = run("ledger", "--path", str(tmp_path / "l.json"))
  assert code == 0
  assert out["epsilon_spent"] == pytest.approx(0.25) and out["remaining"] == pytest.approx(1.75)
  assert out["charges"] == 1


def test_ledger_command_only_reads(run, tmp_path):
  """Showing a ledger takes no lock and writes nothing, so it works where the user may only read
  (e.g. a finished run's directory mounted read-only)."""
  path = tmp_path / "l.json"
  privacy.PrivacyLedger(path, epsilon_budget=2.0, delta=1e-5).charge_pure(0.5, label="top-k")
  os.unlink(str(path) + ".lock")
  before = sorted(os.listdir(tmp_path))
  code, out, _ = run("ledger", "--path", str(path))
  assert code == 0 and out["epsilon_spent"] == pytest.approx(0.5)
  assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("argv,message", [
    (["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--sampling-rate", "0.1",
      "--steps", "10", "--dataset-size", "100", "--batch-size", "10"], "exactly one way"),
    (["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--steps", "10"],
     "--delta is required"),
    (["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--period", "0.1-10"],
     "RATE:STEPS"),
    (["sigma", "--epsilon", "1", "--delta", "2", "--sampling-rate", "0.1", "--steps", "10"],
     "delta must be in"),
    (["ledger", "--path", "/nonexistent/ledger.json"], "no such privacy ledger"),
])
def test_bad_input_is_one_line_exit_2(run, argv, message):
  code, _, err = run(*argv)
  assert code == 2
  assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_sigma_with_zcdp_selection_deducts_both_parts(run):
  code, out, _ = run("sigma", "--epsilon", "2.0", "--delta", "1e-5", "--sampling-rate", "0.01",
                     "--steps", "1000", "--accountant", "rdp", "--selection-epsilon", "0.3",
                     "--selection-delta", "1e-6")
  assert code == 0
  assert out["training_delta"] == pytest.approx(9e-6) and out["selection_delta"] == 1e-6
  training = privacy.compute_epsilon(out["noise_multiplier"], 0.01, 1000, 9e-6, "rdp").epsilon
  assert out["training_epsilon"] == pytest.approx(training, rel=1e-12)
  assert training <= 1.7 and out["epsilon"] == pytest.approx(training + 0.3)
