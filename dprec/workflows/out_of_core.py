"""`train ctr --out-of-core`: training on more rows than memory holds.

Memory grows with the batch and the model, never with the N training rows:
  1. the rows as TFRecords: a `dprec preprocess criteo` output directory is read where it is; TSV
     `day_N` files are preprocessed first (the Beam job `criteo`, launched through
     `dprec.beam_jobs`: vocabulary from exact counts of the training days, as the in-memory
     path builds it, then the rows) into the run's `out_of_core/records`; the last day is held
     out, read as a stream;
  2. the run's Poisson batches: the job `poisson_batches` (Beam, on the embedded runner or on
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
At the user level (the rows carry `user_id`: `dprec preprocess criteo --user-column`) step 2 is
the job `user_batches` (`write_user_batches`): rows grouped by user, then users sampled at
q = B/U with at most k rows each (ULS; the batches carry each row's unit), or at most k rows of
each user kept once and sampled as rows at q = B/N_k (ELS); U and N_k come from one streaming
pass over the user ids (`Data.user_counts`: memory two ints a user), public as N is, and the
releases of step 4 read the rows the job bounded to at most k a user (`Data.bounded`,
`dprec.workflows.ctr_users`) instead of every row.
Without a run directory these files go to a temporary directory removed at the end.
"""
import contextlib
import dataclasses
import glob
import json
import os
import shutil
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dprec import beam_jobs
from dprec.data import criteo_tfrecord
from dprec.data import ctr_data
from dprec.errors import DprecError, InputError
from dprec.privacy_unit import USER_KEY
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
  """The training rows on disk (`records`: a preprocessed directory, its training days, in
  `files`; `bounded` views the rows a user-level batch job kept) and the held-out day as a
  stream; what `train ctr` needs of them without loading them."""
  records: str
  train_days: Tuple[int, ...]
  files: Tuple[str, ...]
  train_rows: int
  vocab_sizes: Tuple[int, ...]
  source: str
  eval_dataset: Callable[[int], tf.data.Dataset]  # batch size → (features, label) batches
  validation = None

  def train_dataset(self, batch_size: int = READ_BATCH, spec=None) -> tf.data.Dataset:
    """The training rows in input order, parsed with `spec` (default: every feature)."""
    spec = spec or criteo_tfrecord.feature_spec()
    return tf.data.TFRecordDataset(list(self.files)).batch(batch_size).map(
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

  def user_counts(self) -> Tuple[np.ndarray, np.ndarray]:
    """(user ids, their row counts), sorted by id, over the training rows (one streaming pass;
    memory: two ints a user), for a user-level plan: U and the rows kept at k a user are public,
    as N is; rows without a user id are refused before anything is charged."""
    if not criteo_tfrecord.load_manifest(self.records).get(criteo_tfrecord.USER_COLUMN_KEY):
      raise DprecError(f"{self.records}: the rows carry no {USER_KEY}: --privacy-unit user "
                       "reads each row's user (`dprec preprocess criteo --user-column`, or TSV "
                       "days with the 41st column)")
    spec = {USER_KEY: criteo_tfrecord.feature_spec(user_column=True)[USER_KEY]}
    ids, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for batch in self.train_dataset(spec=spec).as_numpy_iterator():
      new_ids, new_counts = np.unique(batch[USER_KEY][:, 0], return_counts=True)
      ids, inverse = np.unique(np.concatenate([ids, new_ids]), return_inverse=True)
      counts = np.bincount(inverse, np.concatenate([counts, new_counts]),
                           minlength=len(ids)).astype(np.int64)
    return ids, counts

  def bounded(self, directory: str, manifest: dict) -> "Data":
    """These rows as the user-level batch job in `directory` (its checked `manifest`) bounded
    them: at most k rows of every user, drawn once by the run's key (`batch_shards.BOUNDED`),
    N_k in all; the rows the one-off releases read at the user level."""
    rows = sum(entry["rows"] for entry in manifest[batch_shards.BOUNDED])
    return dataclasses.replace(self, files=tuple(batch_shards.bounded_files(directory, manifest)),
                               train_rows=rows)

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


def prepare(data: str, base: str, min_count: int, beam_args: Sequence[str],
            user_ids: bool = False) -> Data:
  """The rows of `data` (a preprocessed directory or TSV `day_N` files, then preprocessed into
  `base`), without loading them. TSV days: with `user_ids` (user level) every training line
  must end with its user id, carried into the records; otherwise a user column is read where
  the days have one. A malformed training line is refused in one line naming its file, line and
  field (`ctr_data.with_fix`: what to do about it), before anything is charged."""
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
  if user_ids:
    ctr_data.require_user_column(files[:-1])
  records = os.path.join(base, RECORDS)
  if not os.path.exists(os.path.join(records, criteo_tfrecord.MANIFEST)):
    try:
      beam_jobs.launch("criteo", beam_args, inputs=tuple(files[:-1]), output=records,
                       vocab={"min_count": min_count}, max_bad_fraction=0.0,
                       user_column=user_ids or criteo.has_user_column(files[0]),
                       overwrite=True)  # the run's own records: a failed attempt's are replaced
    except DprecError:
      bad = first_bad_line(records)
      if bad is None:
        raise
      raise ctr_data.with_fix(bad, user_ids, files[:-1]) from None
  manifest = criteo_tfrecord.load_manifest(records)
  vocab = criteo_tfrecord.load_vocabulary(records)
  held_out_users = criteo.has_user_column(files[-1])
  return _data(records, manifest, [entry["day"] for entry in manifest["days"]], "criteo-tsv",
               lambda batch_size: criteo.criteo_dataset(files[-1:], vocab, batch_size,
                                                        chunk_rows=EVAL_CHUNK_ROWS,
                                                        user_column=held_out_users))


def first_bad_line(records: str) -> Optional[InputError]:
  """The first malformed line (by file, then line) a failed preprocessing job into `records`
  set aside (its dead letters, `stats.json`'s `dead_letter_files`), None if there is none."""
  try:
    with open(os.path.join(records, criteo_tfrecord.STATS), encoding="utf-8") as stream:
      pattern = json.load(stream)["dead_letter_files"]
  except (OSError, ValueError, KeyError):
    return None
  letters = []
  for path in glob.glob(pattern):
    with open(path, encoding="utf-8") as stream:
      letters += [json.loads(line) for line in stream if line.strip()]
  if not letters:
    return None
  first = min(letters, key=lambda letter: (letter["path"], letter["line"]))
  field, reason = "line", first["reason"]
  if reason.startswith("field ") and ": " in reason:
    field, reason = reason[len("field "):].split(": ", 1)
  return InputError(first["path"], first["line"], field, reason)


def _data(records, manifest, days, source, eval_dataset) -> Data:
  rows = sum(entry["rows"] for entry in manifest["days"] if entry["day"] in days)
  if not rows:
    raise DprecError(f"{records}: the training days hold no rows")
  return Data(records, tuple(days), tuple(criteo_tfrecord.day_files(records, days)), rows,
              tuple(criteo_tfrecord.vocab_sizes(manifest)), source, eval_dataset)


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
  summary = beam_jobs.launch(
      "poisson_batches", beam_args,
      files=data.files, output=directory,
      run_id=run.run_id, key_fingerprint=batch_shards.key_fingerprint(run.key),
      num_examples=data.train_rows, batch_size=batch_size, steps=steps,
      key_path=run.directory.key_file(run.key) if run.key.private else None,
      insecure_noise_seed=None if run.key.private else run.key.insecure_seed,
      max_batch_size=max_batch_size)
  return directory, batch_shards.read_manifest(directory, run.run_id, run.key, plan), summary


def write_user_batches(data: Data, base: str, run, users, sampling: str, batch_size: int,
                       steps: int, beam_args: Sequence[str]) -> Tuple[str, dict, Optional[dict]]:
  """`write_batches` at the user level: (the batch directory, its checked manifest, the job's
  summary or None when this run's batches were there). `users`: N, U, k and N_k of the rows
  (`dprec.workflows.ctr_users.UserPlan`); `sampling` "users" (ULS: `batch_size` users expected a
  step, at most k rows each; read with `batch_shards.parse_user_rows`) or "rows" (ELS: at most
  k rows a user kept once, `batch_size` rows expected a step); the rows kept at most k a user
  are there too (`Data.bounded`)."""
  directory = os.path.join(base, BATCHES)
  bounded = users.bounded_rows if sampling == "rows" else None
  plan = batch_shards.user_plan_fields(sampling, users.num_rows, users.num_users,
                                       users.max_rows_per_user, batch_size, steps, bounded)
  if os.path.exists(os.path.join(directory, batch_shards.MANIFEST)):
    return directory, batch_shards.read_manifest(directory, run.run_id, run.key, plan), None
  summary = beam_jobs.launch(
      "user_batches", beam_args,
      files=data.files, output=directory,
      run_id=run.run_id, key_fingerprint=batch_shards.key_fingerprint(run.key),
      num_rows=users.num_rows, num_users=users.num_users, batch_size=batch_size, steps=steps,
      max_rows_per_user=users.max_rows_per_user, sampling=sampling, bounded_rows=bounded,
      key_path=run.directory.key_file(run.key) if run.key.private else None,
      insecure_noise_seed=None if run.key.private else run.key.insecure_seed)
  return directory, batch_shards.read_manifest(directory, run.run_id, run.key, plan), summary


def summary_fields(directory: str, manifest: dict, job: Optional[dict]) -> dict:
  """The summary's out-of-core fields: the batch directory, the peak batch and the rows its
  manifest holds, and the batch job's summary (`job`: None when this run's were reused)."""
  return {"out_of_core": True, "batch_dir": directory,
          "peak_batch_size": manifest["peak_batch_size"], "rows_batched": manifest["rows_written"],
          "batch_job": job or "reused: this run's batches were on disk"}


def fit(run, model, directory: str, manifest: dict, steps: int, resume, callbacks,
        coordinator=None) -> dict:
  """`run.fit` on the shards of steps `resume.step`..`steps` − 1, in order (with parameter
  servers, the worker running a step reads its shard; this chief reads none); a shard refused
  while training (altered since the start) ends it with that one line. Batches of user-level
  sampling (the manifest's plan says so) carry each row's unit (`batch_shards.parse_user_rows`)
  and train on one device: parameter-server workers read row-level shards only."""
  if steps <= resume.step:
    return {}
  batch_shards.check_shards(directory, manifest, resume.step)
  units = manifest["plan"].get("user_sampling") == "users"
  if units and coordinator is not None:
    raise DprecError("user-level sampling trains on one device: run it without parameter "
                     "servers (their workers could split a user's rows)")
  if coordinator is None:
    parse = batch_shards.parse_user_rows if units else batch_shards.parse_rows
    batches = batch_shards.batch_dataset(directory, manifest, resume.step, steps, parse=parse)
    read = None
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
