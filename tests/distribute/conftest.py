"""tests/distribute: the step helpers of `dist_steps.py` (also the multi-worker script)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("dist_steps.py")


@pytest.fixture(scope="session")
def steps():
  spec = importlib.util.spec_from_file_location("dist_steps", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="session")
def mirrored():
  """MirroredStrategy over the two logical CPU devices of tests/conftest.py."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
