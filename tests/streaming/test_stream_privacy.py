"""Privacy by default in streaming runs: secret noise per run, charges that belong to one run, no
key or exact private quantity in the shareable outputs (stand-in model, fast)."""
import json
import os
import warnings

import numpy as np
import pytest

from dprec import privacy
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.training.period_source import ArrayPeriodSource
from dprec.training.stream_config import StreamConfig
from dprec.training.streaming import StreamingTrainer
from dprec.workflows.plan import plan_stream
from dprec.workflows.run import Run

NOT_PRIVATE_FIELDS = {"examples", "train_loss", "mean_batch_size", "batch_size"}


def _run(standin, run_dir, epsilon=50.0, **kwargs):
  trainer = standin.make_trainer(str(run_dir), epsilon, ArrayPeriodSource(standin.make_days(3)),
                                 train_periods=2, **kwargs)
  return trainer.run(), trainer.model


def _weights(model):
  return np.concatenate([model.dense.numpy()] + [t.numpy() for t in model.tables.values()])


def test_identical_runs_draw_different_noise_unless_given_an_insecure_seed(tmp_path, standin):
  first, first_model = _run(standin, tmp_path / "a")
  second, second_model = _run(standin, tmp_path / "b")
  assert first["private"] and second["private"] and first["privacy_note"] is None
  assert first["run_id"] != second["run_id"]
  assert not np.allclose(_weights(first_model), _weights(second_model))

  with pytest.warns(InsecureNoiseWarning, match="NOT differentially private"):
    third, third_model = _run(standin, tmp_path / "c", insecure_noise_seed=3)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", InsecureNoiseWarning)
    fourth, fourth_model = _run(standin, tmp_path / "d", insecure_noise_seed=3)
  np.testing.assert_array_equal(_weights(third_model), _weights(fourth_model))
  assert third["private"] is False and "--insecure-noise-seed 3" in third["privacy_note"]
  charges = json.loads((tmp_path / "c" / "ledger.json").read_text())["charges"]
  assert charges and all(c["private"] is False and c["run_id"] == third["run_id"]
                         for c in charges)
  assert not (tmp_path / "c" / "secret").exists()  # nothing secret to keep


def test_runs_sharing_a_ledger_each_pay_and_the_second_stops_at_the_budget(tmp_path, standin):
  # The budget holds three periods of the stand-in plan (σ 2, q 0.1, 10 steps), not four.
  three, four = (privacy.compute_epsilon(2.0, 0.1, 10 * n, 1e-5).epsilon for n in (3, 4))
  ledger = str(tmp_path / "ledger.json")
  first, _ = _run(standin, tmp_path / "a", epsilon=(three + four) / 2, ledger_path=ledger,
                  privacy_unit="user", examples_per_period=400)
  assert first["periods_trained"] == 2
  second, _ = _run(standin, tmp_path / "b", epsilon=(three + four) / 2, ledger_path=ledger,
                   privacy_unit="user", examples_per_period=400)
  charges = json.loads((tmp_path / "ledger.json").read_text())["charges"]
  paid_by = [c["run_id"] for c in charges]
  assert paid_by[:2] == [first["run_id"]] * 2 and second["run_id"] in paid_by
  assert second["periods_trained"] == 1 and "privacy budget" in second["stopped"]
  assert second["epsilon"] > first["epsilon"]  # the ledger composes both runs' charges


def test_key_is_private_and_absent_from_every_output(tmp_path, standin):
  summary, _ = _run(standin, tmp_path)
  key_path = tmp_path / "secret" / "noise_key"
  assert os.stat(key_path).st_mode & 0o777 == 0o600
  assert os.stat(tmp_path / "secret").st_mode & 0o777 == 0o700
  key = key_path.read_bytes()
  assert len(key) == 32
  patterns = [key, key.hex().encode(), json.dumps(list(key)).encode()]
  searched = 0
  for root, _, files in os.walk(tmp_path):
    if os.path.basename(root) == "secret":
      continue
    for name in files:
      content = (tmp_path / root / name).read_bytes()
      searched += 1
      assert not any(p in content for p in patterns), os.path.join(root, name)
  assert searched > 5  # summary, metrics, journal, ledger, run.json, checkpoints
  assert "generator" not in json.dumps(summary)


def test_summary_and_outputs_hold_no_non_private_diagnostic_by_default(tmp_path, standin):
  summary, _ = _run(standin, tmp_path / "plain")
  fields = set(summary) | {k for row in summary["periods"] for k in row}
  assert not fields & NOT_PRIVATE_FIELDS and "diagnostics_nonprivate" not in fields
  assert "epsilon_covers" in summary and "held_out_evaluation" in summary["epsilon_covers"]
  journal = (tmp_path / "plain" / "steps.jsonl").read_text().splitlines()
  assert all(set(json.loads(line)) == {"period", "step"} for line in journal)
  header = (tmp_path / "plain" / "metrics.csv").read_text().splitlines()[0].split(",")
  assert not set(header) & NOT_PRIVATE_FIELDS

  diagnosed, _ = _run(standin, tmp_path / "diagnosed", diagnostics=True)
  row = diagnosed["periods"][0]["diagnostics_nonprivate"]
  assert row["examples"] == 400 and row["mean_batch_size"] > 0 and "train_loss" in row


def test_dp_top_k_refreshes_draw_over_the_whole_id_domain(tmp_path, standin):
  """The candidates of a DP top-k refresh are every id (rowless ids count 0), not the rows the
  data made: at a small selection ε the 2^32 zero-count candidates win most slots, so a table
  gets fewer than k rows; at a large one the k most frequent rows win. A candidate set of the
  seen rows only would always give exactly k."""
  source = ArrayPeriodSource(standin.make_days(2))

  def selected(selection_epsilon):
    plan = plan_stream(60.0, 1e-5, expected_periods=1, examples_per_period=400, batch_size=40,
                       noise_multiplier=2.0, selection_epsilon=selection_epsilon)
    model = standin.StandInModel(noise_multiplier=plan.noise_multiplier)
    config = StreamConfig(top_k=2, train_periods=1)
    run = Run("stream", str(tmp_path / f"eps{selection_epsilon}"))
    StreamingTrainer(model, source, plan, config, run).run()
    return model.selected

  small = selected(0.5)  # Gumbel scale 3·2/0.5 = 12: the max of 2^32 zeros is ≈ 270
  assert sum(len(rows) for rows in small.values()) < 3
  large = selected(50.0)  # scale 0.12: zeros reach ≈ 3; counts are ≈ 100
  assert all(len(rows) == 2 for rows in large.values())
