"""Criteo time series as a stream: day files arrive, each closed period gets TFRecords + vocabulary.

    python -m pipelines.criteo_stream --input DIR --output OUT [--period-days 1] [--idle-timeout S]

DIR is watched for `day_N` files (`pipelines/day_watch.py`: a file is taken once it has not changed
for --settle-seconds). Records carry the event time of their day, and a period of --period-days
days closes once a later day's file has arrived (files arrive in day order) or the watch stops.
Records are parsed in parallel, windowed into fixed windows of the period and grouped per window.
One stateful step then takes the closed periods in event-time order and keeps the running-sum
bucket counts across them (the "streaming-based frequency information" of Ghazi et al. 2023,
arXiv:2311.08357, §5.1): a bucket
gets the next free index the first period its running count reaches --vocab-min-count (up to k
ids a feature) and keeps it forever, so ids are stable across periods. Each period's TFRecords, its
vocabulary snapshot and its dead letters are written under a temporary name and renamed to
`OUT/day_<first day of the period>`, then the manifest is replaced atomically (a trainer tailing
OUT never sees half a period), then the running state (`OUT/stream_state.pkl`), so the job can be
stopped and rerun on the same OUT. Periods are written in day order: rows of a period that closes
after a later period was written (a late day, or a file changed after it was read) go to
`OUT/dead_letters/` with the reason, never into a period. The manifest keeps one `dataset_id` for
the output (a rerun keeps the one it finds) and says the vocabulary is not DP (`vocab_privacy`).

How it runs depends on the runner:
- the embedded runner (the default): this process watches DIR and runs one bounded pipeline per
  batch of closed periods. The embedded runner cannot stream a polling source: with several
  worker processes it drops the deferred polls of `Watch` (the job ended after its first poll),
  and in every mode it runs nothing downstream of a GroupByKey before its source is done, so no
  period would be written while the job watches (docs/guide/preprocess.md, "Where the streaming job
  runs").
- a streaming runner (`--runner` Dataflow, Flink, Prism): one unbounded pipeline, Beam's `Watch`
  polling DIR with a day-index watermark and the same stop rule. Runners of bounded pipelines
  only (`BATCH_ONLY_RUNNERS`: Dask) are refused with the list of those that stream.
  (`MatchContinuously` itself stamps
  matches with the poll time and lets the watermark follow the clock, so day-stamped records would
  all be late; its poll budget also counts polls, not idle time.)
"""
import argparse
import collections
import dataclasses
import os
import pickle
import shutil
import sys
import uuid
from typing import List, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.coders import PickleCoder
from apache_beam.io import watch
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms import userstate
from apache_beam.transforms import window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Duration

from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CriteoVocabulary
from dprec.data.criteo import count_categories
from dprec.data.criteo_parse import CATEGORICAL_FEATURES
from dprec.errors import DprecError
from dprec.progress import progress_bar
from pipelines import beam_io
from pipelines import criteo
from pipelines import criteo_shards
from pipelines import criteo_vocabulary
from pipelines import day_watch
from pipelines.day_watch import DAY_SECONDS
from pipelines.day_watch import day_timestamp

STATE = "stream_state.pkl"
# Beam runners that run the unbounded pipeline (a polling splittable DoFn, event-time windows,
# per-key state), and those that run only bounded pipelines, which are refused.
STREAMING_RUNNERS = ("DataflowRunner", "FlinkRunner (portable)", "PrismRunner")
BATCH_ONLY_RUNNERS = ("DaskRunner",)
# The period pipelines' embedded runner: one in-process worker. A period is read file by file and
# written by one stateful step (one key), and parsing already uses pyarrow's threads, so worker
# processes would only add their start-up to every period.
PERIOD_RUNNER = ("in_memory", 1)
# How long the unbounded pipeline keeps a closed window open for late records, which then reach
# the stateful step as a late pane and become dead letters instead of vanishing.
ALLOWED_LATENESS_DAYS = 366


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
  settle_seconds: float = 2.0
  pad_short_lines: bool = False  # read lines with fewer than 40 fields as missing trailing values
  user_column: bool = False  # lines end with a user_id field, carried into the records
  dataset_id: Optional[str] = None  # `run` keeps the output's, or draws one

  def __post_init__(self):
    if self.period_days < 1:
      raise DprecError(f"--period-days must be at least 1, got {self.period_days}")
    if self.min_count < 1:
      raise DprecError(f"--vocab-min-count must be at least 1, got {self.min_count}")
    if self.top_k is not None and self.top_k < 1:
      raise DprecError(f"--top-k must be positive, got {self.top_k}")
    if self.poll_seconds <= 0 or self.settle_seconds < 0:
      raise DprecError(f"--poll-seconds must be positive and --settle-seconds not negative, got "
                       f"{self.poll_seconds} and {self.settle_seconds}")

  def settings(self) -> dict:
    """What the running state depends on: a rerun on the same output must use the same."""
    settings = {"period_days": self.period_days, "min_count": self.min_count, "top_k": self.top_k}
    if self.user_column:  # (absent when off: outputs written before the option still resume)
      settings["user_column"] = True
    return settings

  def period_start(self, day: int) -> int:
    """First day of the period (fixed window from day 0) that holds `day`."""
    return day - day % self.period_days


