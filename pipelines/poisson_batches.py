"""A training run's Poisson batches, written by one Beam job for data larger than memory.

Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling" (arXiv:2411.04205) build
Poisson batches at Criteo scale this way: every example draws the steps it joins, then a group
by step. Here (1) each input file of TFRecord rows (`dprec preprocess criteo`'s) is read once:
its rows draw their steps, each independently with probability q = B/N at each of T steps, as
geometric gaps (`dprec.training.poisson.steps_joined`, O(q·T + 1) work a row) from the stream
the run's key derives for the file's index (`dprec.training.batch_shards.SAMPLING_PURPOSE`), so
the draws depend only on the key and the row's place (file, record), and the rows of a step go
to the spill file of its bucket of consecutive steps; (2) a bucket's spills are gathered (the
group by step: only their names go through Beam's shuffle, so the embedded runner never holds the
data) and written as one shard per step, rows in input order; (3) the manifest, last
(`dprec.training.batch_shards`). Exact Poisson by default: batch sizes vary, nothing is capped,
so the accountant's analysis of Poisson subsampling applies as it stands. With `max_batch_size`
B_max, a step's rows beyond the first B_max (input order) are dropped: truncated Poisson, whose
cost the run charges as δ (`dprec.privacy.truncation`).

The key never enters the pipeline: the job's transforms hold the path of the run's secret key
file (in the run directory, mode 0600) and read it on the worker (`setup`), so it is in no
pipeline option, no pickled transform and no log; the manifest holds only its fingerprint. The
workers must read the run directory (a shared file system on a cluster).
"""
import dataclasses
import os
import shutil
import time
import uuid
from typing import Optional, Sequence, Tuple

import apache_beam as beam
import numpy as np

from dprec import progress
from dprec.errors import DprecError
from dprec.privacy.noise_key import NoiseKey
from dprec.training import batch_shards
from dprec.training import poisson
from pipelines import beam_io

METRICS_NAMESPACE = "dprec.poisson_batches"
PROGRESS = "out-of-core batches"
SPILL_DIR = "spill"
DATA = ".data.npy"  # a spill's serialized rows, beside its columns
MAX_BUCKETS = 256  # spill files per input file; a bucket's steps are gathered in memory


