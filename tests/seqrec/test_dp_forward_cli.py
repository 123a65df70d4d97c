"""`dprec train seqrec --dp-forward` end to end: SeqLDP summary, ledger ε vs dp_accounting."""
import json

import dp_accounting
import numpy as np
import pytest

from dprec import cli
from dprec.privacy import PrivacyLedger

TRAIN = ["train", "seqrec", "--summary-json", "-"]  # the JSON summary on stdout

pytestmark = pytest.mark.commands

TINY = ["--epochs", "2", "--batch-size", "32", "--max-len", "8", "--dim", "8", "--blocks", "1",
        "--no-progress", "--dp-forward"]


def run(capsys, *argv):
  code = cli.main([*TRAIN, *argv])
  out, err = capsys.readouterr()
  return code, (json.loads(out) if code == 0 else None), err


def test_dp_forward_summary_states_seqldp_and_epsilon_matches_dp_accounting(sequences_dir, tmp_path,
                                                                          capsys):
  ledger = tmp_path / "ledger.json"
  code, summary, _ = run(capsys, "--data", sequences_dir, "--epsilon", "4", "--ledger", str(ledger),
                         *TINY)
  assert code == 0
  forward = summary["dp_forward"]
  assert summary["model"] == "dp-forward" and summary["privacy_notion"] == "SeqLDP"
  assert "not central DP" in summary["privacy_note"]
  assert "label is sent in the clear" in summary["privacy_note"]
  assert forward["releases_per_user"] == 2 and forward["sensitivity"] == 2.0
  assert summary["steps"] == 2 * (summary["train_examples"] // 32)
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(forward["noise_multiplier"]), 2))
  direct = accountant.get_epsilon(summary["delta"])
  assert summary["epsilon"] == pytest.approx(direct, rel=2e-3)
  assert 3.99 < summary["epsilon"] <= 4.0 + 1e-6
  charges = PrivacyLedger(ledger).charges
  assert [c["steps"] for c in charges] == [2]  # one release per epoch, merged
  assert 0 <= summary["ndcg_at_10"] <= 1


def test_dp_forward_plans_for_what_the_ledger_spent_before(sequences_dir, tmp_path, capsys):
  """A ledger already charged ε 1 on the data (e.g. a DP vocabulary): the run plans its
  releases for the 3 left instead of being refused, and the ledger ends at the budget."""
  path = tmp_path / "ledger.json"
  PrivacyLedger(path, epsilon_budget=4.0, delta=1e-5).charge_pure(1.0, label="vocabulary")
  code, summary, err = run(capsys, "--data", sequences_dir, "--epsilon", "4", "--ledger", str(path),
                           *TINY)
  assert code == 0, err
  assert 3.99 < summary["epsilon"] <= 4.0 + 1e-6
  assert summary["dp_forward"]["representation_epsilon"] == pytest.approx(3.0, rel=2e-3)


def test_dp_forward_with_label_rr_reports_both_epsilons(sequences_dir, capsys):
  code, summary, _ = run(capsys, "--data", sequences_dir, "--epsilon", "6", "--label-epsilon", "2",
                         "--forward-position", "attention", *TINY)
  assert code == 0
  forward = summary["dp_forward"]
  assert summary["privacy_notion"] == "LDP" and forward["label_epsilon"] == 2.0
  assert forward["representation_epsilon"] == pytest.approx(4.0, rel=2e-3)
  assert summary["epsilon"] == pytest.approx(6.0, rel=2e-3)


def test_dp_forward_needs_whole_epochs_and_finite_epsilon(sequences_dir, capsys):
  code, _, err = run(capsys, "--data", sequences_dir, "--epsilon", "inf", *TINY)
  assert code != 0 and "finite" in err
  argv = [a if a != "2" else "1.5" for a in TINY]
  code, _, err = run(capsys, "--data", sequences_dir, "--epsilon", "4", *argv)
  assert code != 0 and "whole number of epochs" in err


def test_rerun_with_run_dir_pays_no_epoch_twice(sequences_dir, tmp_path, capsys):
  argv = ["--data", sequences_dir, "--epsilon", "4", "--run-dir", str(tmp_path / "run"), *TINY]
  code, first, _ = run(capsys, *argv)
  assert code == 0
  code, second, _ = run(capsys, *argv)
  assert code == 0 and second["resumed_from_step"] == first["steps"]
  assert second["epsilon"] == first["epsilon"]
  charges = PrivacyLedger(tmp_path / "run" / "ledger.json").charges
  assert sum(c["steps"] for c in charges) == 2


def test_randomised_labels_are_drawn_once_per_run_dir(tmp_path):
  from dprec.workflows import dp_forward
  labels = np.tile(np.arange(1, 6), (400, 1))
  prior = np.array([0, 5, 4, 3, 2, 1])
  saved = str(tmp_path / "rr_labels.npy")
  first = dp_forward.training_labels(labels, prior, 1.0, saved=saved)
  assert (first[:, :-1] == 0).all() and (first[:, -1] != 5).any()
  again = dp_forward.training_labels(labels, prior, 1.0, saved=saved)
  np.testing.assert_array_equal(first, again)
