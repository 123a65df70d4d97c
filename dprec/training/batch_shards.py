"""A run's Poisson batches on disk, one TFRecord shard per step, and the reader that streams them
into training in step order.

`pipelines.poisson_batches` writes them (each example draws the steps it joins from the run's
key, then a group by step: Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling",
arXiv:2411.04205). A batch directory holds `step-NNNNNNNN.tfrecord` files, the rows of step t
in input order (the `tf.train.Example`s of `dprec.data.criteo_tfrecord`, one per row; a step
nobody joined has an empty file), and, written last, `batches.json`: the run id, a fingerprint
of the run's key (an HMAC of a fixed label under it: it tells keys apart and reveals nothing
about them), the plan (N, B, q = B/N, T), the input files and, per step, its row count, size,
SHA-256 and the `records_fingerprint` of its rows. The readers refuse, in one line naming the
file, a directory without that manifest (the job did not finish), one of another run, key or
plan, and a missing, truncated or altered shard. One device reads with `batch_dataset`; with
parameter servers each worker reads its own step's shard with `read_step`, inside the scheduled
step, from the `step_reference` the chief sends. Either holds one step's batch (and the
prefetched next ones) at a time, so memory grows with B, not with N. User-level batches
(`pipelines.user_batches`) are the same files with a plan of their own (`user_plan_fields`);
those of user-level sampling are read with `parse_user_rows`, which gives each row its unit.
Their manifest also lists (`BOUNDED`) the files of the rows kept at most k a user that the
run's one-off releases read (`bounded_files`).
"""
import hashlib
import json
import os
import struct
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from dprec.data import criteo_tfrecord
from dprec.errors import DprecError
from dprec.privacy_unit import UNIT_KEY
from dprec.privacy_unit import USER_KEY

FORMAT = "dprec-poisson-batches-v2"
MANIFEST = "batches.json"
FINGERPRINT_LABEL = "dprec poisson batches key fingerprint"
SAMPLING_PURPOSE = "poisson batches"  # the draws of input file f: key.numpy_rng(this, f)
PREFETCH = 2  # batches read ahead of training
BOUNDED = "bounded_files"  # user-level manifests: the files of the rows kept at most k a user


def shard_name(step: int) -> str:
  return f"step-{step:08d}.tfrecord"


def key_fingerprint(noise_key) -> str:
  """A public name of the run's key: HMAC-SHA256 of a fixed label under it (a PRF value, so it
  says nothing about the key), for telling one run's batches from another's."""
  return noise_key.derive(FINGERPRINT_LABEL).hex()


def plan_fields(num_examples: int, batch_size: int, steps: int,
                max_batch_size: Optional[int] = None) -> dict:
  """The plan a batch directory was drawn for (all public); `max_batch_size`: the cap B_max a
  step's batch is truncated to (`dprec.privacy.truncation`), absent for exact Poisson."""
  cap = {} if max_batch_size is None else {"max_batch_size": int(max_batch_size)}
  return {"num_examples": int(num_examples), "batch_size": int(batch_size),
          "sampling_rate": batch_size / num_examples, "steps": int(steps), **cap}


def user_plan_fields(sampling: str, num_rows: int, num_users: int, max_rows_per_user: int,
                     batch_size: int, steps: int, bounded_rows: Optional[int] = None) -> dict:
  """The plan of user-level batches (all public): `sampling` "users" (ULS: B users expected a
  step, q = B/U) or "rows" (ELS: at most k rows a user kept, N_k = `bounded_rows` of them, B
  rows expected a step, q = B/N_k), N, U, k and T."""
  population = num_users if sampling == "users" else bounded_rows
  bounded = {} if bounded_rows is None else {"bounded_rows": int(bounded_rows)}
  return {"privacy_unit": "user", "user_sampling": sampling, "num_rows": int(num_rows),
          "num_users": int(num_users), "max_rows_per_user": int(max_rows_per_user),
          "batch_size": int(batch_size), "sampling_rate": batch_size / population,
          "steps": int(steps), **bounded}


def manifest_of(run_id: str, noise_key_fingerprint: str, private: bool, plan: dict,
                inputs: Sequence[str], entries: Sequence[dict]) -> dict:
  """The manifest of the shards `entries` (`write_shard`'s, in step order), to be written last
  as `MANIFEST`: its presence says the batches are complete."""
  rows = [entry["rows"] for entry in entries]
  return {"format": FORMAT, "run_id": run_id, "key_fingerprint": noise_key_fingerprint,
          "private": private, "plan": plan, "inputs": list(inputs),
          "rows_written": int(sum(rows)), "peak_batch_size": int(max(rows, default=0)),
          "steps": list(entries)}


