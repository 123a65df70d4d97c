"""`dprec train seqrec` end to end on a tiny synthetic sequences job output."""
import json
import os

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from dprec import cli
from dprec.data.sequences import load_sequences, make_examples, read_item_frequencies
from dprec.errors import DprecError
from dprec.privacy import PrivacyLedger, user_histogram
from dprec.training import checkpoint as ckpt_lib
from dprec.workflows import item_frequencies

TRAIN = ["train", "seqrec", "--summary-json", "-"]  # the JSON summary on stdout


def _not_json(constant):
  raise ValueError(f"{constant} is not strict JSON")

pytestmark = pytest.mark.commands

SMALL = ["--model", "dpformer", "--epochs", "1", "--max-len", "8", "--dim", "8", "--blocks", "1",
         "--no-progress"]
TINY = SMALL + ["--batch-size", "32"]


def test_dp_run_summary_and_epsilon(sequences_dir, tmp_path, capsys, check_composition):
  summary_file = tmp_path / "summary.json"
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--normalize",
                   "--summary-json", str(summary_file)] + TINY)
  assert code == 0
  out = capsys.readouterr().out  # one line; the JSON in --summary-json, strict JSON
  summary = json.loads(summary_file.read_text(), parse_constant=_not_json)
  assert out.count("\n") == 1 and out.startswith("train seqrec dpformer: NDCG@10 ")
  assert f"{100 * summary['ndcg_at_10']:.2f}% (random ranking" in out
  for key in ("ndcg_at_10", "hit_at_10", "epsilon", "delta"):
    assert key in summary
  for bucket in ("head", "torso", "tail"):
    assert set(summary["by_popularity"][bucket]) >= {"ndcg_at_10", "hit_at_10"}
  assert summary["model"] == "dpformer" and summary["delta"] == 1 / summary["train_examples"]
  assert summary["normalization_offset"] == 0.01
  # ε is the DP histogram of p_i (one Gaussian mechanism) composed with the T sampled steps.
  frequencies = summary["item_frequencies"]
  assert frequencies["source"] == "dp histogram" and frequencies["epsilon_share"] == 0.05
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(frequencies["noise_multiplier"]))
  alone = accountant.get_epsilon(summary["delta"])
  assert abs(alone - 0.05 * 5) <= 1e-3 * 0.25
  check_composition(summary, [frequencies["noise_multiplier"]])


def test_non_private_baselines(sequences_dir, capsys):
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "inf", "--untied",
                   "--no-reattention"] + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["model"] == "vanilla" and not summary["tied"]
  assert summary["noise_multiplier"] is None and summary["delta"] is None
  assert 0.0 <= summary["ndcg_at_10"] <= summary["hit_at_10"] <= 1.0


def test_missing_data_is_a_one_line_error(tmp_path, capsys):
  code = cli.main([*TRAIN, "--data", str(tmp_path / "nowhere"), "--epsilon", "5"]
                  + TINY)
  assert code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("dprec: error:") and "manifest" in err and "\n" not in err


def test_default_batch_size_fits_tiny_data_and_an_impossible_one_is_refused(sequences_dir, capsys):
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "inf"] + SMALL)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["train_examples"] < 1024 and summary["batch_size_chosen"]
  assert summary["batch_size"] == summary["train_examples"] // 8
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "inf", "--batch-size",
                   "1000"] + SMALL)
  assert code == 2
  err = capsys.readouterr().err.strip()
  assert "--batch-size 1000 exceeds the" in err and "\n" not in err


def _latest_model(run_dir):
  with open(os.path.join(run_dir, "checkpoints", ckpt_lib.LATEST), encoding="utf-8") as f:
    return os.path.join(run_dir, "checkpoints", f.read().strip(), "model")


def _trained_frequencies(run_dir, summary):
  """p_i read back from the final checkpoint's Re-Attention variances σ_eff² = (σ·C/(B·p_i))²."""
  reader = tf.train.load_checkpoint(_latest_model(run_dir))
  name = next(n for n in reader.get_variable_to_shape_map() if "item_variance" in n)
  variance = reader.get_tensor(name)[1:]
  return summary["noise_multiplier"] * summary["l2_norm_clip"] / (
      summary["batch_size"] * np.sqrt(variance))


