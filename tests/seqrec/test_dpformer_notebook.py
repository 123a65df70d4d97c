"""notebooks/dpformer.ipynb runs top to bottom on its tiny data and is stored without outputs."""
import os

import nbformat
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "dpformer.ipynb")


def test_notebook_executes_and_is_stored_clean(tmp_path):
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  text = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                 for output in cell.outputs)
  assert "dpformer" in text and "NDCG@10=" in text
