"""Progress for long work on stderr: tqdm bars, redrawn in place on a terminal; in a log (stderr
not a terminal, e.g. `make demo > log 2>&1`) one plain line at most every `LOG_INTERVAL_SECONDS`
instead of hundreds of carriage-return redraws. Work that cannot report as it goes (a Beam job,
whose workers' output is held back) says one line as each phase starts and ends (`phase`);
work made of a few long parts, one line per part with the seconds so far (`phase_lines`)."""
import sys
import time

import tqdm

LOG_INTERVAL_SECONDS = 30.0


class _LogLines:
  """A stream for tqdm that turns each in-place redraw into one line."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text):
    text = text.replace("\r", "").rstrip("\n")
    if text.strip():
      self.stream.write(text + "\n")

  def flush(self):
    self.stream.flush()


def progress_bar(iterable=None, **kwargs) -> tqdm.tqdm:
  """`tqdm.tqdm(iterable, **kwargs)` on stderr; when stderr is a log, plain lines at most every
  `LOG_INTERVAL_SECONDS` (overriding `mininterval`)."""
  if not sys.stderr.isatty():
    kwargs["mininterval"] = kwargs["maxinterval"] = LOG_INTERVAL_SECONDS
    kwargs.setdefault("ascii", True)
    kwargs["file"] = _LogLines(sys.stderr)
  return tqdm.tqdm(iterable, **kwargs)


def phase(job: str, text: str) -> None:
  """One line on stderr, `job: text`: a phase of a long job starting or done (rows so far)."""
  print(f"{job}: {text}", file=sys.stderr, flush=True)


def close_all() -> None:
  """Closes every open progress bar (e.g. one a Ctrl-C left open), so that nothing is drawn
  after the command's last line."""
  for bar in list(tqdm.tqdm._instances):
    bar.close()


def phase_lines(label: str, enabled: bool = True):
  """A function `report(what)` printing one line per phase on stderr, `label: what (T s)`, T the
  seconds since this call; prints nothing if not `enabled`."""
  started = time.perf_counter()

  def report(what):
    if enabled:
      phase(label, f"{what} ({time.perf_counter() - started:.0f} s)")

  return report