def _file_path(metadata) -> str:
  """Watch's dedup key: each path is emitted once."""
  return metadata.path


def read_day_file(metadata):
  """A ready day file → its `LineBlock`s (and dead letters), all at the event time of its day.

  The file is read up to the size it was listed with. Two signs that it was still being written
  (a writer that paused longer than --settle-seconds) become dead letters, never silent losses: a
  last line without a newline (`cut`: it may be cut short, which a parser that pads missing
  trailing fields would not notice), and a size or time that changed since the listing
  (`changed`: the rest was not read).
  """
  path, day = metadata.path, beam_io.day_of(metadata.path)
  stamp = day_timestamp(day)
  last = None
  for item in beam_io.read_split(beam_io.Split(
      path, 0, -1 if beam_io.is_gzip(path) else metadata.size_in_bytes, 1, day, 0)):
    if last is not None:
      yield window.TimestampedValue(last, stamp)
    last = item
  for item in _end_of_file(metadata, last):
    yield window.TimestampedValue(item, stamp)


def _end_of_file(metadata, last):
  """The last item `read_day_file` read, its unterminated final line as a dead letter, and a
  dead letter if the file changed since it was listed."""
  line = 1
  if isinstance(last, beam_io.LineBlock):
    cut = last.data.rfind(b"\n") + 1
    line = last.first_line + last.data.count(b"\n")
    if cut:
      yield beam_io.LineBlock(last.path, last.day, last.first_line, last.data[:cut])
    if cut < len(last.data):
      yield beam_io.DeadLetter(last.path, line, "cut: the last line has no newline (a file "
                               "still being written?)", last.data[cut:].decode(errors="replace"))
      line += 1
  elif last is not None:
    yield last
  now = FileSystems.match([metadata.path])[0].metadata_list
  if now != [metadata]:
    size = now[0].size_in_bytes if now else "gone"
    yield beam_io.DeadLetter(metadata.path, line, f"changed: the file changed while it was read "
                             f"({metadata.size_in_bytes} bytes when listed, now {size}); lines "
                             "from here on were not read", "")


@dataclasses.dataclass
class RunningCounts:
  """Running-sum bucket counts per feature and the ids assigned so far (in index order)."""
  counts: List[tuple] = dataclasses.field(
      default_factory=lambda: [criteo_vocabulary.merge_counts([])
                               for _ in CATEGORICAL_FEATURES])
  assigned: List[np.ndarray] = dataclasses.field(
      default_factory=lambda: [np.zeros(0, np.int64) for _ in CATEGORICAL_FEATURES])

  def update(self, chunks, min_count: int, top_k: Optional[int]) -> CriteoVocabulary:
    """Adds one period's counts; appends newly frequent buckets; returns the snapshot."""
    for j, delta in enumerate(count_categories(chunks)):
      ids, totals = criteo_vocabulary.merge_counts([self.counts[j], delta])
      self.counts[j] = (ids, totals)
      room = None if top_k is None else max(top_k - len(self.assigned[j]), 0)
      fresh = (totals >= min_count) & ~np.isin(ids, self.assigned[j])
      order = np.lexsort((ids[fresh], -totals[fresh]))[:room]
      self.assigned[j] = np.concatenate([self.assigned[j], ids[fresh][order]])
    return self.snapshot()

  def snapshot(self) -> CriteoVocabulary:
    """The vocabulary so far: assigned ids with their running counts."""
    return CriteoVocabulary(tuple(self.assigned), tuple(
        totals[np.searchsorted(ids, assigned)]
        for (ids, totals), assigned in zip(self.counts, self.assigned)))


