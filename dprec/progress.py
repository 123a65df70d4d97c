"""Progress bars for long work: tqdm on stderr, redrawn in place on a terminal; in a log (stderr
not a terminal, e.g. `make demo > log 2>&1`) one plain line at most every `LOG_INTERVAL_SECONDS`
instead of hundreds of carriage-return redraws. Work that cannot report as it goes (a Beam job,
whose workers' output is held back) says one line as each phase starts and ends (`phase`)."""
import sys

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
