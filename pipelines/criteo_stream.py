"""Criteo time series as a stream: day files arrive, each closed period gets TFRecords + vocabulary.

    python -m pipelines.criteo_stream --input DIR --output OUT [--period-days 1] [--idle-timeout S]

Beam's `Watch` (the polling engine under `fileio.MatchContinuously`) watches DIR for `day_N`
files; each file's records carry the event time of day N, and the watermark is the start of the
newest day seen (files arrive in day order, so every earlier day is complete). Records are parsed
in parallel, windowed into fixed windows of the streaming period and grouped per window. One
stateful step then takes the closed periods in event-time order and keeps the running-sum bucket
counts across them (the "streaming-based frequency information" of note 001 §5.1): a bucket gets
the next free index the first period its running count reaches `--min-count` (up to `--top-k`
ids per feature) and keeps it forever, so ids are stable across periods. Each period's TFRecords,
its vocabulary snapshot and its dead letters are written under a temporary name and renamed to
`OUT/day_<first day of the period>`, then the manifest is replaced atomically: a trainer tailing
OUT never sees half a period. The manifest keeps one `dataset_id` for the output (a restarted job
keeps the one it finds) and says the vocabulary is not DP (`vocab_privacy`).

`MatchContinuously` itself stamps matches with the poll time and lets the watermark follow the
clock, so day-stamped records would all be late; its poll budget also counts polls, which the
embedded runner runs back to back. `Watch` with a day-index watermark and a wall-clock stop fixes
both. Records later than the watermark (a day that arrives after a later one) are dropped by the
windowing, as Beam does for late data without allowed lateness.
"""
import argparse
import dataclasses
import os
import shutil
import sys
import time
import uuid
from typing import List, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.coders import PickleCoder
from apache_beam.coders import coders
from apache_beam.io import watch
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms import userstate
from apache_beam.transforms import window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Duration
from apache_beam.utils.timestamp import Timestamp

from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CATEGORICAL_FEATURES
from dprec.data.criteo import CriteoVocabulary
from dprec.data.criteo import count_categories
from dprec.errors import DprecError
from pipelines import beam_io
from pipelines import criteo

DAY_SECONDS = 24 * 3600


def day_timestamp(day: int) -> Timestamp:
  """Event time of the start of day `day` (day 0 = the Unix epoch)."""
  return Timestamp(day * DAY_SECONDS)


@dataclasses.dataclass(frozen=True)
class StreamJob:
  """A streaming run: watched directory, output, period length, vocabulary growth, stop rule."""
  input_dir: str
  output: str
  period_days: int = 1
  min_count: int = 1
  top_k: Optional[int] = None
  poll_seconds: float = 1.0
  idle_timeout: Optional[float] = None
  stop_after_day: Optional[int] = None
  strict_columns: bool = False  # refuse lines with fewer than 40 fields instead of padding them
  dataset_id: Optional[str] = None  # `run` keeps the output's, or draws one

  def __post_init__(self):
    if self.period_days < 1:
      raise DprecError(f"--period-days must be at least 1, got {self.period_days}")
    if self.min_count < 1:
      raise DprecError(f"--min-count must be at least 1, got {self.min_count}")
    if self.top_k is not None and self.top_k < 1:
      raise DprecError(f"--top-k must be positive, got {self.top_k}")


class DayFiles(watch.PollFn):
  """Polls a directory: each `day_N` file once, stamped day N; watermark = newest day's start."""

  def __init__(self, stop_after_day: Optional[int], pause: float):
    self._stop_after_day = stop_after_day
    self._pause = pause

  def __call__(self, directory: str) -> watch.PollResult:
    # The embedded runner re-polls without waiting for the poll interval; a short pause keeps it
    # from spinning (other runners wait the interval anyway).
    time.sleep(self._pause)
    found = [m for r in FileSystems.match([os.path.join(directory, "day_*")])
             for m in r.metadata_list if beam_io.is_day_file(m.path)]
    outputs = [window.TimestampedValue(m, day_timestamp(beam_io.day_of(m.path))) for m in found]
    newest = max((beam_io.day_of(m.path) for m in found), default=None)
    if newest is not None and self._stop_after_day is not None and newest >= self._stop_after_day:
      return watch.PollResult.complete(outputs)
    result = watch.PollResult.incomplete(outputs)
    return result if newest is None else result.with_watermark(day_timestamp(newest))

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


def _file_path(metadata) -> str:
  """Watch's dedup key: each path is emitted once."""
  return metadata.path


def read_day_file(metadata, timestamp=beam.DoFn.TimestampParam):
  """A watched file → its `LineBlock`s (and gzip dead letters), all at the file's event time."""
  path = metadata.path
  end = -1 if beam_io.is_gzip(path) else metadata.size_in_bytes
  split = beam_io.Split(path, 0, end, 1, beam_io.day_of(path), 0)
  for item in beam_io.read_split(split):
    yield window.TimestampedValue(item, timestamp)