def unframe(data: bytes, path: str) -> List[bytes]:
  """The records of TFRecord bytes (their integrity is the manifest's digest's business)."""
  records, offset = [], 0
  while offset < len(data):
    if offset + 12 > len(data):
      raise DprecError(f"{path}: truncated record header at byte {offset}")
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 12 + length
    if end + 4 > len(data):
      raise DprecError(f"{path}: truncated record at byte {offset}")
    records.append(data[offset + 12:end])
    offset = end + 4
  return records


def records_fingerprint(records) -> tf.Tensor:
  """A shard's digest a worker computes in its graph (TensorFlow has no SHA-256 op): FarmHash
  Fingerprint64 (`tf.fingerprint`) of the concatenated fingerprints of its records, in order;
  uint8[8]. It tells another run's or an altered shard from the manifest's; it is no MAC."""
  return tf.fingerprint(tf.reshape(tf.fingerprint(records), [1, -1]))[0]


def write_shard(directory: str, step: int, records: Sequence[bytes]) -> dict:
  """Writes step `step`'s records (atomically: a temporary name, then a rename); returns its
  manifest entry."""
  return {"step": int(step), **write_records(directory, shard_name(step), records)}


def write_records(directory: str, name: str, records: Sequence[bytes]) -> dict:
  """Writes `records` as the TFRecord file `name` of `directory` (atomically); returns its
  manifest entry: the file, its rows, bytes, SHA-256 and `records_fingerprint`."""
  path = os.path.join(directory, name)
  criteo_tfrecord.write_tfrecord(path, records)
  with tf.io.gfile.GFile(path, "rb") as stream:
    data = stream.read()
  fingerprint = records_fingerprint(tf.constant(list(records), tf.string))
  return {"file": name, "rows": len(records), "bytes": len(data),
          "sha256": hashlib.sha256(data).hexdigest(),
          "fingerprint": fingerprint.numpy().tobytes().hex()}


def read_manifest(directory: str, run_id: str, noise_key, plan: dict) -> dict:
  """The batch directory's manifest, checked against this run (its id and key) and `plan`
  (`plan_fields`); a one-line `DprecError` naming the file otherwise."""
  path = os.path.join(directory, MANIFEST)
  if not tf.io.gfile.exists(path):
    raise DprecError(f"{path}: no manifest: the batch job did not finish (rerun it)")
  try:
    with tf.io.gfile.GFile(path, "r") as stream:
      manifest = json.loads(stream.read())
  except ValueError as error:
    raise DprecError(f"{path}: not a readable batch manifest ({error})") from None
  if manifest.get("format") != FORMAT:
    raise DprecError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
  if manifest.get("run_id") != run_id:
    raise DprecError(f"{path}: batches of run {manifest.get('run_id')}, not of this run "
                     f"{run_id}")
  if manifest.get("key_fingerprint") != key_fingerprint(noise_key):
    raise DprecError(f"{path}: batches drawn with another key than this run's")
  if manifest.get("plan") != plan:
    raise DprecError(f"{path}: batches drawn for the plan {manifest.get('plan')}, not {plan}")
  if [entry["step"] for entry in manifest["steps"]] != list(range(plan["steps"])):
    raise DprecError(f"{path}: the manifest does not list steps 0..{plan['steps'] - 1}")
  return manifest


def read_shard(directory: str, entry: dict) -> List[bytes]:
  """The records of one step's shard, after checking it is the one the manifest lists."""
  path = os.path.join(directory, entry["file"])
  try:
    with tf.io.gfile.GFile(path, "rb") as stream:
      data = stream.read()
  except tf.errors.NotFoundError:
    raise DprecError(f"{path}: missing: the shard of step {entry['step']}") from None
  if len(data) != entry["bytes"]:
    raise DprecError(f"{path}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated "
                     "or replaced)")
  if hashlib.sha256(data).hexdigest() != entry["sha256"]:
    raise DprecError(f"{path}: its SHA-256 differs from the manifest's (a shard of another run, "
                     "or corrupted)")
  records = unframe(data, path)
  if len(records) != entry["rows"]:
    raise DprecError(f"{path}: {len(records)} rows, the manifest says {entry['rows']}")
  return records


def check_shards(directory: str, manifest: dict, start: int = 0) -> None:
  """Refuses, before training starts, a missing or truncated shard of steps `start`.. (a stat
  each; the content is checked when the step is read)."""
  for entry in manifest["steps"][start:]:
    _check_file(directory, entry, f"the shard of step {entry['step']}")


def bounded_files(directory: str, manifest: dict) -> List[str]:
  """The paths of the user-level batches' bounded rows (`BOUNDED`: at most k rows of every
  user, drawn once by the run's key; the rows the one-off releases read), each refused in one
  line if missing or of another size than the manifest's."""
  if BOUNDED not in manifest:
    raise DprecError(f"{os.path.join(directory, MANIFEST)}: no {BOUNDED}: not user-level "
                     "batches (rerun the batch job)")
  for entry in manifest[BOUNDED]:
    _check_file(directory, entry, "a file of the rows bounded per user")
  return [os.path.join(directory, entry["file"]) for entry in manifest[BOUNDED]]


