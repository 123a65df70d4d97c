"""Shared fixtures of the `train seqrec` tests: a tiny synthetic sequences job output and a public
item frequency file for it."""
import numpy as np
import pytest

from dprec.data.sequences import load_sequences

from dprec.data.synthetic import generate_sequences
from pipelines import sequences as sequences_job


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """120 users, 40 items, through the Beam sequences job (SASRec format)."""
  root = tmp_path_factory.mktemp("seqrec")
  generate_sequences(str(root / "seq.txt"), users=120, items=40, seed=0, progress=False)
  out = str(root / "out")
  sequences_job.run(sequences_job.SequencesJob(inputs=(str(root / "seq.txt"),),
                                               input_format="sasrec", output=out))
  return out


@pytest.fixture(scope="session")
def frequency_file(data_dir, tmp_path_factory):
  """(path, p_1..p_M): public frequencies in [0.5, 1] (above 1/N, so used as they are) by
  original item id, with comments, a blank line and an id the data set does not hold."""
  data = load_sequences(data_dir)
  values = np.linspace(0.5, 1.0, data.num_items)
  lines = ["# public purchase shares", ""] + [
      f"{item}\t{float(value)!r}  # item {index}" for index, (item, value)
      in enumerate(zip(data.item_ids, values), start=1)] + ["not-in-the-data 0.5"]
  path = tmp_path_factory.mktemp("frequencies") / "p.txt"
  path.write_text("\n".join(lines) + "\n")
  return str(path), values
