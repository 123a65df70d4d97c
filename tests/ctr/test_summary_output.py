"""How `train ctr` ends: one line on stdout, the JSON summary (strict JSON) in the run directory
or where --summary-json says, the ledger it charged, and a rerun of a finished run."""
import json
import math

import pytest

from dprec import atomic_io
from dprec import cli
from dprec.training import callbacks
from dprec.workflows import ctr as ctr_workflow
from dprec.workflows import result

pytestmark = pytest.mark.commands


def _no_constants(name):
  raise ValueError(f"not strict JSON: {name}")


def strict_load(text):
  return json.loads(text, parse_constant=_no_constants)


def _argv(data_dir, run_dir, *extra):
  return ["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd", "--epsilon", "2",
          "--batch-size", "64", "--steps", "6", "--hidden-units", "8", "--no-progress",
          "--charge-every", "4", "--run-dir", str(run_dir), *extra]


def test_one_line_then_json_in_the_run_dir_then_a_rerun_says_so(criteo_days, tmp_path, capsys):
  data_dir, run_dir = criteo_days(1500, 3), tmp_path / "run"
  with pytest.warns(ctr_workflow.SmallDataWarning):
    assert cli.main(_argv(data_dir, run_dir)) == 0
  out, err = capsys.readouterr()
  assert out.count("\n") == 1, out
  summary = strict_load((run_dir / "summary.json").read_text())
  assert out.startswith("train ctr dp_sgd: held-out AUC ") and "(chance 0.5)" in out
  assert f"ε = {summary['epsilon']:.4g} per training row (budget 2)" in out
  assert f"δ = {summary['delta']:.2g}" in out and f"summary: {run_dir / 'summary.json'}" in out
  assert summary["ledger"] == str(run_dir / "ledger.json")
  assert "finished" not in err
  ledger = (run_dir / "ledger.json").read_text()
  # The rerun: nothing trained or charged, and it says so; --summary-json -: JSON on stdout.
  with pytest.warns(ctr_workflow.SmallDataWarning):
    assert cli.main(_argv(data_dir, run_dir, "--summary-json", "-")) == 0
  out, err = capsys.readouterr()
  assert "this run finished its 6 steps before: evaluating its model again (nothing charged)" \
      in err
  assert strict_load(out)["auc"] == summary["auc"]
  assert err.strip().splitlines()[-1].startswith("train ctr dp_sgd: held-out AUC")
  assert (run_dir / "ledger.json").read_text() == ledger


def test_the_base_rate_yardstick_is_the_held_out_rate_and_a_worse_model_is_flagged():
  summary = {"worse_than_base_rate": True, "eval_log_loss": 0.7, "base_rate_log_loss": 0.57,
             "eval_base_rate": 0.254}
  with pytest.warns(ctr_workflow.WorseThanBaseRateWarning, match="worse than 0.5700"):
    ctr_workflow.warn_if_worse_than_base_rate(summary)


def test_summaries_and_ledgers_are_strict_json(tmp_path):
  path = tmp_path / "s.json"
  atomic_io.write_json(str(path), {"epsilon": math.inf, "loss": [math.nan, 1.0]})
  assert strict_load(path.read_text()) == {"epsilon": None, "loss": [None, 1.0]}
  from dprec import privacy
  ledger = privacy.PrivacyLedger(str(tmp_path / "l.json"), epsilon_budget=math.inf, delta=1e-5)
  ledger.charge_gaussian(1.0, 0.01, 10, label="x")
  strict_load((tmp_path / "l.json").read_text())
  reopened = privacy.PrivacyLedger(str(tmp_path / "l.json"), epsilon_budget=math.inf)
  assert reopened.epsilon_budget == math.inf and reopened.epsilon_spent() > 0


def test_result_lines_name_units_and_baselines():
  seqrec = {"model": "dpformer", "ndcg_at_10": 0.017, "hit_at_10": 0.034, "items": 1000,
            "test_users": 2000, "epsilon": math.inf, "delta": 1e-4}
  line = result.train_seqrec(seqrec)
  assert "NDCG@10 1.70% (random ranking 0.45%)" in line and "HIT@10 3.40% (random 1.00%)" in line
  assert "not private (ε = ∞)" in line
  assert result.random_ranking(1000)["ndcg"] == pytest.approx(
      sum(1 / math.log2(r + 1) for r in range(1, 11)) / 1000)


class _Timer:
  steps_per_second = 56.8


def test_the_progress_bar_shows_the_summary_s_steps_per_second(capsys):
  bar = callbacks.ProgressBar(desc="run", timer=_Timer())
  bar.set_params({"steps": 2, "epochs": 1})
  bar.on_train_begin()
  bar.on_train_batch_end(0, {"epsilon": 0.5})
  bar.on_train_batch_end(1, {"epsilon": 0.5})
  bar.on_train_end()
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert "steps/s=56.8" in last and "step/s" not in last.replace("steps/s", ""), last


def test_stream_result_line_reads_the_last_evaluated_period():
  summary = {"algorithm": "dp_sgd", "periods_trained": 3, "privacy_unit": "user",
             "epsilon": 0.8, "epsilon_total": 1.0, "delta": 1e-6, "private": True,
             "periods": [{"eval_period": 1, "auc": 0.6, "log_loss": 0.55,
                          "base_rate_log_loss": 0.56},
                         {"eval_period": 2, "auc": 0.61, "log_loss": 0.54,
                          "base_rate_log_loss": 0.57}, {"auc": None}]}
  line = result.stream(summary)
  assert "on period 2 (held out): AUC 0.6100 (chance 0.5), log loss 0.5400 nats" in line
  assert "ε = 0.8 per user (budget 1), δ = 1e-06" in line
