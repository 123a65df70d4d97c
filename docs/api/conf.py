"""Sphinx configuration of dprec's API reference, generated from the docstrings.

Build: `sphinx-build -W -b html docs/api BUILD_DIR` (pip install -e ".[docs]"); the test
`tests/test_api_docs.py` builds it with warnings as errors.
"""
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dprec  # noqa: E402

project = "dprec"
release = version = dprec.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures name the types; docstrings say what they mean
autodoc_default_options = {"members": True, "show-inheritance": True}
nitpicky = False
html_theme = "alabaster"
html_static_path = []
exclude_patterns = ["_build"]
suppress_warnings = []
autodoc_inherit_docstrings = False  # Keras' own docstrings (Layer.call, ...) are not dprec's


_CLOSING_LITERAL = re.compile(r"(`[^`\s][^`]*`)(?=[A-Za-z0-9])")  # `tf.Variable`s
_STARRED_NAME = re.compile(r"(?<=[\[(])\*(?=\w)|(?<=, )\*(?=\w)")  # f(*args), [*size, n]


def _indent(line):
  return len(line) - len(line.lstrip())


def _plain_text(app, what, name, obj, options, lines):
  """Reads dprec's plain-text docstrings as reST: |x| is an absolute value or norm, not a
  substitution; `name`s and *args are text; and, as in plain text, a line indented more or
  less than the one before it starts a new block (reST wants a blank line there). Napoleon's
  field lists (`:param x:` and their continuation lines) are left as they are."""
  out = []
  in_field = False
  for line in lines:
    line = _STARRED_NAME.sub(r"\\*", _CLOSING_LITERAL.sub(r"\1\\ ", line.replace("|", "\\|")))
    if line.strip().startswith((":", ".. ")):
      in_field = True
    elif not line.strip():
      in_field = False
    previous = out[-1] if out else ""
    if (line.strip() and previous.strip() and not in_field
        and _indent(line) != _indent(previous)):
      out.append("")
    out.append(line)
  lines[:] = out


def setup(app):
  app.connect("autodoc-process-docstring", _plain_text)
