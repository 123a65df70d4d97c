"""The ledger path every workflow shares (`Run`, `plan_prior`): earlier charges on the run's data
set composed and reported, another data set's refused, the ledger's δ adopted (no training)."""
import json
import os
import re

import pytest

from dprec import privacy
from dprec.data import identity
from dprec.errors import DprecError
from dprec.privacy.ledger import PREPROCESSING
from dprec.workflows.run import Run
from dprec.workflows.run_budget import plan_prior

DELTA = 1e-5
DP_VOCABULARY = {"dp": True, "private": True, "mode": "dp_top_k", "epsilon": 0.2, "delta": 0.0}


def _output(tmp_path, name, dataset_id):
  """A preprocessing output directory: just its manifest."""
  directory = tmp_path / name
  directory.mkdir()
  (directory / "manifest.json").write_text(json.dumps(
      {identity.DATASET_ID: dataset_id, "vocab_privacy": DP_VOCABULARY}))
  return str(directory)


def _preprocess(ledger_path, data, epsilon=0.2, **marks):
  """The charge a preprocessing job makes for its output `data`."""
  dataset = identity.dataset_identity(data)
  ledger = privacy.PrivacyLedger(ledger_path, 1.0, DELTA, run_id=dataset["id"],
                                 marks=dict(stage=PREPROCESSING, dataset=dataset, **marks))
  ledger.charge_pure(epsilon, label="dp top-k vocabulary")


def test_a_run_composes_and_reports_its_data_sets_earlier_charges(tmp_path):
  data, ledger_path = _output(tmp_path, "out", "d1"), str(tmp_path / "ledger.json")
  _preprocess(ledger_path, data)
  vocabulary = privacy.Spent(selections=((0.2, 0.0),))
  assert plan_prior(None, 1.0, None, "pld", 0.5) == (0.5, privacy.Spent())  # planning alone
  with Run("train ctr", ledger=ledger_path, data=data) as run:
    assert plan_prior(run.budget, float("inf"), None, "pld", 0.5) == (0.5, privacy.Spent())
    assert run.budget.ledger is None  # a non-private plan opens no ledger
    # The ledger's δ, not the default for a new one, and what it spent on the data set.
    assert plan_prior(run.budget, 1.0, None, "pld", 0.5) == (DELTA, vocabulary)
    run.budget.ledger.charge_gaussian(2.0, 0.1, 10, label="training")
    assert run.budget.ledger.charges[-1]["dataset"] == {"path": os.path.abspath(data), "id": "d1"}
    assert run.budget.ledger.charges[-1]["run_id"] == run.run_id
    assert plan_prior(run.budget, 1.0, None, "pld", 0.5) == (DELTA, vocabulary)  # on resume too
    fields = run.summary.privacy_fields(True, {})
  parts = fields["epsilon_parts"]
  assert fields["private"] and fields["privacy_note"] is None
  assert parts["preprocessing_selection"]["epsilon"] == 0.2
  assert parts["training"]["epsilon"] == pytest.approx(run.budget.ledger.epsilon_spent() - 0.2)
  assert parts["training"]["runs"] == [run.run_id]
  assert fields["dataset"]["id"] == "d1" and fields["dataset"]["vocab_privacy"] == DP_VOCABULARY


def test_a_run_refuses_a_ledger_holding_another_data_sets_charges(tmp_path):
  data, other = _output(tmp_path, "out", "d1"), _output(tmp_path, "other", "d2")
  ledger_path = str(tmp_path / "ledger.json")
  _preprocess(ledger_path, other)
  with Run("train ctr", ledger=ledger_path, data=data) as run:
    with pytest.raises(DprecError, match=f"another data set: .* for {re.escape(other)} "
                                         r"\(id d2\)"):
      plan_prior(run.budget, 1.0, None, "pld", 0.5)
  with Run("train ctr", ledger=ledger_path, data=other) as run:  # its own data set: accepted
    assert plan_prior(run.budget, 1.0, DELTA, "pld", 0.5)[1].selection_epsilon == 0.2


def test_a_publicly_seeded_preprocessing_release_makes_the_run_not_private(tmp_path):
  data, ledger_path = _output(tmp_path, "out", "d1"), str(tmp_path / "ledger.json")
  _preprocess(ledger_path, data, private=False, privacy_note="--seed 3")
  with Run("train ctr", ledger=ledger_path, data=data) as run:
    run.budget.open_ledger(1.0, None, "pld")
    fields = run.summary.privacy_fields(True, {})
  assert not fields["private"] and "public seed" in fields["privacy_note"]
