"""A run's user-level batches, written by one Beam job for data larger than memory.

The rows (`dprec preprocess criteo --user-column`'s TFRecords, each with its `user_id`) are
grouped by user, then sampled as the privacy unit asks (Chua et al., "Mind the Privacy Unit!
User-Level Differential Privacy for Language Model Fine-Tuning", arXiv:2406.14322):
  - `sampling="users"` (ULS, `dprec.training.user_sampling`): every user joins each of T steps
    independently with probability q = B/U (B the expected users a batch, U the users), and a
    user who joins brings a uniform subset of at most k of their rows, drawn afresh for each step
    joined; a step's rows are grouped by user (one unit each, users in increasing id, a unit's
    rows in input order), so the DP step clips a user's summed gradient as one;
  - `sampling="rows"` (ELS): at most k rows of every user are kept once (a uniform k-subset),
    then each kept row joins each step with probability q = B/N_k (N_k the rows kept, B the
    expected rows a batch): row-level Poisson batches, accounted for groups of k.
Three stages, each holding one bucket at a time, so memory grows with the buckets' size and not
with N: (1) each input file is read once and its rows are spilled by user bucket (user id mod the
number of user buckets); (2) a user bucket's spills are gathered (a GroupByKey on the user
bucket: only the spills' names go through Beam's shuffle), its rows grouped by user
(`user_sampling.UserRows`), the draws made from the stream the run's key derives for the bucket
(`USER_PURPOSE`: the draws depend on the key, the users in the bucket and their rows' places),
and the drawn rows spilled by bucket of steps; the bucket's rows bounded per user (at most k a
user: for ELS the rows it keeps, for ULS a draw of their own, `STATISTIC_PURPOSE`) are written
to `bounded-NNNNN.tfrecord`, the rows the run's one-off releases read (DP base rate, DP Platt
scaling: `dprec.workflows.ctr_users`), so one user moves them by at most k rows; (3) as the
row-level job (`pipelines.poisson_batches`): a bucket of steps' spills are gathered and written
one shard per step, then the manifest, last, whose plan (`batch_shards.user_plan_fields`) names
U, N, k and the sampling, whose `batch_shards.BOUNDED` lists the bounded files (N_k rows in
all), and which is written only if the rows hold the U users (and N_k kept rows) the run planned
for. The key never enters the pipeline (read on the worker from the run's secret file, as the
row-level job does).
"""
import dataclasses
import os
import shutil
import time
from typing import Optional, Sequence, Tuple

import apache_beam as beam
import numpy as np

from dprec import progress
from dprec.errors import DprecError
from dprec.privacy.noise_key import NoiseKey
from dprec.privacy_unit import USER_KEY
from dprec.training import batch_shards
from dprec.training import poisson
from dprec.training import user_sampling
from pipelines import beam_io
from pipelines import poisson_batches

METRICS_NAMESPACE = "dprec.user_batches"
PROGRESS = "out-of-core user batches"
SAMPLINGS = ("users", "rows")
USER_PURPOSE = "user batches"  # the draws of user bucket b: key.numpy_rng(this, sampling, b)
# ULS: the rows of user bucket b the releases read: key.numpy_rng(this, b)
STATISTIC_PURPOSE = "user statistic rows"
SPILL_DIR = poisson_batches.SPILL_DIR
MAX_BUCKETS = poisson_batches.MAX_BUCKETS
ROWS_PER_USER_BUCKET = 1 << 16  # rows a user bucket holds on average (the first stage's memory)


