"""`import dprec` quiets TensorFlow's start-up noise, not its errors (a subprocess: only a fresh
interpreter imports TensorFlow for the first time)."""
import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

from dprec import quiet

ROOT = pathlib.Path(__file__).resolve().parents[1]
ERROR_LINE = "E0000 00:00:1.2 3 cuda_platform.cc:52] something real went wrong"
WARNING_LINE = "W0000 00:00:1.2 3 x.cc:1] a warning"


def test_start_up_noise_is_dropped_and_other_lines_kept():
  held = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
          "STDERR\nI0000 00:00:1.2 3 port.cc:153] oneDNN custom operations are on.\n"
          "To enable the following instructions: AVX2, in other operations, rebuild.\n"
          f"{ERROR_LINE}\n{WARNING_LINE}\n")
  assert quiet.start_up_lines_to_show(held) == f"{ERROR_LINE}\n{WARNING_LINE}\n"


@pytest.mark.skipif(tuple(int(v) for v in tf.__version__.split(".")[:2]) < (2, 16),
                    reason="TensorFlow 2.15 logs its CUDA plugins' registration at error level")
def test_importing_dprec_then_tensorflow_prints_no_start_up_log():
  code = ("import dprec, tensorflow as tf, keras, sys\n"
          "tf.constant(1.0) + 1\n"
          "print('after import', file=sys.stderr)\n"
          "try:\n"
          "  tf.raw_ops.MatMul(a=tf.ones([2, 3]), b=tf.ones([2, 3]))\n"
          "except tf.errors.InvalidArgumentError as error:\n"
          "  print('error shown', file=sys.stderr)\n")
  env = {k: v for k, v in os.environ.items() if k != quiet.TF_LOG_LEVEL}
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=dict(env, PYTHONPATH=str(ROOT)))
  assert result.stderr.splitlines()[0] == "after import", result.stderr
  for noise in ("InitializeLog", "cuInit", "oneDNN", "cuda drivers", "I0000"):
    assert noise not in result.stderr, (noise, result.stderr)
  assert "error shown" in result.stderr