def load_state(job: StreamJob) -> Optional[dict]:
  """The running state an earlier run left in the output (None if there is none)."""
  path = os.path.join(job.output, STATE)
  if not FileSystems.exists(path):
    return None
  with FileSystems.open(path) as stream:
    state = pickle.loads(stream.read())
  if state["settings"] != job.settings():
    raise DprecError(f"{path}: the output of a streaming job with {state['settings']}, not "
                     f"{job.settings()}: rerun with the same options or give a new --output")
  return state


def _new_state(job: StreamJob) -> dict:
  """Running counts, merged statistics, manifest entries per period, and the input files used."""
  return {"settings": job.settings(), "counts": RunningCounts(),
          "stats": criteo_shards.ShardStats(), "entries": {}, "inputs": set()}


class RunningVocabulary(beam.DoFn):
  """Takes closed periods in event-time order; keeps running counts; writes each period.

  A period that closes after the same or a later period was written goes to dead letters: its
  day came late, or a file of it changed after it was read (writing it would move ids and counts
  under a trainer that already read the later period).
  """

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
    state = running.read() or load_state(self._job) or _new_state(self._job)
    for _, (first_day, parsed) in (item for item in periods if item[0] <= fired):
      if state["entries"] and first_day <= max(state["entries"]):
        yield self._write_late(state, first_day, parsed)
      else:
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
    stats = criteo_shards.write_shard(os.path.join(staging, "part-00000.tfrecord"), chunks, vocab)
    criteo_shards.count_dead_letters(stats, letters)
    stats.files = {first_day: [("part-00000.tfrecord", stats.rows_out)]}
    vocab.save(os.path.join(staging, "vocab"))
    beam_io.write_dead_letters(os.path.join(staging, "dead_letters.jsonl"), letters)
    final = os.path.join(job.output, name)
    if os.path.exists(final):  # written by a run that stopped before saving its state
      shutil.rmtree(final)
    os.rename(staging, final)
    state["entries"][first_day] = {
        "days": list(range(first_day, first_day + job.period_days)),
        "vocab_dir": f"{name}/vocab", "vocab_sizes": dict(zip(CATEGORICAL_FEATURES, vocab.sizes)),
        "dead_letters": stats.rows_in - stats.rows_out}
    self._commit(state, stats, parsed, vocab)
    return {"day": first_day, "rows": stats.rows_out, "dead_letters": len(letters),
            "vocab_sizes": list(vocab.sizes)}

  def _write_late(self, state: dict, first_day: int, parsed) -> dict:
    """Every row of a period that closed too late → `OUT/dead_letters/`, with the reason."""
    written = max(state["entries"])
    letters = [l for _, bad in parsed for l in bad]
    for chunk in (chunk for chunk, _ in parsed if chunk is not None):
      name = os.path.basename(chunk.path)
      reason = (f"changed: {name} changed after it was read into period day_{first_day}"
                if chunk.path in state["inputs"] else
                f"late: {name} arrived after period day_{written} was written")
      reason += "; periods are written once, in day order (the line is in the input file)"
      letters += [beam_io.DeadLetter(chunk.path, int(line), reason, "")
                  for line in chunk.line_numbers]
    letters.sort(key=lambda l: (l.path, l.line))
    name = f"late_day_{first_day}-{uuid.uuid4().hex[:8]}.jsonl"
    beam_io.write_dead_letters(os.path.join(self._job.output, criteo_shards.DEAD_LETTERS, name),
                               letters)
    stats = criteo_shards.count_dead_letters(criteo_shards.ShardStats(), letters)
    self._commit(state, stats, parsed, state["counts"].snapshot())
    return {"day": first_day, "rows": 0, "dead_letters": len(letters), "late": True}

  def _commit(self, state: dict, stats: criteo_shards.ShardStats, parsed, vocab: CriteoVocabulary):
    """Statistics, then the manifest (the trainer's commit point), then the running state."""
    job = self._job
    state["stats"].add(stats)
    state["inputs"].update(item.path for chunk, bad in parsed
                           for item in [chunk, *bad] if item is not None)
    summary = state["stats"].summary(vocab)
    summary["periods"] = len(state["entries"])
    beam_io.write_json(os.path.join(job.output, criteo_tfrecord.STATS), summary)
    newest = f"day_{max(state['entries'])}/vocab"
    manifest = criteo_shards.manifest(
        state["stats"], vocab, vocab_dir=newest, extra_entries=state["entries"],
        dataset_id=job.dataset_id, vocab_privacy=identity.public_vocab_privacy("running_counts"))
    if job.user_column:
      manifest[criteo_tfrecord.USER_COLUMN_KEY] = True
    beam_io.write_json(os.path.join(job.output, criteo_tfrecord.MANIFEST), manifest)
    beam_io.atomic_write(os.path.join(job.output, STATE), pickle.dumps(state))


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
            | "Parse" >> beam.Map(criteo_shards.parse_block, metrics=True,
                                  pad_short_lines=self._job.pad_short_lines,
                                  user_column=self._job.user_column)
            | "Period" >> beam.WindowInto(
                window.FixedWindows(seconds),
                allowed_lateness=Duration(seconds=ALLOWED_LATENESS_DAYS * DAY_SECONDS))
            | "Key" >> beam.Map(lambda parsed: ("criteo", parsed))
            | "GroupPeriod" >> beam.GroupByKey()
            | "PeriodOf" >> beam.ParDo(PeriodOf())
            | "Rewindow" >> beam.WindowInto(window.GlobalWindows())
            | "RunningVocabulary" >> beam.ParDo(RunningVocabulary(self._job)))


