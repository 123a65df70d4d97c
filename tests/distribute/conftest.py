"""tests/distribute: the step helpers of `dist_steps.py` (also the multi-worker script)."""
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("dist_steps.py")


@pytest.fixture(scope="session")
def steps(load_script):
  return load_script(SCRIPT)


@pytest.fixture(scope="session")
def mirrored():
  """MirroredStrategy over the two logical CPU devices of tests/conftest.py."""
  import tensorflow as tf
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