class StepBuckets:
  """The steps of a batch job (`steps`, `max_buckets`) in buckets of consecutive steps."""

  @property
  def steps_per_bucket(self) -> int:
    return -(-self.steps // min(self.steps, self.max_buckets))

  @property
  def buckets(self) -> int:
    return -(-self.steps // self.steps_per_bucket)


@dataclasses.dataclass(frozen=True)
class BatchJob(StepBuckets):
  """What the job draws: the run, its key (by path, or a public seed for tests and experiments:
  not private), the input files in order and the plan (N rows in them, B, T)."""
  files: Tuple[str, ...]
  output: str
  run_id: str
  key_fingerprint: str
  num_examples: int
  batch_size: int
  steps: int
  key_path: Optional[str] = None
  insecure_noise_seed: Optional[int] = None
  max_buckets: int = MAX_BUCKETS
  max_batch_size: Optional[int] = None

  def plan(self) -> dict:
    """The manifest's plan (`batch_shards.plan_fields`)."""
    return batch_shards.plan_fields(self.num_examples, self.batch_size, self.steps,
                                    self.max_batch_size)

  def noise_key(self) -> NoiseKey:
    return read_key(self)


def _spill_path(job: BatchJob, bucket: int, file_index: int) -> str:
  return os.path.join(job.output, SPILL_DIR, f"bucket-{bucket:05d}", f"file-{file_index:06d}.npz")


class DrawSteps(beam.DoFn):
  """Reads one input file, draws the steps each of its rows joins and spills the rows by bucket;
  emits (bucket, (file index, spill path or None)) for every bucket."""

  def __init__(self, job: BatchJob):
    self._job = job
    self._key = None

  def setup(self):
    self._key = self._job.noise_key()

  def process(self, item: Tuple[int, str]):
    file_index, path = item
    job = self._job
    with open(path, "rb") as stream:
      records = batch_shards.unframe(stream.read(), path)
    rng = self._key.numpy_rng(batch_shards.SAMPLING_PURPOSE, file_index)
    example, step = poisson.steps_joined(rng, len(records), job.batch_size / job.num_examples,
                                         job.steps)
    beam.metrics.Metrics.counter(METRICS_NAMESPACE, "rows_in").inc(len(records))
    bucket = step // job.steps_per_bucket
    for b in range(job.buckets):
      chosen = bucket == b
      if not chosen.any():
        yield b, (file_index, None)
        continue
      rows = [records[i] for i in example[chosen]]
      spill = _spill_path(job, b, file_index)
      beam_io.makedirs(os.path.dirname(spill))
      save_spill(spill, rows, step=step[chosen], index=example[chosen],
                 file_index=np.full(len(rows), file_index, np.int64))
      yield b, (file_index, spill)


def save_spill(path: str, rows, **columns) -> None:
  """Writes rows (serialized records) to `path` + `DATA` and their per-row int `columns`
  (`step`, `file_index`, `index` and, for user batches, `user`) to the .npz `path`, atomically."""
  temporary = f"{path}.tmp-{uuid.uuid4().hex}.npz"
  np.save(temporary + DATA, np.frombuffer(b"".join(rows), np.uint8))
  np.savez(temporary, lengths=np.array([len(r) for r in rows], np.int64), **columns)
  os.replace(temporary + DATA, path + DATA)
  os.replace(temporary, path)  # last: a spill whose columns are there has its rows


def load_spill(path: str):
  """(columns, read) of a spill `save_spill` wrote: its per-row columns, and `read(indices)` the
  serialized rows at those indices, read from a memory map (only their bytes are read)."""
  with np.load(path) as part:
    columns = {name: part[name] for name in part.files}
  ends = np.cumsum(columns["lengths"])
  starts = ends - columns.pop("lengths")
  data = np.load(path + DATA, mmap_mode="r")
  return columns, lambda indices: [data[starts[i]:ends[i]].tobytes() for i in indices]


class WriteSteps(beam.DoFn):
  """Gathers one bucket's spills and writes a shard per step of the bucket (rows in input order:
  by file, then record; with a `user` column, by user first: each user's rows contiguous, users
  in increasing id); emits the shards' manifest entries. `job`: this job's or a
  `pipelines.user_batches` job's (`output`, `steps`, `steps_per_bucket`, `max_batch_size`)."""

  def __init__(self, job):
    self._job = job

  def process(self, element):
    bucket, spills = element
    job = self._job
    records, columns = [], []
    for _, spill in sorted(s for s in spills if s[1] is not None):
      part, read = load_spill(spill)
      records += read(range(len(part["step"])))
      columns.append(part)
    if columns:
      joined = {name: np.concatenate([part[name] for part in columns]) for name in columns[0]}
      step = joined["step"]
      by_user = (joined["user"],) if "user" in joined else ()
      order = np.lexsort((joined["index"], joined["file_index"], *by_user, step))
    else:
      step = order = np.zeros(0, np.int64)
    first = bucket * job.steps_per_bucket
    bounds = np.searchsorted(step[order], np.arange(first, first + job.steps_per_bucket + 1))
    for offset in range(min(job.steps_per_bucket, job.steps - first)):
      rows = [records[i] for i in order[bounds[offset]:bounds[offset + 1]]]
      if job.max_batch_size is not None and len(rows) > job.max_batch_size:
        beam.metrics.Metrics.counter(METRICS_NAMESPACE, "rows_truncated").inc(
            len(rows) - job.max_batch_size)
        rows = rows[:job.max_batch_size]
      beam.metrics.Metrics.counter(METRICS_NAMESPACE, "rows_out").inc(len(rows))
      yield batch_shards.write_shard(job.output, first + offset, rows)


class Finish(beam.DoFn):
  """Writes the manifest (last: its presence says the job finished) and removes the spills.
  `job`: this job's or a `pipelines.user_batches` job's (with `plan()`, and the manifest's
  `fields` of its own)."""

  def __init__(self, job):
    self._job = job

  def process(self, entries, **fields):
    job = self._job
    entries = sorted(entries, key=lambda entry: entry["step"])
    if [entry["step"] for entry in entries] != list(range(job.steps)):
      raise DprecError(f"{job.output}: the job wrote {len(entries)} of {job.steps} shards")
    manifest = batch_shards.manifest_of(job.run_id, job.key_fingerprint,
                                        job.key_path is not None, job.plan(), job.files, entries)
    manifest.update(fields)
    beam_io.write_json(os.path.join(job.output, batch_shards.MANIFEST), manifest)
    shutil.rmtree(os.path.join(job.output, SPILL_DIR), ignore_errors=True)
    yield {key: manifest[key] for key in ("rows_written", "peak_batch_size")}


def build_pipeline(pipeline: beam.Pipeline, job: BatchJob):
  """Adds the job to `pipeline`; returns the PCollection of its summary."""
  return (pipeline
          | "Files" >> beam.Create(list(enumerate(job.files)))
          | "DrawSteps" >> beam.ParDo(DrawSteps(job))
          | "GroupByBucket" >> beam.GroupByKey()
          | "WriteSteps" >> beam.ParDo(WriteSteps(job))
          | "AllSteps" >> beam.combiners.ToList()
          | "Finish" >> beam.ParDo(Finish(job)))


def read_key(job) -> NoiseKey:
  """A batch job's run key, read on the worker from the secret file `job.key_path` (or from the
  public seed `job.insecure_noise_seed`)."""
  if job.key_path is None:
    return NoiseKey.insecure(job.insecure_noise_seed)
  with open(job.key_path, "rb") as stream:
    return NoiseKey(stream.read())


def start(job, beam_args: Sequence[str]):
  """Checks a batch job's key and input, clears what an unfinished earlier run of it left in
  `job.output` (its manifest and spills) and returns the Beam pipeline options."""
  if (job.key_path is None) == (job.insecure_noise_seed is None):
    raise DprecError("the batch job needs the run's key file or (not private) a public seed")
  if not job.files:
    raise DprecError("the batch job has no input files")
  beam_io.makedirs(job.output)
  for stale in (batch_shards.MANIFEST, SPILL_DIR):
    beam_io.remove_stale(os.path.join(job.output, stale))
  return beam_io.pipeline_options(beam_args)


def run(job: BatchJob, beam_args: Sequence[str] = ()) -> dict:
  """Runs the job (replacing whatever an earlier, unfinished run of it left); returns a summary:
  rows read and written, the peak batch size, the runner and rows read a second (wall clock)."""
  options = start(job, beam_args)
  progress.phase(PROGRESS, f"drawing {job.steps:,} Poisson batches from {job.num_examples:,} "
                 f"rows in {len(job.files)} files, on {beam_io.runner_name(options)}")
  started = time.monotonic()
  beam_io.run_pipeline(options, lambda pipeline: build_pipeline(pipeline, job), METRICS_NAMESPACE)
  seconds = time.monotonic() - started
  manifest = beam_io.read_json(os.path.join(job.output, batch_shards.MANIFEST))
  progress.phase(PROGRESS, f"{job.num_examples:,} rows read, {manifest['rows_written']:,} written "
                 f"into {job.steps:,} batches, in {seconds:.0f} s")
  return {"batch_dir": job.output, "rows_read": job.num_examples,
          "rows_written": manifest["rows_written"], "peak_batch_size": manifest["peak_batch_size"],
          "steps": job.steps, "runner": beam_io.runner_name(options),
          "batch_job_seconds": seconds, "batch_job_rows_per_second": job.num_examples / seconds}