@dataclasses.dataclass
class RunningCounts:
  """Running-sum bucket counts per feature and the ids assigned so far (in index order)."""
  counts: List[tuple] = dataclasses.field(
      default_factory=lambda: [criteo.merge_counts([]) for _ in CATEGORICAL_FEATURES])
  assigned: List[np.ndarray] = dataclasses.field(
      default_factory=lambda: [np.zeros(0, np.int64) for _ in CATEGORICAL_FEATURES])

  def update(self, chunks, min_count: int, top_k: Optional[int]) -> CriteoVocabulary:
    """Adds one period's counts; appends newly frequent buckets; returns the snapshot."""
    deltas = count_categories(chunks)
    counts = []
    for j, delta in enumerate(deltas):
      ids, totals = criteo.merge_counts([self.counts[j], delta])
      self.counts[j] = (ids, totals)
      room = None if top_k is None else max(top_k - len(self.assigned[j]), 0)
      fresh = (totals >= min_count) & ~np.isin(ids, self.assigned[j])
      order = np.lexsort((ids[fresh], -totals[fresh]))[:room]
      self.assigned[j] = np.concatenate([self.assigned[j], ids[fresh][order]])
      counts.append(totals[np.searchsorted(ids, self.assigned[j])])
    return CriteoVocabulary(tuple(self.assigned), tuple(counts))


class RunningVocabulary(beam.DoFn):
  """Takes closed periods in event-time order; keeps running counts; writes each period."""

  PENDING = userstate.BagStateSpec("pending", PickleCoder())
  STATE = userstate.ReadModifyWriteStateSpec("running", PickleCoder())
  RELEASE = userstate.TimerSpec("release", TimeDomain.WATERMARK)

  def __init__(self, job: StreamJob):
    self._job = job

  def process(self, keyed, timestamp=beam.DoFn.TimestampParam,
              pending=beam.DoFn.StateParam(PENDING), release=beam.DoFn.TimerParam(RELEASE)):
    pending.add((timestamp, keyed[1]))
    release.set(min(t for t, _ in pending.read()))

  @userstate.on_timer(RELEASE)
  def on_release(self, fired=beam.DoFn.TimestampParam, pending=beam.DoFn.StateParam(PENDING),
                 running=beam.DoFn.StateParam(STATE), release=beam.DoFn.TimerParam(RELEASE)):
    periods = sorted(pending.read(), key=lambda item: item[0])
    pending.clear()
    later = [item for item in periods if item[0] > fired]
    for item in later:
      pending.add(item)
    if later:
      release.set(later[0][0])
    state = running.read() or {"counts": RunningCounts(), "stats": criteo.ShardStats(),
                               "entries": {}}
    for _, (first_day, parsed) in (item for item in periods if item[0] <= fired):
      yield self._write_period(state, first_day, parsed)
    running.write(state)

  def _write_period(self, state: dict, first_day: int, parsed) -> dict:
    job = self._job
    chunks = [chunk for chunk, _ in parsed if chunk is not None]
    letters = sorted((l for _, bad in parsed for l in bad), key=lambda l: (l.path, l.line))
    vocab = state["counts"].update(chunks, job.min_count, job.top_k)
    chunks.sort(key=lambda chunk: (chunk.path, chunk.line_numbers[:1].tolist()))
    name = f"day_{first_day}"
    staging = os.path.join(job.output, f".{name}.tmp-{uuid.uuid4().hex}")
    stats = criteo.write_shard(os.path.join(staging, "part-00000.tfrecord"), chunks, vocab)
    criteo.count_dead_letters(stats, letters)
    stats.files = {first_day: [("part-00000.tfrecord", stats.rows_out)]}
    vocab.save(os.path.join(staging, "vocab"))
    beam_io.write_dead_letters(os.path.join(staging, "dead_letters.jsonl"), letters)
    final = os.path.join(job.output, name)
    if os.path.exists(final):
      shutil.rmtree(final)
    os.rename(staging, final)
    state["stats"].add(stats)
    state["entries"][first_day] = {
        "days": list(range(first_day, first_day + job.period_days)),
        "vocab_dir": f"{name}/vocab", "vocab_sizes": dict(zip(CATEGORICAL_FEATURES, vocab.sizes)),
        "dead_letters": stats.rows_in - stats.rows_out}
    summary = state["stats"].summary(vocab)
    summary["periods"] = len(state["entries"])
    beam_io.write_json(os.path.join(job.output, criteo_tfrecord.STATS), summary)
    beam_io.write_json(os.path.join(job.output, criteo_tfrecord.MANIFEST), criteo.manifest(
        state["stats"], vocab, vocab_dir=f"{name}/vocab", extra_entries=state["entries"],
        dataset_id=job.dataset_id, vocab_privacy=criteo.public_vocab_privacy("running_counts")))
    return {"day": first_day, "rows": stats.rows_out, "dead_letters": len(letters),
            "vocab_sizes": list(vocab.sizes)}


