"""`train ctr --out-of-core`: training on more rows than memory holds.

Memory grows with the batch and the model, never with the N training rows:
  1. the rows as TFRecords: a `dprec preprocess criteo` output directory is read where it is; TSV
     `day_N` files are preprocessed first (the Beam job of `pipelines.criteo`: vocabulary from
     exact counts of the training days, as the in-memory path builds it, then the rows) into
     the run's `out_of_core/records`; the last day is held out, read as a stream;
  2. the run's Poisson batches: `pipelines.poisson_batches` (Beam, on the embedded runner or on
     `--runner DaskRunner` and others) writes one shard per step into `out_of_core/batches`,
     drawn from the run's key, whose file the job's workers read; a resumed run reuses the
     shards when their manifest names this run, key and plan;
  3. training streams the shards in step order from the step the run resumes at
     (`dprec.training.batch_shards`); with parameter servers each worker reads its own step's
     shard, the chief sends it the shard's path and digest only;
  4. the releases that read every row are streaming passes: the DP base rate (a sum of labels),
     DP-FEST's DP top-k rows (each table's row counts, memory the size of the tables),
     DP Platt scaling (the model's logits on the same ≤ `ctr.CALIBRATION_ROWS` rows the in-memory
     path draws, in one pass: 8 bytes a drawn row), and the evaluation (Keras' streaming AUC and
     loss over the held-out day, parsed `EVAL_CHUNK_ROWS` lines at a time).
Without a run directory these files go to a temporary directory removed at the end.
"""
import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dprec.data import criteo_tfrecord
from dprec.errors import DprecError
from dprec.training import batch_shards

DIRECTORY = "out_of_core"
RECORDS = "records"
BATCHES = "batches"
READ_BATCH = 65536  # rows a streaming pass parses at once
EVAL_CHUNK_ROWS = 1 << 15  # TSV lines the held-out day is parsed in (the reader's default: 2^18)
TSV_BYTES_PER_ROW = 240  # Criteo TSV lines (and the synthetic ones) average about this
GZIP_RATIO = 4  # and compress about this much


@dataclasses.dataclass
class Data:
  """The training rows on disk (`records`: a preprocessed directory, its training days) and the
  held-out day as a stream; what `train ctr` needs of them without loading them."""
  records: str
  train_days: Tuple[int, ...]
  train_rows: int
  vocab_sizes: Tuple[int, ...]
  source: str
  eval_dataset: Callable[[int], tf.data.Dataset]  # batch size → (features, label) batches
  validation = None

  def train_dataset(self, batch_size: int = READ_BATCH, spec=None) -> tf.data.Dataset:
    """The training rows in input order, parsed with `spec` (default: every feature)."""
    files = criteo_tfrecord.day_files(self.records, self.train_days)
    spec = spec or criteo_tfrecord.feature_spec()
    return tf.data.TFRecordDataset(files).batch(batch_size).map(
        lambda rows: tf.io.parse_example(rows, spec))

  def label_sum(self) -> int:
    """The number of clicks among the training rows (one streaming pass over labels)."""
    spec = {"label": criteo_tfrecord.feature_spec()["label"]}
    return int(sum(int(np.sum(batch["label"]))
                   for batch in self.train_dataset(spec=spec).as_numpy_iterator()))

  def id_counts(self) -> List[np.ndarray]:
    """Each table's row counts over the training rows (one streaming pass; memory: the tables'
    sizes), for DP-FEST's top-k rows."""
    spec = {"cat_features": criteo_tfrecord.feature_spec()["cat_features"]}
    counts = [np.zeros(size, np.int64) for size in self.vocab_sizes]
    for batch in self.train_dataset(spec=spec).as_numpy_iterator():
      for table, column in zip(counts, batch["cat_features"].T):
        table += np.bincount(column, minlength=len(table))
    return counts

  def logits_and_labels(self, model, indices: Optional[np.ndarray]):
    """(logits, labels) of `model` on the training rows at sorted `indices` (all for None), in
    one streaming pass: memory for those two numbers a row, not for the rows."""
    logits, labels, offset = [], [], 0
    for batch in self.train_dataset().as_numpy_iterator():
      size = len(batch["label"])
      chosen = (slice(None) if indices is None else
                indices[(indices >= offset) & (indices < offset + size)] - offset)
      rows = {"cat_features": batch["cat_features"][chosen].astype(np.int32),
              "int_features": batch["int_features"][chosen]}
      if len(rows["cat_features"]):
        logits.append(np.asarray(model.predict_on_batch(rows))[:, 0])
        labels.append(batch["label"][chosen, 0].astype(np.int32))
      offset += size
    return np.concatenate(logits), np.concatenate(labels)

  def eval_label_stats(self) -> Tuple[int, float]:
    """(held-out rows, their click rate), in one streaming pass."""
    rows = clicks = 0
    for _, labels in self.eval_dataset(READ_BATCH).as_numpy_iterator():
      rows, clicks = rows + len(labels), clicks + int(np.sum(labels))
    return rows, clicks / max(rows, 1)


def estimated_train_rows(data: str) -> int:
  """The training rows of `data` without reading them: a preprocessed directory's manifest count
  (all days but the last), else the TSV training days' bytes over `TSV_BYTES_PER_ROW`."""
  if os.path.exists(os.path.join(data, criteo_tfrecord.MANIFEST)):
    return sum(entry["rows"] for entry in criteo_tfrecord.load_manifest(data)["days"][:-1])
  from dprec.data import criteo
  files = criteo.criteo_day_files(data)[:-1] if os.path.isdir(data) else []
  return sum(os.path.getsize(path) * (GZIP_RATIO if path.endswith(".gz") else 1)
             for path in files) // TSV_BYTES_PER_ROW


