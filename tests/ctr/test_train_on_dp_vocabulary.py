"""One ledger from preprocessing to training: `dprec preprocess criteo --vocab-mode
dp_top_k` at ε = 0.5 into ledger L, then `dprec train ctr --ledger L --epsilon 1` calibrates σ
for the 0.5 left and reports a total equal to dp_accounting's composition of both parts."""
import json
import os
import shutil

import dp_accounting
import pytest

from dprec import cli
from dprec import privacy
from dprec.data import synthetic
from dprec.privacy.ledger import PREPROCESSING

pytestmark = pytest.mark.commands

IN_PROCESS = ["--direct_num_workers=1", "--direct_running_mode=in_memory"]
BUDGET, SELECTION, DELTA, STEPS, BATCH = 1.0, 0.5, 1e-5, 6, 64


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
  """(output directory, ledger path): tiny Criteo days through the DP top-k preprocessing job,
  charged to a new ledger of budget 1."""
  root = tmp_path_factory.mktemp("dp_vocabulary")
  synthetic.generate_criteo(str(root / "days"), rows=1500, days=3, seed=0, vocab="scaled:3k",
                            progress=False)
  out, ledger = str(root / "out"), str(root / "ledger.json")
  assert cli.main(["preprocess", "criteo", "--input", str(root / "days"), "--output", out,
                   "--vocab-mode", "dp_top_k", "--top-k-per-feature", "1",
                   "--top-k-epsilon", str(SELECTION),
                   "--ledger", ledger, "--epsilon-budget", str(BUDGET), "--delta", str(DELTA)]
                  + IN_PROCESS) == 0
  return out, ledger


def _fresh_ledger(preprocessed, tmp_path):
  """A copy of the preprocessing job's ledger (each test charges its own)."""
  out, ledger = preprocessed
  shutil.copy(ledger, tmp_path / "ledger.json")
  return out, str(tmp_path / "ledger.json")


def _train_ctr(out, ledger, tmp_path):
  summary = tmp_path / "summary.json"
  code = cli.main(["train", "ctr", "--data", out, "--ledger", ledger, "--epsilon", str(BUDGET),
                   "--batch-size", str(BATCH), "--steps", str(STEPS), "--hidden-units", "8",
                   "--charge-every", "4", "--no-progress", "--summary-json", str(summary)])
  return code, json.loads(summary.read_text()) if code == 0 else None


def _training_epsilon(mechanism_sigmas, sigma, sampling_rate, steps):
  """ε at δ of the DP base rate and DP Platt scaling (one Gaussian mechanism each) and the
  sampled steps: dp_accounting."""
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  for mechanism_sigma in mechanism_sigmas:
    accountant.compose(dp_accounting.GaussianDpEvent(mechanism_sigma))
  accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      sampling_rate, dp_accounting.GaussianDpEvent(sigma)), steps))
  return accountant.get_epsilon(DELTA)


def test_training_composes_the_dp_vocabulary_and_calibrates_for_what_is_left(preprocessed,
                                                                             tmp_path):
  out, ledger = _fresh_ledger(preprocessed, tmp_path)
  with open(os.path.join(out, "manifest.json"), encoding="utf-8") as stream:
    manifest = json.load(stream)
  assert manifest["vocab_privacy"]["dp"] and manifest["vocab_privacy"]["private"]
  assert manifest["vocab_privacy"]["epsilon"] == pytest.approx(SELECTION)
  code, summary = _train_ctr(out, ledger, tmp_path)
  assert code == 0 and summary["steps"] == STEPS and summary["private"]
  training = _training_epsilon(
      [summary["base_rate_noise_multiplier"], summary["calibration_noise_multiplier"]],
      summary["noise_multiplier"], summary["sampling_rate"], STEPS)
  left = BUDGET - SELECTION
  assert left * (1 - 5e-3) < training <= left + 1e-9  # σ calibrated for the 0.5 left
  assert summary["epsilon"] == pytest.approx(SELECTION + training, rel=1e-6)
  assert summary["epsilon"] <= BUDGET + 1e-9 and summary["delta"] == DELTA  # the ledger's δ
  parts = summary["epsilon_parts"]
  assert parts["preprocessing_selection"]["epsilon"] == pytest.approx(SELECTION)
  assert parts["training"]["epsilon"] == pytest.approx(training, rel=1e-6)
  assert parts["training"]["runs"] == [summary["run_id"]]
  dataset = {"path": os.path.abspath(out), "id": manifest["dataset_id"]}
  assert [c["dataset"] for c in parts["preprocessing_selection"]["charges"]] == [dataset]
  assert summary["dataset"] == dict(dataset, vocab_privacy=manifest["vocab_privacy"])
  charges = privacy.PrivacyLedger(ledger).charges
  assert charges[0]["stage"] == PREPROCESSING and charges[0]["run_id"].startswith("preprocess-")
  assert all(c["dataset"] == dataset for c in charges)


def test_training_refuses_a_ledger_holding_another_data_sets_charges(preprocessed, tmp_path,
                                                                     capsys):
  out, ledger = _fresh_ledger(preprocessed, tmp_path)
  other = str(tmp_path / "another_output")
  privacy.PrivacyLedger(ledger, run_id="another-job", marks={
      "stage": PREPROCESSING, "dataset": {"path": other, "id": "another-id"}}).charge_pure(
          0.1, label="another vocabulary")
  code, _ = _train_ctr(out, ledger, tmp_path)
  err = capsys.readouterr().err
  assert code == 2 and "another data set: another vocabulary" in err and other in err
  assert len(privacy.PrivacyLedger(ledger).charges) == 2  # nothing charged
