"""Pieces shared by the dprec Beam jobs: options and entry points, line-block reading, dead
letters, atomic writes.

Input files are cut into byte-range splits at line boundaries (gzip files are one split each), so
a runner spreads a large file over its workers while every line keeps its 1-based line number for
dead letters. A split is read in blocks of whole lines that are parsed in one vectorised call.
"""
import argparse
import contextlib
import dataclasses
import difflib
import gzip
import json
import os
import re
import sys
import uuid
import zlib
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import DirectOptions
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.options.pipeline_options import StandardOptions

from dprec import atomic_io
from dprec import quiet
from dprec.cli_help import use_formatter
from dprec.errors import DprecError

# The embedded runner: the portable FnApiRunner with two worker processes. Naming it explicitly
# keeps Beam's DirectRunner from first trying to download the Prism runner binary.
EMBEDDED_RUNNER = "FnApiRunner"
EMBEDDED_WORKERS = 2
# Runner names that run in this process (the DirectRunner picks the FnApiRunner or the older
# bundle-based runner, none of which streams a polling source; see pipelines/criteo_stream.py).
EMBEDDED_RUNNERS = ("FnApiRunner", "DirectRunner", "SwitchingDirectRunner",
                    "BundleBasedDirectRunner")
# Beam's runner for a Dask cluster (`pip install apache-beam[dask]`), which Beam does not know by
# its short name. It runs bounded pipelines only and reports no metrics. Its `Create` packs 128
# elements into a Dask partition by default; ours are splits (up to 32 MB of lines) or files, so
# one each, or a few splits would all run on one worker.
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
RUNNER_NAMES = {"DaskRunner": DASK_RUNNER}
DASK_PARTITIONING = ("--dask_npartitions", "--dask_partition_size")
SPLIT_BYTES = 32 << 20
_READ_BYTES = 8 << 20
_DAY_NAME = re.compile(r"(?:^|[^0-9a-zA-Z])day_(\d+)(?:\.gz)?$")
_GZIP_MAGIC = b"\x1f\x8b"


def pipeline_options(beam_args: Sequence[str], streaming: bool = False,
                     embedded: Tuple[str, int] = ("multi_processing", EMBEDDED_WORKERS)
                     ) -> PipelineOptions:
  """All Beam options pass through; without `--runner`, the embedded runner, in the `embedded`
  (running mode, workers) unless `--direct_running_mode` or `--direct_num_workers` is given.
  `--runner DaskRunner` names Beam's Dask runner, one element of a `Create` per Dask partition
  unless `--dask_npartitions` or `--dask_partition_size` is given."""
  args, given = list(beam_args), " ".join(beam_args)
  runner = PipelineOptions(args).view_as(StandardOptions).runner
  runner = RUNNER_NAMES.get(runner, runner)
  if runner == DASK_RUNNER:
    _dask_options()  # Beam knows the --dask_* flags only once its Dask runner is imported
    if not any(flag in given for flag in DASK_PARTITIONING):
      args.append("--dask_partition_size=1")
  options = PipelineOptions(args)
  standard = options.view_as(StandardOptions)
  standard.runner = runner
  if streaming:
    standard.streaming = True
  if standard.runner is None:
    standard.runner = EMBEDDED_RUNNER
    if "--direct_num_workers" not in given and "--direct_running_mode" not in given:
      direct = options.view_as(DirectOptions)
      direct.direct_running_mode, direct.direct_num_workers = embedded
  return options


def runner_name(options: PipelineOptions) -> str:
  """The class name of the runner of `options` ("FnApiRunner", "DaskRunner", ...)."""
  runner = options.view_as(StandardOptions).runner
  name = runner if isinstance(runner, str) else type(runner).__name__
  return name.rsplit(".", 1)[-1]


def is_embedded(options: PipelineOptions) -> bool:
  """Whether `options` (from `pipeline_options`) run the pipeline on an embedded runner."""
  return runner_name(options) in EMBEDDED_RUNNERS