@contextlib.contextmanager
def workspace(run_dir: Optional[str]):
  """The directory of the records and batches: `run_dir/out_of_core`, or a temporary one
  (removed at the end) without a run directory."""
  if run_dir is not None:
    path = os.path.join(run_dir, DIRECTORY)
    os.makedirs(path, exist_ok=True)
    yield path
    return
  path = tempfile.mkdtemp(prefix="dprec-out-of-core-")
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


def prepare(data: str, base: str, min_count: int, beam_args: Sequence[str]) -> Data:
  """The rows of `data` (a preprocessed directory or TSV `day_N` files, then preprocessed into
  `base`), without loading them."""
  if not os.path.isdir(data):
    raise DprecError(f"{data}: --data must be a directory")
  if os.path.exists(os.path.join(data, criteo_tfrecord.MANIFEST)):
    manifest = criteo_tfrecord.load_manifest(data)
    days = [entry["day"] for entry in manifest["days"]]
    if len(days) < 2:
      raise DprecError(f"{data}/manifest.json: need at least 2 days (the last is held out)")
    return _data(data, manifest, days[:-1], "beam-manifest", lambda batch_size: _pairs(
        criteo_tfrecord.criteo_tfrecord_dataset(data, days[-1:], batch_size)))
  from dprec.data import criteo
  files = criteo.criteo_day_files(data)
  if len(files) < 2:
    raise DprecError(f"{data}: need at least 2 day_N files (the last is held out)")
  records = os.path.join(base, RECORDS)
  if not os.path.exists(os.path.join(records, criteo_tfrecord.MANIFEST)):
    from pipelines import criteo as criteo_job
    criteo_job.run(criteo_job.CriteoJob(
        inputs=tuple(files[:-1]), output=records,
        vocab=criteo_job.VocabConfig(min_count=min_count), max_bad_fraction=0.0,
        overwrite=True), beam_args)  # the run's own records: a failed attempt's are replaced
  manifest = criteo_tfrecord.load_manifest(records)
  vocab = criteo_tfrecord.load_vocabulary(records)
  return _data(records, manifest, [entry["day"] for entry in manifest["days"]], "criteo-tsv",
               lambda batch_size: criteo.criteo_dataset(files[-1:], vocab, batch_size,
                                                        chunk_rows=EVAL_CHUNK_ROWS))


def _data(records, manifest, days, source, eval_dataset) -> Data:
  rows = sum(entry["rows"] for entry in manifest["days"] if entry["day"] in days)
  if not rows:
    raise DprecError(f"{records}: the training days hold no rows")
  return Data(records, tuple(days), rows, tuple(criteo_tfrecord.vocab_sizes(manifest)), source,
              eval_dataset)


def _pairs(dataset: tf.data.Dataset) -> tf.data.Dataset:
  return dataset.map(lambda batch: ({"cat_features": batch["cat_features"],
                                     "int_features": batch["int_features"]}, batch["label"]))


def write_batches(data: Data, base: str, run, batch_size: int, steps: int,
                  beam_args: Sequence[str],
                  max_batch_size: Optional[int] = None) -> Tuple[str, dict, Optional[dict]]:
  """(the batch directory, its checked manifest, the batch job's summary or None when this
  run's batches were already there): the job runs unless a finished one of this run, key and
  plan (batches truncated to `max_batch_size`, if given) is found. The job's workers read the
  key from the run's secret file (`RunDirectory.key_file`)."""
  directory = os.path.join(base, BATCHES)
  plan = batch_shards.plan_fields(data.train_rows, batch_size, steps, max_batch_size)
  if os.path.exists(os.path.join(directory, batch_shards.MANIFEST)):
    return directory, batch_shards.read_manifest(directory, run.run_id, run.key, plan), None
  from pipelines import poisson_batches
  summary = poisson_batches.run(poisson_batches.BatchJob(
      files=tuple(criteo_tfrecord.day_files(data.records, data.train_days)), output=directory,
      run_id=run.run_id, key_fingerprint=batch_shards.key_fingerprint(run.key),
      num_examples=data.train_rows, batch_size=batch_size, steps=steps,
      key_path=run.directory.key_file(run.key) if run.key.private else None,
      insecure_noise_seed=None if run.key.private else run.key.insecure_seed,
      max_batch_size=max_batch_size), beam_args)
  return directory, batch_shards.read_manifest(directory, run.run_id, run.key, plan), summary


def fit(run, model, directory: str, manifest: dict, steps: int, resume, callbacks,
        coordinator=None) -> dict:
  """`run.fit` on the shards of steps `resume.step`..`steps` − 1, in order (with parameter
  servers, the worker running a step reads its shard; this chief reads none); a shard refused
  while training (altered since the start) ends it with that one line."""
  if steps <= resume.step:
    return {}
  batch_shards.check_shards(directory, manifest, resume.step)
  if coordinator is None:
    batches, read = batch_shards.batch_dataset(directory, manifest, resume.step, steps), None
  else:
    batches = (batch_shards.step_reference(directory, entry)
               for entry in manifest["steps"][resume.step:steps])
    read = batch_shards.read_step
  try:
    return run.trainer.fit(model, None, None, manifest["plan"]["batch_size"], True, steps,
                           resume, callbacks, coordinator, batches=batches, read=read)
  except tf.errors.OpError as error:
    refused = batch_shards.refusal(error)
    if refused is None:
      raise
    raise refused from None


def beam_args(runner: Optional[str], dask_workers: Optional[int],
              options: Sequence[str]) -> list:
  """The Beam arguments of `--runner`, `--dask-workers` and `--beam-option`s."""
  args = [] if runner is None else ["--runner", runner]
  args += [] if dask_workers is None else ["--dask-workers", str(dask_workers)]
  return args + [f"--{option.lstrip('-')}" for option in options]
