"""Progress bars: redrawn in place on a terminal; in a log, a few plain lines, no carriage
returns."""
import io
import subprocess
import sys

from dprec import progress


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def _run_bar(monkeypatch, stream, steps=5000):
  monkeypatch.setattr(sys, "stderr", stream)
  with progress.progress_bar(total=steps, desc="work", mininterval=0) as bar:
    for _ in range(steps):
      bar.update(1)
  return stream.getvalue()


def test_a_log_gets_a_few_lines_without_carriage_returns(monkeypatch):
  # mininterval=0 from the caller is kept on a terminal; in a log the interval is the module's.
  monkeypatch.setattr(progress, "LOG_INTERVAL_SECONDS", 3600.0)
  text = _run_bar(monkeypatch, io.StringIO())
  assert "\r" not in text
  lines = text.splitlines()
  assert 1 <= len(lines) <= 3 and "5000/5000" in lines[-1]


def test_a_terminal_gets_the_usual_in_place_redraws(monkeypatch):
  text = _run_bar(monkeypatch, _Terminal())
  assert text.count("\r") > 100


def test_a_command_writing_to_a_pipe_prints_lines(tmp_path):
  run = subprocess.run([sys.executable, "-m", "dprec.cli", "synth", "criteo", "--rows", "30000",
                        "--days", "2", "--vocab", "scaled:5000", "--out", str(tmp_path / "d")],
                       capture_output=True, text=True, check=True)
  bars = [line for line in run.stderr.splitlines() if "synth criteo" in line]
  assert "\r" not in run.stderr and 1 <= len(bars) <= 3
