"""The walkthrough notebooks are stored executed, with their outputs, at least one plot and no
error; they run top to bottom again on tiny data (`DPREC_NOTEBOOK_TINY=1`), and every cell that
prints or plots there has its stored output."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.commands

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# notebook: text its outputs print, executed or re-executed
EXPECTED = {
    "ctr_adafest.ipynb": ("held-out AUC", "epsilon spent", "log loss", "base rate"),
    "dpformer.ipynb": ("dpformer", "vanilla", "non-private", "most popular", "NDCG@10="),
}


def _problems(notebook):
  """What a notebook stored with its results lacks: a code cell never executed, an error, a
  plot."""
  problems = []
  for index, cell in enumerate(notebook.cells):
    if cell.cell_type != "code":
      continue
    if cell.get("execution_count") is None:
      problems.append(f"code cell {index} was not executed")
    problems += [f"code cell {index} stores an error: {output.get('ename')}: "
                 f"{output.get('evalue')}" for output in cell.get("outputs", [])
                 if output.output_type == "error"]
  if not any("image/png" in output.get("data", {}) for cell in notebook.cells
             for output in cell.get("outputs", [])):
    problems.append("no plot (image/png output)")
  return problems


def _results(cell):
  """A code cell's printed and displayed outputs (stderr, e.g. progress bars, aside)."""
  return [output for output in cell.get("outputs", [])
          if output.output_type in ("execute_result", "display_data")
          or (output.output_type == "stream" and output.name == "stdout")]


def _printed(notebook):
  return "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                 for output in cell.outputs)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_is_stored_with_its_results(name):
  notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
  assert not _problems(notebook), _problems(notebook)
  assert all(text in _printed(notebook) for text in EXPECTED[name])


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.slow
def test_notebook_runs_again_on_tiny_data(name, tmp_path, monkeypatch):
  monkeypatch.setenv("DPREC_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
  stored = nbformat.read(NOTEBOOKS / name, as_version=4)
  notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
  for cell in notebook.cells:  # run from a clean state
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  NotebookClient(notebook, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  assert not _problems(notebook), _problems(notebook)
  assert all(text in _printed(notebook) for text in EXPECTED[name])
  missing = [index for index, (again, kept) in enumerate(zip(notebook.cells, stored.cells))
             if again.cell_type == "code" and _results(again) and not _results(kept)]
  assert not missing, f"code cells {missing} print or plot but have no stored output"