class LocalDaskOptions(PipelineOptions):
  """`--dask-workers N`: the local Dask cluster the job starts when `--runner DaskRunner` has no
  `--dask_client_address` (or `--dask_scheduler_file`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--dask-workers", "--dask_workers", dest="dask_workers", type=int,
                        default=EMBEDDED_WORKERS,
                        help="worker processes (one thread each) of the local Dask cluster")


def _dask_options() -> type:
  """Beam's `DaskOptions`, or a DprecError naming the install when Dask is missing."""
  try:
    from apache_beam.runners.dask.dask_runner import DaskOptions
    import distributed  # noqa: F401
  except ImportError as error:
    raise DprecError(f"--runner DaskRunner needs Dask: pip install 'apache-beam[dask]' ({error})"
                     ) from None
  return DaskOptions


@contextlib.contextmanager
def dask_cluster(options: PipelineOptions):
  """For `--runner DaskRunner` without a scheduler address: a `distributed.LocalCluster` of
  `--dask-workers` single-threaded worker processes for the duration of the block, its address
  set in `options`. Other runners, or a given address, pass through."""
  if runner_name(options) != "DaskRunner":
    yield
    return
  dask = options.view_as(_dask_options())
  if dask.address or dask.scheduler_file:
    yield
    return
  workers = options.view_as(LocalDaskOptions).dask_workers
  if workers < 1:
    raise DprecError(f"--dask-workers must be at least 1, got {workers}")
  from distributed import LocalCluster
  with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True) as cluster:
    dask.address = cluster.scheduler_address
    try:
      yield
    finally:
      dask.address = None


class DeadLetter(NamedTuple):
  """A line that could not be used, with where it was and why."""
  path: str
  line: int
  reason: str
  raw: str

  def to_json(self) -> str:
    return json.dumps(self._asdict(), sort_keys=True)


def reason_kind(reason: str) -> str:
  """A short, countable category of a dead-letter reason ("field I3: not an integer: 'x'" →
  "I3")."""
  head = reason.split(":", 1)[0]
  return head[len("field "):] if head.startswith("field ") else head


@dataclasses.dataclass(frozen=True)
class Split:
  """Lines `first_line`.. of `path` in bytes [start, end); end = -1 reads to the end (gzip)."""
  path: str
  start: int
  end: int
  first_line: int
  day: int
  index: int


@dataclasses.dataclass
class LineBlock:
  """Consecutive whole lines of one file, the first being `first_line` (1-based)."""
  path: str
  day: int
  first_line: int
  data: bytes


def day_of(path: str, default: int = 0) -> int:
  """The N of a `day_N` (or `day_N.gz`) file name, `default` for other names."""
  match = _DAY_NAME.search(os.path.basename(path))
  return int(match.group(1)) if match else default


def match_inputs(pattern_or_paths) -> List[str]:
  """Files of a glob, a directory (its `day_N` files, else all files) or a list; sorted by day."""
  patterns = [pattern_or_paths] if isinstance(pattern_or_paths, str) else list(pattern_or_paths)
  paths = []
  for pattern in patterns:
    if os.path.isdir(pattern):
      names = sorted(os.listdir(pattern))
      days = [n for n in names if _DAY_NAME.search(n)]
      paths += [os.path.join(pattern, n) for n in (days or names)
                if not os.path.isdir(os.path.join(pattern, n))]
      continue
    found = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
    if not found:
      raise DprecError(f"{pattern}: no input files match")
    paths += sorted(found)
  return sorted(paths, key=lambda p: (day_of(p), p))


def open_raw(path: str):
  """A binary stream of the file's bytes as stored (a gzip file not decompressed)."""
  return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def is_gzip(path: str) -> bool:
  with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as probe:
    return probe.read(2) == _GZIP_MAGIC


def plan_splits(paths: Sequence[str], split_bytes: int = SPLIT_BYTES) -> List[Split]:
  """Byte-range splits at line boundaries, with the line number each one starts at.

  Counting newlines is one sequential pass at memory speed, far cheaper than parsing; gzip files
  are not splittable and become one split each.
  """
  splits = []
  for path in paths:
    day = day_of(path)
    if is_gzip(path):
      splits.append(Split(path, 0, -1, 1, day, len(splits)))
      continue
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as stream:
      points, size = _line_starts(stream, split_bytes)
    for (start, line), (end, _) in zip(points, points[1:] + [(size, 0)]):
      if end > start or size == 0:
        splits.append(Split(path, start, end, line, day, len(splits)))
  return splits