def build_pipeline(pipeline: beam.Pipeline, job: StreamJob):
  """The unbounded job: Watch(day files) → read at day event time → `StreamingCriteo`."""
  files = (pipeline
           | "Directory" >> beam.Create([job.input_dir])
           | "WatchDayFiles" >> watch.Watch(
               day_watch.DayFiles(job.stop_after_day, job.settle_seconds,
                                  min(job.poll_seconds, 0.2)),
               poll_interval=Duration.of(job.poll_seconds),
               termination=day_watch.IdleTimeout(job.idle_timeout),
               output_key_fn=_file_path)
           | "File" >> beam.Map(lambda pair: pair[1]))
  return files | "ReadDayFile" >> beam.FlatMap(read_day_file) | "Stream" >> StreamingCriteo(job)


def build_period_pipeline(pipeline: beam.Pipeline, job: StreamJob, files):
  """One bounded job over the files of closed periods: the same steps as `build_pipeline`."""
  return (pipeline
          | "Files" >> beam.Create(list(files))
          | "ReadDayFile" >> beam.FlatMap(read_day_file)
          | "Stream" >> StreamingCriteo(job))


def run(job: StreamJob, beam_args: Sequence[str] = ()) -> dict:
  """Watches until `--stop-after-day` is seen or `--idle-timeout` passes; returns stats.json.

  On the embedded runner (the default) this process watches and runs one bounded pipeline per
  batch of closed periods (`run_periods`); on other runners, one unbounded pipeline.
  """
  if job.idle_timeout is None and job.stop_after_day is None:
    print("watching without --idle-timeout or --stop-after-day: stop with Ctrl-C",
          file=sys.stderr)
  if not os.path.isdir(job.input_dir):
    raise DprecError(f"{job.input_dir}: not a directory (the streaming job watches a directory)")
  beam_io.makedirs(job.output)
  job = dataclasses.replace(job, dataset_id=job.dataset_id or identity.manifest_field(
      job.output, identity.DATASET_ID) or identity.new_dataset_id())
  options = beam_io.pipeline_options(beam_args)
  if beam_io.runner_name(options) in BATCH_ONLY_RUNNERS:
    raise DprecError(
        f"--streaming cannot run on {beam_io.runner_name(options)}, which runs bounded pipelines "
        f"only; the streaming job runs unbounded on {', '.join(STREAMING_RUNNERS)}, and on the "
        "default embedded runner as one bounded pipeline per closed period")
  if beam_io.is_embedded(options):
    counters = run_periods(job, beam_args)
  else:
    counters = run_unbounded(job, beam_args)
  stats_path = os.path.join(job.output, criteo_tfrecord.STATS)
  if not os.path.exists(stats_path):
    raise DprecError(f"{job.input_dir}: no day_N file arrived"
                     + ("" if job.idle_timeout is None else
                        f" within --idle-timeout {job.idle_timeout:g} s") + "; nothing written")
  summary = beam_io.read_json(stats_path)
  if counters is not None:  # Not every runner reports metrics.
    summary["beam_counters"] = counters
  summary["output"] = job.output
  return summary


