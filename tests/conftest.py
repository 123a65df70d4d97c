"""Suite-wide setup: Keras 2 (tf-keras) before TensorFlow loads, two logical CPU devices, the
peer-test switch, runs made once per session, and longest-first scheduling."""
import fcntl
import importlib.util
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest
import tensorflow as tf

# Two logical CPU devices, so tests/distribute runs MirroredStrategy with 2 replicas in this
# process; set before TensorFlow initialises its devices (everything else runs on the first).
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)


@pytest.fixture
def tensorflow_privacy():
  """tensorflow_privacy, our peer (it imports only on TF ≤ 2.15: `pip install -e .[tfp]` in a
  Python 3.11 venv). Its tests are skipped without it, unless DPREC_REQUIRE_PEERS=1 (the legacy CI
  leg), where a missing peer fails them."""
  try:
    import tensorflow_privacy as tfp
  except ImportError as error:
    if os.environ.get("DPREC_REQUIRE_PEERS") == "1":
      pytest.fail(f"DPREC_REQUIRE_PEERS=1 but tensorflow_privacy does not import: {error}")
    pytest.skip(f"peer test: tensorflow_privacy does not import here ({error})")
  return tfp


@pytest.fixture(scope="session")
def criteo_days(once_per_session):
  """`criteo_days(rows, days)`: a directory of tiny synthetic Criteo days (seed 0, vocabularies
  scaled to 3k buckets), generated once per size for the whole session; tests only read it."""
  # Imported here: not every Bazel test target depends on dprec.data.
  from dprec.data import synthetic

  def make(rows, days):
    def generate(directory):
      synthetic.generate_criteo(str(directory), rows=rows, days=days, seed=0, vocab="scaled:3k",
                                progress=False)

    return str(once_per_session(f"criteo_{rows}x{days}", generate)[0])

  return make


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory):
  """`once_per_session(name, make)`: `make(directory)`'s result (JSON), made once in the whole
  test session, also under pytest-xdist, whose workers share the parent of their temporary
  directories: the first worker to ask makes it there under a file lock, the others wait and
  read it (a module fixture would run again in every worker that gets one of its tests). For
  runs that tests only read; returns (directory, result)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent
  root = root / "once_per_session"
  root.mkdir(exist_ok=True)

  def get(name, make):
    directory, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if not done.exists():
        shutil.rmtree(directory, ignore_errors=True)  # what a failed attempt left
        directory.mkdir()
        done.write_text(json.dumps({"result": make(directory)}))
    return directory, json.loads(done.read_text())["result"]

  return get


@pytest.fixture(scope="session")
def load_script():
  """`load_script(path)`: the module of a Python file that is not on the import path (a
  benchmark, or a test helper that also runs as a program)."""
  def load(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

  return load


@pytest.fixture(scope="session")
def sequences_dir(once_per_session):
  """120 users, 40 items, through the Beam sequences job (SASRec format), once for the session;
  tests only read it."""
  # Imported here: not every Bazel test target depends on dprec.data and pipelines.
  from dprec.data import synthetic
  from pipelines import sequences

  def make(root):
    synthetic.generate_sequences(str(root / "seq.txt"), users=120, items=40, seed=0,
                                 progress=False)
    sequences.run(sequences.SequencesJob(inputs=(str(root / "seq.txt"),), input_format="sasrec",
                                         output=str(root / "out")))

  return str(once_per_session("sequences", make)[0] / "out")


# The longest tests start first, so the xdist workers do not end on one of them while the others
# wait (longest-first scheduling; the Makefile's `--maxschedchunk 2` hands tests out at most two
# consecutive ones at a time, so they spread over the workers); the rest keeps its order. A
# worker runs a module fixture for its own tests: only the first two tests are sure to share a
# worker (tests/distribute/test_parameter_server_faults.py's two on one live cluster); runs that
# tests only read are shared through `once_per_session`.
LONGEST_FIRST = ("faults", "multiprocess", "slow")


def pytest_collection_modifyitems(items):
  def rank(item):
    return next((i for i, name in enumerate(LONGEST_FIRST) if item.get_closest_marker(name)),
                len(LONGEST_FIRST))
  items.sort(key=rank)
