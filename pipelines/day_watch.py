"""Watching a directory for `day_N` files: which files are ready, and when to stop watching.

The streaming Criteo job (`pipelines/criteo_stream.py`) watches in one of two places: inside the
pipeline, as the poll function and stop rule of Beam's `Watch` (`DayFiles`, `IdleTimeout`), on
runners that stream; or in the launching process (`watch_days`), which runs one bounded pipeline
per closed period on the embedded runner. Both use the same rules:

- a file is ready once it has a `day_N` or `day_N.gz` name (not `day_3.tmp`, `.day_3.part`) and
  has not changed for `settle_seconds`, so a file copied into place rather than renamed into place
  is waited for instead of being read half-written;
- watching stops once the file of `stop_after_day` (or a later day) is ready, or after
  `idle_timeout` seconds of wall-clock time without a new ready file.
"""
import os
import time
from typing import Iterable, Iterator, List, Optional, Tuple

from apache_beam.coders import PickleCoder
from apache_beam.coders import coders
from apache_beam.io import watch
from apache_beam.io.filesystem import FileMetadata
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp

from pipelines import beam_io

DAY_SECONDS = 24 * 3600


def day_timestamp(day: int) -> Timestamp:
  """Event time of the start of day `day` (day 0 = the Unix epoch)."""
  return Timestamp(day * DAY_SECONDS)


def ready_day_files(directory: str, settle_seconds: float) -> List[FileMetadata]:
  """The `day_N` files of `directory` unchanged for `settle_seconds`, in day order."""
  now = time.time()
  found = [m for r in FileSystems.match([os.path.join(directory, "day_*")])
           for m in r.metadata_list if beam_io.is_day_file(m.path)]
  ready = [m for m in found if now - m.last_updated_in_seconds >= settle_seconds]
  return sorted(ready, key=lambda m: (beam_io.day_of(m.path), m.path))


def stop_day_seen(files: Iterable[FileMetadata], stop_after_day: Optional[int]) -> bool:
  return stop_after_day is not None and any(
      beam_io.day_of(m.path) >= stop_after_day for m in files)


class DayFiles(watch.PollFn):
  """Polls a directory: each ready `day_N` file once, stamped day N; watermark = newest day's
  start (files arrive in day order, so every earlier day is complete)."""

  def __init__(self, stop_after_day: Optional[int], settle_seconds: float, pause: float):
    self._stop_after_day = stop_after_day
    self._settle_seconds = settle_seconds
    self._pause = pause

  def __call__(self, directory: str) -> watch.PollResult:
    # The embedded runner re-polls without waiting for the poll interval; a short pause keeps it
    # from spinning (other runners wait the interval anyway).
    time.sleep(self._pause)
    found = ready_day_files(directory, self._settle_seconds)
    outputs = [window.TimestampedValue(m, day_timestamp(beam_io.day_of(m.path))) for m in found]
    if stop_day_seen(found, self._stop_after_day):
      return watch.PollResult.complete(outputs)
    result = watch.PollResult.incomplete(outputs)
    return result.with_watermark(outputs[-1].timestamp) if outputs else result

  def default_output_coder(self):
    return PickleCoder()


class IdleTimeout(watch.TerminationCondition):
  """Stops watching after `seconds` of wall-clock time without a new file."""

  def __init__(self, seconds: Optional[float]):
    self._micros = None if seconds is None else int(seconds * 1e6)

  def for_new_input(self, now, element):
    return now

  def on_seen_new_output(self, now, state):
    return now

  def can_stop_polling(self, now, state):
    return self._micros is not None and (now - state).micros >= self._micros

  def state_coder(self):
    return coders.TimestampCoder()


def watch_days(directory: str, poll_seconds: float, settle_seconds: float,
               idle_timeout: Optional[float], stop_after_day: Optional[int],
               skip: Iterable[str] = ()) -> Iterator[Tuple[List[FileMetadata], bool]]:
  """The same watch in the launching process: yields (new ready files, last) once per poll.

  A file is new when its (path, size, modification time) was not yielded before, so a file that
  changes after it was taken comes again; paths in `skip` (taken by an earlier run) never do,
  but count for `stop_after_day`. Time the caller spends between polls counts as idle time.
  """
  skip, taken = set(skip), set()
  stop = IdleTimeout(idle_timeout)
  idle = stop.for_new_input(Timestamp.now(), directory)
  while True:
    ready = ready_day_files(directory, settle_seconds)
    new = [m for m in ready if m not in taken and m.path not in skip]
    taken.update(new)
    now = Timestamp.now()
    if new:
      idle = stop.on_seen_new_output(now, idle)
    last = stop_day_seen(ready, stop_after_day) or stop.can_stop_polling(now, idle)
    yield new, last
    if last:
      return
    time.sleep(poll_seconds)
