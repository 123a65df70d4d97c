"""The README's `model.fit` quickstart runs as printed and spends what the accountant says."""
import re
import runpy
from pathlib import Path

import pytest

from dprec import privacy

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_snippet_runs_and_spends_its_budget(tmp_path, monkeypatch):
  quickstart = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  code = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
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