def test_trained_model_holds_dp_frequencies_charged_to_the_ledger(sequences_dir, tmp_path, capsys,
                                                                  monkeypatch):
  run_dir = str(tmp_path / "run")
  ledger_path = os.path.join(run_dir, "ledger.json")
  commit = ckpt_lib.CheckpointManager.commit

  def commit_after_the_charge(manager, *args, **kwargs):  # every checkpoint holds the noisy p_i
    labels = [c["label"] for c in PrivacyLedger(ledger_path).charges]
    assert item_frequencies.LABEL in labels, "a checkpoint before the histogram's charge"
    return commit(manager, *args, **kwargs)

  monkeypatch.setattr(ckpt_lib.CheckpointManager, "commit", commit_after_the_charge)
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--run-dir",
                   run_dir] + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  data = load_sequences(sequences_dir)
  examples = make_examples(data, 8, hold_out_validation=True)
  n = len(examples.items)
  exact = user_histogram.users_per_item(examples.items, data.num_items) / n
  trained = _trained_frequencies(run_dir, summary)
  assert np.all(trained >= 1 / n - 1e-6) and np.all(trained <= 1 + 1e-6)
  assert not np.allclose(trained, np.maximum(exact[1:], 1 / n), rtol=1e-3)
  assert not np.allclose(trained, np.maximum(data.item_frequencies[1:], 1 / n), rtol=1e-3)
  charges = PrivacyLedger(os.path.join(run_dir, "ledger.json")).charges
  histogram = [c for c in charges if c["label"] == summary["item_frequencies"]["ledger_label"]]
  assert len(histogram) == 1 and histogram[0]["sampling_rate"] == 1.0
  assert histogram[0]["steps"] == 1
  assert histogram[0]["noise_multiplier"] == summary["item_frequencies"]["noise_multiplier"]


def test_public_frequency_file_is_used_as_is_and_not_charged(sequences_dir, frequency_file,
                                                             tmp_path, capsys):
  run_dir, (path, values) = str(tmp_path / "run"), frequency_file
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--run-dir",
                   run_dir, "--item-frequencies", path] + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["item_frequencies"] == {"source": "public file", "path": path, "public": True}
  np.testing.assert_allclose(_trained_frequencies(run_dir, summary), values, rtol=1e-4)
  charges = PrivacyLedger(os.path.join(run_dir, "ledger.json")).charges
  assert all(c["sampling_rate"] == summary["sampling_rate"] for c in charges)


@pytest.mark.parametrize("line, message", [
    ("x 0.1 2", ":3: expected 2 fields"), ("x half", ":3: frequency: not a number"),
    ("x 1.5", ":3: frequency: must be in [0, 1]")])
def test_bad_frequency_file_is_a_one_line_error_with_file_and_line(sequences_dir, tmp_path, capsys,
                                                                   line, message):
  path = tmp_path / "bad.txt"
  path.write_text(f"# header\n\n{line}\n")
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5",
                   "--item-frequencies", str(path)] + TINY)
  assert code == 2
  err = capsys.readouterr().err.strip()
  assert f"{path}{message}" in err and "\n" not in err


def test_frequency_file_must_cover_every_item(sequences_dir, tmp_path):
  path = tmp_path / "partial.txt"
  data = load_sequences(sequences_dir)
  path.write_text(f"{data.item_ids[0]} 0.5\n{data.item_ids[0]} 0.25\n")
  with pytest.raises(DprecError, match=r"partial.txt:2: item .* again \(first on line 1\)"):
    read_item_frequencies(str(path), data.item_ids)
  path.write_text(f"{data.item_ids[0]} 0.5\n")
  with pytest.raises(DprecError, match=f"no frequency for {data.num_items - 1} of the "
                                       f"{data.num_items} items"):
    read_item_frequencies(str(path), data.item_ids)