@dataclasses.dataclass(frozen=True)
class UserBatchJob(poisson_batches.StepBuckets):
  """What the job draws: the run, its key (by path, or a public seed for tests: not private), the
  input files (N rows of U users in them), the sampling ("users" or "rows"), k, B and T, and
  for "rows" the N_k rows kept (sum over users of min(rows, k))."""
  files: Tuple[str, ...]
  output: str
  run_id: str
  key_fingerprint: str
  num_rows: int
  num_users: int
  batch_size: int
  steps: int
  max_rows_per_user: int
  sampling: str = "users"
  bounded_rows: Optional[int] = None
  key_path: Optional[str] = None
  insecure_noise_seed: Optional[int] = None
  max_buckets: int = MAX_BUCKETS
  rows_per_user_bucket: int = ROWS_PER_USER_BUCKET
  max_batch_size = None  # no cap: a user-level batch is bounded by k rows a sampled user

  def __post_init__(self):
    if self.sampling not in SAMPLINGS:
      raise DprecError(f"user sampling must be one of {', '.join(SAMPLINGS)}, got "
                       f"{self.sampling!r}")
    if (self.sampling == "rows") != (self.bounded_rows is not None):
      raise DprecError("bounded_rows (the rows kept, at most k a user) goes with sampling='rows'")

  @property
  def user_buckets(self) -> int:
    return max(1, min(self.max_buckets, -(-self.num_rows // self.rows_per_user_bucket)))

  @property
  def sampling_rate(self) -> float:
    return self.batch_size / (self.num_users if self.sampling == "users" else self.bounded_rows)

  def plan(self) -> dict:
    """The manifest's plan (`batch_shards.user_plan_fields`)."""
    return batch_shards.user_plan_fields(self.sampling, self.num_rows, self.num_users,
                                         self.max_rows_per_user, self.batch_size, self.steps,
                                         self.bounded_rows)

  def noise_key(self) -> NoiseKey:
    return poisson_batches.read_key(self)


def _spill(job: UserBatchJob, stage: str, bucket: int, part: int, rows, **columns):
  """Writes a spill of `rows` under `stage`'s bucket; returns its path."""
  path = os.path.join(job.output, SPILL_DIR, f"{stage}-{bucket:05d}", f"part-{part:06d}.npz")
  beam_io.makedirs(os.path.dirname(path))
  poisson_batches.save_spill(path, rows, **columns)
  return path


def user_ids(records, path: str) -> np.ndarray:
  """The `user_id` of each serialized row; a row without one is refused naming the file."""
  import tensorflow as tf
  if not records:
    return np.zeros(0, np.int64)
  spec = {USER_KEY: tf.io.FixedLenFeature([1], tf.int64)}
  try:
    ids = tf.io.parse_example(tf.constant(records, tf.string), spec)[USER_KEY].numpy()[:, 0]
  except tf.errors.InvalidArgumentError:
    raise DprecError(f"{path}: rows without a {USER_KEY}: user-level batches read rows with "
                     "their user's id (`dprec preprocess criteo --user-column`)") from None
  if (ids < 0).any():
    raise DprecError(f"{path}: record {int(np.argmax(ids < 0))} has {USER_KEY} "
                     f"{ids[ids < 0][0]}: user ids are non-negative integers")
  return ids


class SpillByUser(beam.DoFn):
  """Reads one input file and spills its rows by user bucket; emits (user bucket, (file index,
  spill path)) for each bucket its rows fall in."""

  def __init__(self, job: UserBatchJob):
    self._job = job

  def process(self, item: Tuple[int, str]):
    file_index, path = item
    job = self._job
    with open(path, "rb") as stream:
      records = batch_shards.unframe(stream.read(), path)
    ids = user_ids(records, path)
    beam.metrics.Metrics.counter(METRICS_NAMESPACE, "rows_in").inc(len(records))
    bucket = ids % job.user_buckets
    for b in np.unique(bucket):
      chosen = np.flatnonzero(bucket == b)
      yield int(b), (file_index, _spill(job, "users", int(b), file_index,
                                        [records[i] for i in chosen], user=ids[chosen],
                                        file_index=np.full(len(chosen), file_index, np.int64),
                                        index=chosen))


class DrawUserSteps(beam.DoFn):
  """Gathers one user bucket's rows, groups them by user, draws the steps and rows (ULS or ELS,
  module docstring) and spills the drawn rows by bucket of steps; emits (step bucket, (user
  bucket, spill path or None)) for every step bucket, on the `COUNTS` output the bucket's
  (rows, users, rows kept at k a user), and on the `BOUNDED` output the manifest entry of its
  rows bounded per user (module docstring)."""

  COUNTS = "counts"
  BOUNDED = "bounded"

  def __init__(self, job: UserBatchJob):
    self._job = job
    self._key = None

  def setup(self):
    self._key = self._job.noise_key()

  def process(self, element):
    bucket, spills = element
    job = self._job
    spills = sorted(spills)
    parts = [poisson_batches.load_spill(spill) for _, spill in spills]
    columns = {name: np.concatenate([part[name] for part, _ in parts]) for name in parts[0][0]}
    # Where each row's bytes are: (its spill, its place there); only drawn rows are read.
    source = np.repeat(np.arange(len(parts)), [len(part["user"]) for part, _ in parts])
    place = np.concatenate([np.arange(len(part["user"])) for part, _ in parts])

    def read(rows):
      return [parts[source[i]][1]([place[i]])[0] for i in rows]
    users = user_sampling.UserRows.group(columns["user"])  # rows are in input order: stable
    k = job.max_rows_per_user
    yield beam.pvalue.TaggedOutput(self.COUNTS, np.array(
        [len(source), users.num_users, np.minimum(users.counts, k).sum()], np.int64))
    rng = self._key.numpy_rng(USER_PURPOSE, SAMPLINGS.index(job.sampling), bucket)
    if job.sampling == "users":
      sampled, step = poisson.steps_joined(rng, users.num_users, job.sampling_rate, job.steps)
      rows, unit = user_sampling.unit_rows(users, sampled, k, rng)
      step = step[unit]
      # The releases' rows: at most k of each user, drawn once, apart from the steps' draws.
      kept = user_sampling.rows_per_user(users, k, self._key.numpy_rng(STATISTIC_PURPOSE, bucket))
    else:
      kept = user_sampling.rows_per_user(users, k, rng)  # the releases read the rows trained on
      example, step = poisson.steps_joined(rng, len(kept), job.sampling_rate, job.steps)
      rows = kept[example]
    yield beam.pvalue.TaggedOutput(self.BOUNDED, batch_shards.write_records(
        job.output, f"bounded-{bucket:05d}.tfrecord", read(kept)))
    beam.metrics.Metrics.counter(METRICS_NAMESPACE, "rows_drawn").inc(len(rows))
    step_bucket = step // job.steps_per_bucket
    for b in range(job.buckets):
      chosen = rows[step_bucket == b]
      if not len(chosen):
        yield b, (bucket, None)
        continue
      user = {"user": columns["user"][chosen]} if job.sampling == "users" else {}
      yield b, (bucket, _spill(job, "steps", b, bucket, read(chosen), step=step[step_bucket == b],
                               file_index=columns["file_index"][chosen],
                               index=columns["index"][chosen], **user))
    for _, spill in spills:
      os.remove(spill)
      os.remove(spill + poisson_batches.DATA)


class Finish(poisson_batches.Finish):
  """The row-level job's `Finish`, once the rows are found to hold the U users (and for ELS the
  N_k rows kept) the run planned for: another count would mean another q than the plan's; the
  manifest lists the `bounded_files` entries (`DrawUserSteps.BOUNDED`)."""

  def process(self, entries, counts, bounded_files):
    job = self._job
    rows, users, bounded = (int(c) for c in counts)
    found = (rows, users, bounded if job.sampling == "rows" else None)
    if found != (job.num_rows, job.num_users, job.bounded_rows):
      raise DprecError(f"{job.output}: the inputs hold {rows} rows of {users} users ({bounded} "
                       f"at most {job.max_rows_per_user} a user), but the batches were planned "
                       f"for {job.num_rows} rows of {job.num_users} users: rerun the run's "
                       "planning on these rows")
    yield from super().process(entries, **{
        batch_shards.BOUNDED: sorted(bounded_files, key=lambda entry: entry["file"])})


def _sum(counts):
  counts = list(counts)
  return np.sum(counts, axis=0) if counts else np.zeros(3, np.int64)


def build_pipeline(pipeline: beam.Pipeline, job: UserBatchJob):
  """Adds the job to `pipeline`; returns the PCollection of its summary."""
  drawn = (pipeline
           | "Files" >> beam.Create(list(enumerate(job.files)))
           | "SpillByUser" >> beam.ParDo(SpillByUser(job))
           | "GroupByUserBucket" >> beam.GroupByKey()
           | "DrawUserSteps" >> beam.ParDo(DrawUserSteps(job)).with_outputs(
               DrawUserSteps.COUNTS, DrawUserSteps.BOUNDED, main="spills"))
  counts = drawn[DrawUserSteps.COUNTS] | "Count" >> beam.CombineGlobally(_sum)
  bounded = drawn[DrawUserSteps.BOUNDED] | "BoundedFiles" >> beam.combiners.ToList()
  return (drawn.spills
          | "GroupByStepBucket" >> beam.GroupByKey()
          | "WriteSteps" >> beam.ParDo(poisson_batches.WriteSteps(job))
          | "AllSteps" >> beam.combiners.ToList()
          | "Finish" >> beam.ParDo(Finish(job), beam.pvalue.AsSingleton(counts),
                                   beam.pvalue.AsSingleton(bounded)))


def run(job: UserBatchJob, beam_args: Sequence[str] = ()) -> dict:
  """Runs the job (replacing whatever an earlier, unfinished run of it left); returns a summary:
  rows read and written, the peak batch size, the runner and the wall-clock seconds."""
  options = poisson_batches.start(job, beam_args)
  unit = "users" if job.sampling == "users" else "rows (at most k a user)"
  progress.phase(PROGRESS, f"drawing {job.steps:,} batches of {job.batch_size:,} {unit} from "
                 f"{job.num_rows:,} rows of {job.num_users:,} users, on "
                 f"{beam_io.runner_name(options)}")
  started = time.monotonic()
  beam_io.run_pipeline(options, lambda pipeline: build_pipeline(pipeline, job), METRICS_NAMESPACE)
  seconds = time.monotonic() - started
  shutil.rmtree(os.path.join(job.output, SPILL_DIR), ignore_errors=True)
  manifest = beam_io.read_json(os.path.join(job.output, batch_shards.MANIFEST))
  progress.phase(PROGRESS, f"{job.num_rows:,} rows read, {manifest['rows_written']:,} written "
                 f"into {job.steps:,} batches, in {seconds:.0f} s")
  return {"batch_dir": job.output, "rows_read": job.num_rows,
          "rows_written": manifest["rows_written"], "peak_batch_size": manifest["peak_batch_size"],
          "steps": job.steps, "runner": beam_io.runner_name(options),
          "batch_job_seconds": seconds}