class PeriodOf(beam.DoFn):
  """(key, parsed blocks of one window) → (key, (first day of the period, parsed blocks))."""

  def process(self, keyed, win=beam.DoFn.WindowParam):
    yield keyed[0], (int(win.start.micros // (DAY_SECONDS * 10**6)), list(keyed[1]))


class StreamingCriteo(beam.PTransform):
  """Event-time-stamped `LineBlock`s → per-period outputs (see the module docstring)."""

  def __init__(self, job: StreamJob):
    super().__init__()
    self._job = job

  def expand(self, blocks):
    seconds = self._job.period_days * DAY_SECONDS
    return (blocks
            | "Parse" >> beam.Map(criteo.parse_block, metrics=True,
                                  strict_columns=self._job.strict_columns)
            | "Period" >> beam.WindowInto(window.FixedWindows(seconds))
            | "Key" >> beam.Map(lambda parsed: ("criteo", parsed))
            | "GroupPeriod" >> beam.GroupByKey()
            | "PeriodOf" >> beam.ParDo(PeriodOf())
            | "Rewindow" >> beam.WindowInto(window.GlobalWindows())
            | "RunningVocabulary" >> beam.ParDo(RunningVocabulary(self._job)))


def build_pipeline(pipeline: beam.Pipeline, job: StreamJob):
  """The watching job: Watch(day files) → read at day event time → `StreamingCriteo`."""
  files = (pipeline
           | "Directory" >> beam.Create([job.input_dir])
           | "WatchDayFiles" >> watch.Watch(
               DayFiles(job.stop_after_day, min(job.poll_seconds, 0.2)),
               poll_interval=Duration.of(job.poll_seconds),
               termination=IdleTimeout(job.idle_timeout),
               output_key_fn=_file_path)
           | "File" >> beam.Map(lambda pair: pair[1]))
  return (files
          | "ReadDayFile" >> beam.FlatMap(read_day_file)
          | "Stream" >> StreamingCriteo(job))


def run(job: StreamJob, beam_args: Sequence[str] = ()) -> dict:
  """Watches until `--stop-after-day` is seen or `--idle-timeout` passes; returns stats.json."""
  if job.idle_timeout is None and job.stop_after_day is None:
    print("watching without --idle-timeout or --stop-after-day: stop with Ctrl-C",
          file=sys.stderr)
  if not os.path.isdir(job.input_dir):
    raise DprecError(f"{job.input_dir}: not a directory (the streaming job watches a directory)")
  beam_io.makedirs(job.output)
  job = dataclasses.replace(job, dataset_id=job.dataset_id or identity.manifest_field(
      job.output, identity.DATASET_ID) or identity.new_dataset_id())
  counters = beam_io.run_pipeline(beam_io.pipeline_options(beam_args, streaming=True),
                                  lambda pipeline: build_pipeline(pipeline, job),
                                  criteo.METRICS_NAMESPACE)
  stats_path = os.path.join(job.output, criteo_tfrecord.STATS)
  if not os.path.exists(stats_path):
    raise DprecError(f"{job.input_dir}: no day_N file arrived; nothing written")
  summary = beam_io.read_json(stats_path)
  summary["beam_counters"] = counters
  summary["output"] = job.output
  return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--period-days", type=int, default=1,
                      help="streaming period: days per window and per output (default 1)")
  parser.add_argument("--poll-seconds", type=float, default=1.0,
                      help="how often to look for new day files (default 1)")
  parser.add_argument("--idle-timeout", type=float, default=None,
                      help="stop after this many seconds without a new file")
  parser.add_argument("--stop-after-day", type=int, default=None,
                      help="stop once the file of this day has arrived")


def job_from_args(args) -> StreamJob:
  if args.vocab_mode == "dp_top_k":
    raise DprecError("--streaming supports --vocab-mode min_count and top_k (ids are assigned "
                     "once and kept); DP top-k selection is a batch job")
  top_k = criteo.parse_top_k(args.top_k)
  if top_k is not None and not np.isscalar(top_k):
    raise DprecError("--streaming takes one --top-k capacity for all features")
  if len(args.input) != 1:
    raise DprecError("--streaming watches one directory: give exactly one --input")
  return StreamJob(input_dir=args.input[0], output=args.output, period_days=args.period_days,
                   min_count=args.min_count, top_k=top_k, poll_seconds=args.poll_seconds,
                   idle_timeout=args.idle_timeout, stop_after_day=args.stop_after_day,
                   strict_columns=args.strict_columns)


def main(argv=None) -> int:
  """`python -m pipelines.criteo_stream`; the job classes are used from the imported module, not
  `__main__`, so Beam workers can unpickle them."""
  from pipelines import cli  # pylint: disable=import-outside-toplevel
  return cli.job_main("criteo", ["--streaming"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
  sys.exit(main())
