"""The tree passes ruff (ruff.toml: pyflakes and pycodestyle errors, lines within 100 columns), as
`make test` and CI check."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
  ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
  if ruff is None:
    pytest.skip("ruff is not installed (pip install -e '.[test]')")
  done = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:]