def _line_starts(stream, every: int):
  """[(offset, line number)] of the first line and of a line start about every `every` bytes."""
  points, offset, line, next_cut = [(0, 1)], 0, 1, every
  while True:
    piece = stream.read(_READ_BYTES)
    if not piece:
      return points, offset
    search = max(next_cut - offset, 0)
    while search < len(piece):
      cut = piece.find(b"\n", search)
      if cut < 0:
        break
      points.append((offset + cut + 1, line + piece.count(b"\n", 0, cut + 1)))
      next_cut = offset + cut + 1 + every
      search = next_cut - offset
    line += piece.count(b"\n")
    offset += len(piece)


def read_split(split: Split) -> Iterator[object]:
  """`LineBlock`s of whole lines (about 8 MB each) of a split; an unreadable gzip tail becomes a
  `DeadLetter` at the first line that could not be read."""
  raw = FileSystems.open(split.path, compression_type=CompressionTypes.UNCOMPRESSED)
  stream = gzip.GzipFile(fileobj=raw, mode="rb") if split.end < 0 else raw
  remaining = None if split.end < 0 else split.end - split.start
  line, pieces, buffered = split.first_line, [], 0
  try:
    raw.seek(split.start)
    while True:
      size = _READ_BYTES if remaining is None else min(_READ_BYTES, remaining)
      try:
        # read1: one decompression step, so data decoded before a corrupt member is returned.
        data = (stream.read1(size) if split.end < 0 else stream.read(size)) if size else b""
      except (OSError, EOFError, zlib.error) as error:
        pending = b"".join(pieces)
        cut = pending.rfind(b"\n") + 1
        if cut:
          yield LineBlock(split.path, split.day, line, pending[:cut])
          line += pending.count(b"\n", 0, cut)
        # What is left is at most the start of line `line`, cut by the corruption.
        yield DeadLetter(split.path, line, f"gzip: bad gzip member, rest of file unreadable "
                         f"({error})", pending[cut:].decode(errors="replace"))
        return
      if remaining is not None:
        remaining -= len(data)
      pieces.append(data)
      buffered += len(data)
      if data and buffered < _READ_BYTES:
        continue
      pending = b"".join(pieces)
      cut = pending.rfind(b"\n") + 1 if data else len(pending)
      if cut:
        yield LineBlock(split.path, split.day, line, pending[:cut])
        line += pending.count(b"\n", 0, cut) + (not pending[:cut].endswith(b"\n"))
      pieces, buffered = [pending[cut:]], len(pending) - cut
      if not data:
        return
  finally:
    stream.close()
    raw.close()


def count_lines(paths: Sequence[str]) -> int:
  """Lines in all the files (a gzip file decompressed; a last line without a newline counts):
  an upper bound of the rows, one sequential pass."""
  total = 0
  for path in paths:
    raw = open_raw(path)
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip(path) else raw
    with raw, stream:
      last = b"\n"
      for piece in iter(lambda: stream.read(_READ_BYTES), b""):
        total += piece.count(b"\n")
        last = piece[-1:]
      total += last != b"\n"
  return total


def atomic_write(path: str, data: bytes) -> None:
  """Writes `data` to a temporary name beside `path`, then renames it into place."""
  temporary = f"{path}.tmp-{uuid.uuid4().hex}"
  with FileSystems.create(temporary) as stream:
    stream.write(data)
  if FileSystems.exists(path):
    FileSystems.delete([path])
  FileSystems.rename([temporary], [path])