def run_periods(job: StreamJob, beam_args: Sequence[str] = ()) -> dict:
  """Watches in this process; runs the files of each batch of closed periods as one bounded
  pipeline (`build_period_pipeline`); returns the Beam counters of all of them.

  A period closes once a day after it has arrived, or when watching stops. Files an earlier run
  on the same output used are skipped; a file that changes before its period closes is read once,
  as it is then; one that changes after it was read comes again and becomes dead letters.
  """
  state = load_state(job) or _new_state(job)
  newest = max((day for entry in state["entries"].values() for day in entry["days"]),
               default=None)
  pending = collections.defaultdict(dict)  # first day of an open period → {path: metadata}
  counters = collections.Counter()
  bar = progress_bar(desc=f"{job.output}: periods written", unit=" period")  # a line each
  for new, last in day_watch.watch_days(job.input_dir, job.poll_seconds, job.settle_seconds,
                                        job.idle_timeout, job.stop_after_day, state["inputs"]):
    for metadata in new:
      day = beam_io.day_of(metadata.path)
      pending[job.period_start(day)][metadata.path] = metadata
      newest = day if newest is None else max(newest, day)
    closed = sorted(first for first in pending if last or first + job.period_days <= newest)
    if closed:
      files = [metadata for first in closed for metadata in pending.pop(first).values()]
      counters.update(beam_io.run_pipeline(  # The embedded runners report metrics.
          beam_io.pipeline_options(beam_args, embedded=PERIOD_RUNNER),
          lambda p: build_period_pipeline(p, job, files),
          criteo_shards.METRICS_NAMESPACE))
      bar.update(len(closed))
      bar.set_postfix_str(f"newest from day {closed[-1]}; watching {job.input_dir}")
  bar.close()
  return dict(sorted(counters.items()))


def run_unbounded(job: StreamJob, beam_args: Sequence[str] = ()) -> dict:
  """The one unbounded pipeline (`build_pipeline`), for runners that stream; Beam counters."""
  if load_state(job) is not None:
    raise DprecError(f"{job.output}: holds an earlier streaming run's output; the unbounded "
                     "pipeline starts on an empty --output (the default runner continues one)")
  return beam_io.run_pipeline(beam_io.pipeline_options(beam_args, streaming=True),
                              lambda pipeline: build_pipeline(pipeline, job),
                              criteo_shards.METRICS_NAMESPACE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--period-days", type=int, default=StreamJob.period_days,
                      help="streaming period: days per window and per output (default "
                      "%(default)s)")
  parser.add_argument("--poll-seconds", type=float, default=StreamJob.poll_seconds,
                      help="how often to look for new day files (default %(default)g)")
  parser.add_argument("--idle-timeout", type=float, default=None,
                      help="stop after this many seconds without a new file (default: keep "
                      "watching)")
  parser.add_argument("--stop-after-day", type=int, default=None,
                      help="stop once the file of this day (or a later one) has arrived "
                      "(default: none)")
  parser.add_argument("--settle-seconds", type=float, default=StreamJob.settle_seconds,
                      help="take a day file once it has not changed for this long, so a file "
                      "written in place is not read half-written (default %(default)g)")


def job_from_args(args) -> StreamJob:
  if args.vocab_mode == "dp_top_k":
    raise DprecError("--streaming supports --vocab-mode min_count and top_k (ids are assigned "
                     "once and kept); DP top-k selection is a batch job")
  top_k = criteo_vocabulary.parse_top_k(args.top_k)
  if top_k is not None and not np.isscalar(top_k):
    raise DprecError("--streaming takes one --top-k capacity for all features")
  if len(args.input) != 1:
    raise DprecError("--streaming watches one directory: give exactly one --input")
  return StreamJob(input_dir=args.input[0], output=args.output, period_days=args.period_days,
                   min_count=args.min_count, top_k=top_k, poll_seconds=args.poll_seconds,
                   idle_timeout=args.idle_timeout, stop_after_day=args.stop_after_day,
                   settle_seconds=args.settle_seconds, pad_short_lines=args.pad_short_lines,
                   user_column=args.user_column)


def main(argv=None) -> int:
  """`python -m pipelines.criteo_stream`; the job classes are used from the imported module, not
  `__main__`, so Beam workers can unpickle them."""
  def arguments(parser):
    criteo.add_arguments(parser)
    add_arguments(parser.add_argument_group("streaming"))

  return beam_io.job_main("criteo_stream", __doc__, arguments,
                          lambda args: run(job_from_args(args), args.beam_args), argv)


if __name__ == "__main__":
  sys.exit(main())
