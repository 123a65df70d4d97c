"""Shared fixture of the `train seqrec` tests: a tiny synthetic sequences job output."""
import pytest

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
