"""Fixtures of the `train ctr` tests."""
import pytest

from dprec import cli


@pytest.fixture
def cli_error(capsys):
  """`cli_error(argv)`: runs `dprec argv`, checks that it failed with one line (exit status 2, no
  traceback) and returns that line."""
  def run(argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err

  return run
