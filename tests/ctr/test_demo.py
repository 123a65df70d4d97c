"""`dprec demo` (what `make demo` runs) end to end on tiny data: summary, ε spent, files, and
the non-private and DP-AdaFEST runs side by side."""
import json
import os

import pytest

from dprec import cli
from dprec.workflows import ctr

pytestmark = pytest.mark.commands


@pytest.mark.slow
def test_demo_trains_dp_adafest_and_spends_the_planned_epsilon(tmp_path, capsys):
  out = tmp_path / "demo"
  argv = ["demo", "--out", str(out), "--rows", "1500", "--steps", "3", "--batch-size", "64",
          "--epsilon", "1.0"]
  assert cli.main(argv) == 0
  captured = capsys.readouterr()
  summary = json.loads(captured.out)
  privacy, training = summary["privacy"], summary["training"]
  assert privacy["sigma1"] == pytest.approx(ctr.CTRTrainOptions.ratio * privacy["sigma2"])
  assert privacy["epsilon_of_composed_sigma"] == pytest.approx(1.0, rel=1e-2)
  assert training["algorithm"] == "dp_adafest" and training["steps"] == 3
  assert 0.0 <= training["auc"] <= 1.0
  assert 0.95 < training["epsilon"] <= 1.0 * (1 + 1e-6)
  assert training["private"] is True and training["privacy_note"] is None
  with open(os.path.join(out, "summary.json"), encoding="utf-8") as stream:
    assert json.load(stream)["auc"] == training["auc"]
  assert os.path.exists(os.path.join(out, "ledger.json"))
  non_private = summary["non_private"]
  assert non_private["algorithm"] == "non_private" and non_private["epsilon"] is None
  assert non_private["steps"] == 3 and non_private["batch_size"] == training["batch_size"]
  # The baseline's model selection: on held-out training rows, never the evaluation day.
  selection = non_private["model_selection"]
  assert selection["best_step"] in (1, 2, 3) and set(selection["validation_log_loss_by_step"]) \
      == {"1", "2", "3"}
  assert selection["validation_rows"] + non_private["train_rows"] == training["train_rows"]
  assert non_private["eval_rows"] == training["eval_rows"]
  assert non_private["base_rate_log_loss"] == training["base_rate_log_loss"]
  table = captured.err[captured.err.index("| run | AUC | log loss"):].splitlines()
  assert table[2].startswith(f"| non-private (best step on validation) | "
                             f"{non_private['auc']:.4f} | {non_private['eval_log_loss']:.4f} |")
  assert "| ∞ |" in table[2] and non_private["steps_per_second"] > 0
  assert table[3].startswith(f"| DP-AdaFEST | {training['auc']:.4f} | "
                             f"{training['eval_log_loss']:.4f} |")
  assert f"| {training['epsilon']:.3f} |" in table[3]
