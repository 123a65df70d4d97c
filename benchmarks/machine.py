"""What a timing table needs beside it: the software stack and how quiet the machine was."""
import os
import platform

import numpy as np
import tensorflow as tf


def describe() -> str:
  """One line: Python, TensorFlow, numpy and the 1/5/15-minute load averages (2 cores here; a
  load above ~2.5 means other jobs shared the CPU and inflated both sides of every ratio)."""
  load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
  return (f"Python {platform.python_version()}, TensorFlow {tf.__version__}, numpy "
          f"{np.__version__}, {os.cpu_count()} CPUs, load average {load}")
