"""`dprec stream`: help and one-line errors for bad configurations (no training needed)."""
import pytest

from dprec import cli


def test_help_names_the_interface(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["stream", "--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--data", "--algorithm", "--epsilon-total", "--period-days", "--summary-json",
               "--train-days", "--checkpoint-every", "--top-k", "--insecure-noise-seed",
               "--secure-noise", "--diagnostics"):
    assert flag in out


@pytest.mark.parametrize("extra, message", [
    (["--algorithm", "dp_sgd", "--train-days", "3"], "needs a positive --epsilon-total"),
    (["--algorithm", "dp_fest", "--epsilon-total", "1", "--train-days", "3"], "needs --top-k"),
    (["--algorithm", "dp_sgd", "--epsilon-total", "1"], "no complete day yet; give --expected"),
    (["--algorithm", "dp_sgd", "--epsilon-total", "1", "--idle-timeout", "5"],
     "a live stream (--idle-timeout > 0) needs --expected-periods"),
    (["--algorithm", "dp_sgd", "--epsilon-total", "1", "--train-days", "3"],
     "no complete period yet"),
])
def test_bad_configurations_are_one_line_errors(tmp_path, capsys, extra, message):
  code = cli.main(["stream", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run")] + extra)
  err = capsys.readouterr().err
  assert code == 2 and message in err and err.count("\n") == 1