def write_json(path: str, value) -> None:
  atomic_write(path, (atomic_io.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str):
  with FileSystems.open(path) as stream:
    return json.loads(stream.read().decode())


def makedirs(path: str) -> None:
  """Creates `path` if missing; safe when several workers create the same directory at once."""
  if FileSystems.exists(path):
    return
  try:
    FileSystems.mkdirs(path)
  except IOError:
    # Another worker process created it between the check and the call (Beam's local file
    # system raises "File exists"); anything else still fails.
    if not FileSystems.exists(path):
      raise


# Ctrl-C: what a batch job's output then is, and how a streaming job continues.
INTERRUPTED = ("interrupted (Ctrl-C): the job stopped before its manifest was written, so its "
               "output is incomplete; run it again, replacing that output")
STREAM_INTERRUPTED = ("interrupted (Ctrl-C): the periods written so far are complete; the same "
                      "command continues where it stopped")


def run_pipeline(options: PipelineOptions, build, namespace: str) -> Optional[dict]:
  """Builds (`build(pipeline)`), runs and waits (on a local Dask cluster for a DaskRunner without
  an address); returns the job's Beam counters by name, None if the runner reports no metrics.

  The jobs' counts come from their own outputs (`stats.json`), so they do not depend on metrics.
  """
  with quiet.held_stderr_if_quiet(), dask_cluster(options):
    pipeline = beam.Pipeline(options=options)
    build(pipeline)
    result = pipeline.run()
    try:
      result.wait_until_finish()
      return _counters(result, namespace)
    finally:
      client = getattr(result, "client", None)  # The DaskRunner's; Beam leaves it open.
      if client is not None:
        client.close()


def _counters(result, namespace: str) -> Optional[dict]:
  try:
    metrics = result.metrics()
  except NotImplementedError:  # The DaskRunner (Beam 2.77): "collecting metrics will come later!"
    return None
  counters = metrics.query(MetricsFilter().with_namespace(namespace))["counters"]
  totals = {}
  for counter in counters:
    value = counter.committed if counter.committed is not None else counter.attempted
    totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + value
  return dict(sorted(totals.items()))


def check_bad_fraction(dead: int, total: int, limit: float, unit: str, where: str) -> None:
  """Fails a job whose share of malformed `unit`s is above `limit` (its manifest was withheld)."""
  fraction = dead / total if total else 0.0
  if fraction > limit:
    raise DprecError(f"{dead} of {total} {unit} are malformed ({fraction:.2%} > "
                     f"--max-bad-fraction {limit:.2%}); no manifest written; see {where}")


def remove_stale(path: str) -> None:
  """Removes an old output file (or directory) so a failed run cannot leave it pointing at new
  data."""
  if FileSystems.exists(path):
    FileSystems.delete([path])


def write_dead_letters(path: str, letters: Sequence[DeadLetter]) -> Optional[str]:
  """Writes dead letters as JSON lines (atomically); returns the path, None if there are none."""
  if not letters:
    return None
  atomic_write(path, "".join(letter.to_json() + "\n" for letter in letters).encode())
  return path


BEAM_EPILOG = ("Any other option of Beam's PipelineOptions is passed to Beam (e.g. "
               "--direct_num_workers, --project, --temp_location); an option that neither this "
               "job nor Beam knows is an error. --runner DaskRunner runs a batch job on the Dask "
               "cluster at --dask_client_address HOST:PORT, or on a local one of --dask-workers "
               "N processes that the command starts and stops.")
STREAMING_EPILOG = (" With --streaming on the embedded runner: one bounded pipeline per closed "
                    "period, each on one in-process worker.")


class _BeamOption(argparse.Action):
  """An option of Beam's (listed in the job's help) handed to Beam's `PipelineOptions` as given:
  appended to `args.beam_args`."""

  def __call__(self, parser, namespace, values, option_string=None):
    given = list(getattr(namespace, "beam_args", None) or [])
    namespace.beam_args = given + [f"{self.option_strings[0]}={values}"]


class _NamedBeamOption(argparse.Action):
  """`--beam-option NAME=VALUE`: `--NAME=VALUE` appended to `args.beam_args`."""

  def __call__(self, parser, namespace, values, option_string=None):
    if "=" not in values:
      parser.error(f"--beam-option takes NAME=VALUE, got {values!r}")
    given = list(getattr(namespace, "beam_args", None) or [])
    namespace.beam_args = given + [f"--{values.lstrip('-')}"]


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
  """Lists Beam's runner choice and the local Dask cluster's size in the job's help."""
  group = parser.add_argument_group(
      "Beam runner", "passed to Beam's PipelineOptions, as every Beam option is")
  group.add_argument("--runner", action=_BeamOption, dest="beam_args", default=argparse.SUPPRESS,
                     metavar="NAME",
                     help="Beam runner: DaskRunner, DataflowRunner, FlinkRunner, SparkRunner, ... "
                     f"(default: the embedded runner, {EMBEDDED_WORKERS} worker processes)")
  group.add_argument("--beam-option", action=_NamedBeamOption, dest="beam_args",
                     default=argparse.SUPPRESS, metavar="NAME=VALUE",
                     help="another Beam pipeline option, as `train ctr --out-of-core` takes them "
                     "(e.g. dask_client_address=HOST:PORT; the same as --NAME=VALUE)")
  group.add_argument("--dask-workers", action=_BeamOption, dest="beam_args",
                     default=argparse.SUPPRESS, metavar="N",
                     help="with --runner DaskRunner and no --dask_client_address: worker "
                     f"processes of the local Dask cluster (default {EMBEDDED_WORKERS})")


def not_beam_options(args: Sequence[str]) -> List[str]:
  """The arguments of `args` that no Beam `PipelineOptions` class knows (with `--runner
  DaskRunner`, Beam's Dask options too), as Beam's own parser finds them."""
  if RUNNER_NAMES.get(PipelineOptions(list(args)).view_as(StandardOptions).runner) == DASK_RUNNER:
    _dask_options()
  parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
  classes = {str(cls): cls for cls in PipelineOptions.__subclasses__()}
  for cls in classes.values():
    cls._add_argparse_args(parser)
  return parser.parse_known_args(list(args))[1]


class BeamArgumentParser(argparse.ArgumentParser):
  """Keeps the options it does not know in `args.beam_args` if Beam's `PipelineOptions` know
  them, and rejects the others (a misspelt option must not be ignored)."""

  def parse_known_args(self, args=None, namespace=None):
    namespace, extras = super().parse_known_args(args, namespace)
    given = list(getattr(namespace, "beam_args", None) or [])  # --runner among them
    unknown = [word for word in not_beam_options(given + extras) if word not in given]
    if unknown:
      ours = [option for action in self._actions for option in action.option_strings
              if action.help is not argparse.SUPPRESS]  # not a deprecated name
      hints = [f"{close[0]} instead of {word}?" for word in unknown if word.startswith("-")
               for close in [difflib.get_close_matches(word.split("=")[0], ours, 1)] if close]
      self.error(f"unrecognized arguments: {' '.join(unknown)}: neither an option of this job "
                 "nor a Beam pipeline option" + (f" ({' '.join(hints)})" if hints else ""))
    namespace.beam_args = given + extras
    return namespace, []


def job_main(module: str, description: str, add_arguments, run, argv=None) -> int:
  """A `python -m pipelines.<module>` entry point: parses `argv` (default: the command line)
  with `add_arguments(parser)`, runs `run(args)` and prints its JSON summary (`run_main`)."""
  parser = BeamArgumentParser(prog=f"python -m pipelines.{module}", description=description,
                              epilog=BEAM_EPILOG)
  add_arguments(parser)
  add_runner_arguments(parser)
  parser.add_argument("--verbose", action="store_true",
                      help="show Beam's (and its workers') INFO logs, held back by default")
  use_formatter(parser)
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if not args.verbose:
    quiet.hold_library_logs()
  return run_main(lambda: run(args), STREAM_INTERRUPTED if module == "criteo_stream"
                  else INTERRUPTED)


def run_main(job, interrupted: str = INTERRUPTED) -> int:
  """Runs `job()` for a `python -m pipelines.X` entry point: JSON summary, one-line errors
  (Ctrl-C: `interrupted`)."""
  try:
    summary = job()
  except KeyboardInterrupt:
    print(f"error: {interrupted}", file=sys.stderr)
    return 130
  except DprecError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(atomic_io.dumps(summary, indent=2, sort_keys=True))
  return 0


def is_day_file(path: str) -> bool:
  """Whether the file is named `day_N` or `day_N.gz` (not e.g. a temporary `day_N.tmp`)."""
  return bool(_DAY_NAME.search(os.path.basename(path)))
