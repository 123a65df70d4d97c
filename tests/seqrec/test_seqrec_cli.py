"""`dprec train seqrec` end to end on a tiny synthetic sequences job output."""
import json

import dp_accounting

from dprec import cli

SMALL = ["--epochs", "1", "--max-len", "8", "--dim", "8", "--blocks", "1", "--no-progress"]
TINY = SMALL + ["--batch-size", "32"]


def test_dp_run_summary_and_epsilon(data_dir, tmp_path, capsys):
  summary_file = tmp_path / "summary.json"
  code = cli.main(["train", "seqrec", "--data", data_dir, "--epsilon", "5", "--normalize",
                   "--summary-json", str(summary_file)] + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary == json.loads(summary_file.read_text())
  for key in ("ndcg_at_10", "hit_at_10", "epsilon", "delta"):
    assert key in summary
  for bucket in ("head", "torso", "tail"):
    assert set(summary["by_popularity"][bucket]) >= {"ndcg_at_10", "hit_at_10"}
  assert summary["model"] == "dpformer" and summary["delta"] == 1 / summary["train_examples"]
  assert summary["normalization_offset"] == 0.01
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      summary["sampling_rate"], dp_accounting.GaussianDpEvent(summary["noise_multiplier"])),
      summary["steps"])
  direct = accountant.get_epsilon(summary["delta"])
  assert abs(summary["epsilon"] - direct) <= 1e-3 * direct
  assert 4.9 < summary["epsilon"] <= 5.0 + 1e-6


def test_non_private_baselines(data_dir, capsys):
  code = cli.main(["train", "seqrec", "--data", data_dir, "--epsilon", "inf", "--untied",
                   "--no-reattention"] + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["model"] == "vanilla" and not summary["tied"]
  assert summary["noise_multiplier"] is None and summary["delta"] is None
  assert 0.0 <= summary["ndcg_at_10"] <= summary["hit_at_10"] <= 1.0


def test_missing_data_is_a_one_line_error(tmp_path, capsys):
  code = cli.main(["train", "seqrec", "--data", str(tmp_path / "nowhere")] + TINY)
  assert code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("dprec: error:") and "manifest" in err and "\n" not in err


def test_default_batch_size_fits_tiny_data_and_an_impossible_one_is_refused(data_dir, capsys):
  code = cli.main(["train", "seqrec", "--data", data_dir, "--epsilon", "inf"] + SMALL)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["train_examples"] < 1024 and summary["batch_size_chosen"]
  assert summary["batch_size"] == summary["train_examples"] // 8
  code = cli.main(["train", "seqrec", "--data", data_dir, "--epsilon", "inf", "--batch-size",
                   "1000"] + SMALL)
  assert code == 2
  err = capsys.readouterr().err.strip()
  assert "--batch-size 1000 exceeds the" in err and "\n" not in err
