"""Runs pytest on the test files given as arguments, from the root of the test's runfiles (where
pytest.ini and the conftest.py files are), and exits with pytest's status: the main of every
Bazel py_test here (bazel/pytest.bzl)."""
import os
import sys

import pytest

if __name__ == "__main__":
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  os.chdir(root)
  sys.exit(pytest.main(["-q", "-p", "no:xdist", "-p", "no:cacheprovider"] + sys.argv[1:]))
