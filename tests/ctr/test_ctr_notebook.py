"""notebooks/ctr_adafest.ipynb runs top to bottom on tiny data and is stored without outputs."""
import os

import nbformat
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "ctr_adafest.ipynb")


def test_notebook_is_stored_without_outputs():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None


def test_notebook_executes_on_tiny_data(tmp_path, monkeypatch):
  monkeypatch.setenv("DPREC_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for output in cell.outputs)
  assert "held-out AUC" in printed and "epsilon spent" in printed
