"""Shared fixture of the `train seqrec` tests: a public item frequency file for the suite's tiny
synthetic sequences (`sequences_dir`, tests/conftest.py)."""
import numpy as np
import pytest

from dprec.data.sequences import load_sequences


@pytest.fixture(scope="session")
def frequency_file(sequences_dir, tmp_path_factory):
  """(path, p_1..p_M): public frequencies in [0.5, 1] (above 1/N, so used as they are) by
  original item id, with comments, a blank line and an id the data set does not hold."""
  data = load_sequences(sequences_dir)
  values = np.linspace(0.5, 1.0, data.num_items)
  lines = ["# public purchase shares", ""] + [
      f"{item}\t{float(value)!r}  # item {index}" for index, (item, value)
      in enumerate(zip(data.item_ids, values), start=1)] + ["not-in-the-data 0.5"]
  path = tmp_path_factory.mktemp("frequencies") / "p.txt"
  path.write_text("\n".join(lines) + "\n")
  return str(path), values
