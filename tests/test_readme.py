"""The README's quickstart snippets (`make_private`, then the six objects by hand) run as printed
and spend what the accountant says."""
import re
import runpy
from pathlib import Path

import pytest

from dprec import privacy
from dprec.errors import BudgetExceededError

pytestmark = pytest.mark.commands

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


def test_quickstart_snippet_run_twice_says_how_to_start_over(tmp_path, monkeypatch):
  """The second run on the first run's ledger.json finds the budget spent: the error names the
  ledger and how to start a new budget."""
  script = tmp_path / "quickstart.py"
  script.write_text(_quickstart_snippets()[1])
  monkeypatch.chdir(tmp_path)
  runpy.run_path(str(script), run_name="__main__")
  with pytest.raises(BudgetExceededError, match=r"ledger\.json: .*delete the file"):
    runpy.run_path(str(script), run_name="__main__")


def test_snippets_import_only_from_the_public_api():
  for snippet in _quickstart_snippets():
    imports = re.findall(r"^(?:from|import) (\S+)", snippet, re.M)
    assert all(name == "dprec" or not name.startswith("dprec") for name in imports), imports


def test_make_private_snippet_labels_what_it_prints():
  prints = re.findall(r"print\((.*?)\)\n(?!\s)", _quickstart_snippets()[0], re.S)
  assert prints and all("RMSE" in p and "ε spent" in p for p in prints)


def test_readme_states_the_makefiles_test_workers():
  workers = re.search(r"^test:.*?pytest -n (\d+)", (README.parent / "Makefile").read_text(),
                      re.S | re.M).group(1)
  assert f"pytest, {workers} workers" in README.read_text()