def test_adambc_optimizer_low_rank_item_table_and_secure_noise_run(sequences_dir, tmp_path, capsys):
  """`--optimizer adambc` (DP-AdamBC, Tang et al., "On the Performance of Differentially Private
  Optimization with Heavy-Tail Class Imbalance", arXiv:2411.04205, same schedule and weight decay),
  `--item-rank` and `--secure-noise`, together to spare a run; their
  steps are tested on their own."""
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--optimizer",
                   "adambc", "--adambc-floor", "1e-7", "--item-rank", "4", "--secure-noise"]
                  + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["secure_noise"] is True
  assert np.isfinite(summary["ndcg_at_10"]) and 0 < summary["epsilon"] <= 5 * (1 + 1e-6)


def test_item_vocabulary_and_norm_share_run_selected_on_validation(sequences_dir, tmp_path, capsys):
  """`--item-vocab-threshold` and `--popularity-weights` (from the same one DP histogram as
  Re-Attention's p_i: one ledger charge) and `--item-norm-share`: the checkpoint's
  table has the vocabulary's rows, every item maps to one, each row has a weight floored at the
  histogram's noise std; the summary reports validation metrics for model selection and the
  top-10 diversity."""
  run_dir = str(tmp_path / "run")
  code = cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--run-dir",
                   run_dir, "--item-vocab-threshold", "20", "--item-norm-share", "0.9",
                   "--item-histogram-items", "4", "--popularity-weights"] + TINY)
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  vocabulary = summary["item_vocabulary"]
  data = load_sequences(sequences_dir)
  assert vocabulary["items"] == data.num_items and summary["item_norm_share"] == 0.9
  assert 0 < vocabulary["own_rows"] < data.num_items
  assert summary["item_frequencies"]["max_items_per_user"] == 4  # sensitivity √4
  assert vocabulary["table_rows"] == vocabulary["own_rows"] + 1
  charges = PrivacyLedger(os.path.join(run_dir, "ledger.json")).charges
  assert [c["label"] for c in charges].count(item_frequencies.LABEL) == 1
  assert 4.9 < summary["epsilon"] <= 5.0 + 1e-6
  reader = tf.train.load_checkpoint(_latest_model(run_dir))
  shapes = reader.get_variable_to_shape_map()
  table = next(n for n in shapes if "item_embedding" in n and "embeddings" in n
               and "OPTIMIZER" not in n)
  assert shapes[table][0] == vocabulary["table_rows"] + 1
  row_of = reader.get_tensor(next(n for n in shapes if "item_row_of" in n))
  assert row_of[0] == 0 and set(row_of[1:]) == set(range(1, vocabulary["table_rows"] + 1))
  row_weight = reader.get_tensor(next(n for n in shapes if "item_row_weight" in n))
  weights = summary["popularity_weights"]
  assert weights["count_floor"] == pytest.approx(
      summary["item_frequencies"]["noise_multiplier"] * 2)  # σ·√K, K = 4
  assert row_weight.shape == (vocabulary["table_rows"] + 1,)
  np.testing.assert_allclose([row_weight[1:].min(), row_weight[1:].max()],
                             [weights["min"], weights["max"]], rtol=1e-6)
  assert weights["min"] < 1 < weights["max"]
  assert summary["selected_on"] == "validation"
  assert summary["validation"]["users"] > 0 and "by_popularity" in summary["validation"]
  assert 10 <= summary["distinct_top10_items"] <= data.num_items
  assert 0 <= summary["top10_popularity_overlap"] <= 1


def test_vocabulary_alone_pays_for_the_histogram():
  """Without Re-Attention, the vocabulary or the popularity weights still need the DP counts:
  the plan pays for them."""
  from dprec.workflows.seqrec import SeqRecTrainOptions
  vanilla = SeqRecTrainOptions(model="dpformer", reattention=False)
  assert item_frequencies.mechanisms(vanilla) == []
  for levers in ({"item_vocab_threshold": 5}, {"popularity_weights": True}):
    options = SeqRecTrainOptions(model="dpformer", reattention=False, **levers)
    assert item_frequencies.mechanisms(options) == [(item_frequencies.LABEL, 0.05)]