def _check_file(directory: str, entry: dict, what: str) -> None:
  path = os.path.join(directory, entry["file"])
  if not tf.io.gfile.exists(path):
    raise DprecError(f"{path}: missing: {what}")
  size = tf.io.gfile.stat(path).length
  if size != entry["bytes"]:
    raise DprecError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or "
                     "replaced)")


REFUSAL_MARKER = f"{DprecError.__module__}.{DprecError.__name__}: "


def refusal(error: Exception) -> Optional[DprecError]:
  """The `DprecError` a shard check raised inside `tf.data` or a worker's `read_step` (which TF
  wraps in its error: "assertion failed: [MARKER message]"), as one line again; None if `error`
  is not one."""
  for line in str(error).splitlines():
    start = line.find(REFUSAL_MARKER)
    if start >= 0:
      message = line[start + len(REFUSAL_MARKER):]
      return DprecError(message[:-1] if line[:start].endswith("[") else message)
  return None


def parse_rows(serialized):
  """Serialized rows → (`{"cat_features", "int_features"}`, label), as the in-memory path has
  them (`dprec.data.criteo_tfrecord.criteo_tfrecord_dataset`'s dtypes)."""
  row = tf.io.parse_example(serialized, criteo_tfrecord.feature_spec())
  return ({"cat_features": tf.cast(row["cat_features"], tf.int32),
           "int_features": row["int_features"]}, tf.cast(row["label"][:, 0], tf.int32))


def parse_user_rows(serialized):
  """Serialized rows of a user-level (ULS) batch → (features with `UNIT_KEY`, label): `parse_rows`
  and each row's unit index, counted from the rows' `user_id` (a batch holds each sampled user's
  rows contiguously, users in increasing id: `dprec.training.user_sampling`'s format)."""
  row = tf.io.parse_example(serialized, criteo_tfrecord.feature_spec(user_column=True))
  user = row[USER_KEY][:, 0]
  unit = tf.cumsum(tf.cast(tf.not_equal(user[1:], user[:-1]), tf.int32))
  return ({"cat_features": tf.cast(row["cat_features"], tf.int32),
           "int_features": row["int_features"],
           UNIT_KEY: tf.concat([tf.zeros(tf.minimum(tf.size(user), 1), tf.int32), unit], 0)},
          tf.cast(row["label"][:, 0], tf.int32))


def batch_dataset(directory: str, manifest: dict, start: int = 0,
                  stop: Optional[int] = None, parse=parse_rows) -> tf.data.Dataset:
  """Steps `start`..`stop` − 1 (default: to the end) of a checked batch directory
  (`read_manifest`) as a `tf.data.Dataset` of batches in step order, each `parse(serialized
  records)` (default: `parse_rows`); each shard is checked when it is read."""
  entries = manifest["steps"][start:stop]

  def generate():
    for entry in entries:
      yield np.asarray(read_shard(directory, entry), dtype=object).reshape(-1)

  return (tf.data.Dataset.from_generator(generate,
                                         output_signature=tf.TensorSpec([None], tf.string))
          .map(parse).prefetch(PREFETCH))


def step_reference(directory: str, entry: dict):
  """What the chief sends a worker for a step instead of its batch: (the shard's path, its rows,
  its fingerprint as uint8[8]), for `read_step`."""
  return (tf.constant(os.path.join(directory, entry["file"])),
          tf.constant(entry["rows"], tf.int64),
          tf.constant(np.frombuffer(bytes.fromhex(entry["fingerprint"]), np.uint8)))


def read_step(reference):
  """A step's (features, label) batch read where this runs (a worker's graph) from its
  `step_reference`: the shard must exist and hold the manifest's rows with its fingerprint
  (a record failing TFRecord's CRC is dropped, so a truncated or corrupted shard fails the
  count); otherwise a refusal naming the file (`refusal` recovers it on the chief)."""
  path, rows, fingerprint = reference

  def check(ok, problem):
    return tf.debugging.Assert(ok, [tf.strings.join([REFUSAL_MARKER, path, problem])])

  literal = tf.strings.regex_replace(path, r"([*?\[\\])", r"\\\1")  # glob characters escaped
  with tf.control_dependencies([check(tf.size(tf.io.matching_files(literal)) > 0,
                                      ": missing: the shard of this step")]):
    records = tf.data.TFRecordDataset(path).ignore_errors().batch(1 << 30).reduce(
        tf.zeros([0], tf.string), lambda read, batch: tf.concat([read, batch], 0))
  matches = tf.logical_and(tf.equal(tf.size(records, tf.int64), rows),
                           tf.reduce_all(tf.equal(records_fingerprint(records), fingerprint)))
  with tf.control_dependencies([check(matches, ": its rows differ from the manifest (a shard of "
                                      "another run, truncated or corrupted)")]):
    return parse_rows(tf.identity(records))
