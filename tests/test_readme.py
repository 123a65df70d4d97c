"""The README's quickstart snippets (`make_private`, then the six objects by hand) run as printed
and spend what the accountant says."""
import re
import runpy
from pathlib import Path

import pytest

from dprec import privacy

README = Path(__file__).resolve().parents[1] / "README.md"


def _quickstart_snippets():
  quickstart = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", quickstart, re.S)


def test_make_private_snippet_trains_within_its_budget(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  script = tmp_path / "make_private.py"
  script.write_text(_quickstart_snippets()[0])
  run = runpy.run_path(str(script), run_name="__main__")
  model, history = run["model"], run["history"]
  assert 0.9 < model.epsilon_spent <= 1.0 + 1e-6
  assert history.history["epsilon"][-1] == pytest.approx(model.epsilon_spent)
  assert history.history["root_mean_squared_error"][-1] < run["ratings"].std()


def test_quickstart_snippet_runs_and_spends_its_budget(tmp_path, monkeypatch):
  code = _quickstart_snippets()[1]
  script = tmp_path / "quickstart.py"
  script.write_text(code)
  monkeypatch.chdir(tmp_path)
  run = runpy.run_path(str(script), run_name="__main__")
  expected = privacy.compute_epsilon(run["config"].accounting_noise_multiplier, run["q"],
                                     run["STEPS"], 1 / run["N"]).epsilon
  reloaded = privacy.PrivacyLedger(str(tmp_path / "ledger.json"))
  assert reloaded.epsilon_spent() == pytest.approx(expected, rel=1e-6)
  assert expected <= 1.0 + 1e-6
  assert run["history"].history["gradient_size_reduction"][-1] > 10
