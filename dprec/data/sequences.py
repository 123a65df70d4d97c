"""Per-user item sequences written by `dprec preprocess sequences`: schema, writer and reader.

An output directory holds `manifest.json` (format `dprec-sequences-v1`, with the output's
`dataset_id`: `dprec.data.identity`), `stats.json` (`users`, `items`, `actions`, ...), TFRecord
shards of one `tf.train.Example` per user (`user` int64, `train_items` int64 list in time order,
`valid_item` and `test_item` int64, 0 = none), the item frequencies p_i (`item_frequencies.npy`,
float64[M + 1], p_0 = 0) and the original ids of items and users (`item_ids.txt`,
`user_ids.txt`: line i is the original id of index i). Items are 1..M; 0 is padding. The exact
p_i are private data (evaluation buckets items by them); a model takes p_i from a DP histogram
or from a public file (`read_item_frequencies`).

Item frequency file (public p_i, e.g. a platform's published purchase shares): one item a line,
`ITEM_ID FREQUENCY` separated by white space, the id as in the input logs (`item_ids.txt`), the
frequency in [0, 1]; blank lines and `#` comments are skipped. It must cover every item of the
data set; ids the data set does not hold are ignored.

`make_examples` turns the sequences into the sequential recommender's training examples and test
histories.
"""
import dataclasses
import io
import json
import os
from typing import List, Optional

import numpy as np

from dprec import atomic_io
from dprec.errors import DprecError

FORMAT = "dprec-sequences-v1"
MANIFEST = "manifest.json"
STATS = "stats.json"
FREQUENCIES = "item_frequencies.npy"
ITEM_IDS = "item_ids.txt"
USER_IDS = "user_ids.txt"


@dataclasses.dataclass
class SequenceData:
  """All users' sequences in memory (sequence data sets are small next to click logs)."""
  users: np.ndarray  # int64[U], 1..U
  train: List[np.ndarray]  # per user, int64 item ids in time order
  valid_items: np.ndarray  # int64[U], 0 = none
  test_items: np.ndarray  # int64[U], 0 = none
  item_frequencies: np.ndarray  # float64[M + 1]
  stats: dict
  item_ids: Optional[List[str]] = None  # original id of items 1..M (None: not known)

  @property
  def num_items(self) -> int:
    return len(self.item_frequencies) - 1

  @property
  def num_users(self) -> int:
    return len(self.users)

  def padded_train(self, max_len: int) -> np.ndarray:
    """int64[U, max_len]: the last `max_len` training items of each user, left-padded with 0."""
    out = np.zeros((len(self.train), max_len), np.int64)
    for row, sequence in enumerate(self.train):
      tail = sequence[-max_len:]
      if len(tail):
        out[row, max_len - len(tail):] = tail
    return out


def _example(user: int, train: np.ndarray, valid: int, test: int) -> bytes:
  """One user's serialized Example, its feature map in key order (protobuf's default order
  follows the process's string hashing, so the bytes would differ from process to process)."""
  import tensorflow as tf

  def int64s(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

  return tf.train.Example(features=tf.train.Features(feature={
      "user": int64s([user]), "train_items": int64s(train), "valid_item": int64s([valid]),
      "test_item": int64s([test])})).SerializeToString(deterministic=True)


def write_sequences(directory: str, result: dict, shard_users: int) -> List[str]:
  """Writes TFRecord shards, frequencies and id maps of `result`; returns the shard names."""
  from dprec.data.criteo_tfrecord import write_tfrecord
  os.makedirs(directory, exist_ok=True)
  users = len(result["train"])
  shards = max(1, -(-users // shard_users))
  files = []
  for shard in range(shards):
    name = f"sequences-{shard:05d}-of-{shards:05d}.tfrecord"
    rows = range(shard * shard_users, min(users, (shard + 1) * shard_users))
    write_tfrecord(os.path.join(directory, name), (
        _example(row + 1, result["train"][row], int(result["valid"][row]),
                 int(result["test"][row])) for row in rows))
    files.append(name)
  frequencies = io.BytesIO()
  np.save(frequencies, result["item_frequencies"])
  atomic_io.write_bytes(os.path.join(directory, FREQUENCIES), frequencies.getvalue())
  for name, ids in ((ITEM_IDS, result["item_ids"]), (USER_IDS, result["user_ids"])):
    atomic_io.write_bytes(os.path.join(directory, name),
                  "".join(f"{i}\n" for i in ["<pad>", *ids]).encode())
  return files


def load_sequences(directory: str) -> SequenceData:
  """Reads a `dprec preprocess sequences` output directory (users in index order)."""
  import tensorflow as tf
  from dprec.data.criteo_tfrecord import read_manifest
  manifest = read_manifest(directory, FORMAT, "sequences")
  path = os.path.join(directory, MANIFEST)
  with open(os.path.join(directory, STATS)) as stream:
    stats = json.load(stream)
  spec = {"user": tf.io.FixedLenFeature([], tf.int64),
          "train_items": tf.io.VarLenFeature(tf.int64),
          "valid_item": tf.io.FixedLenFeature([], tf.int64),
          "test_item": tf.io.FixedLenFeature([], tf.int64)}
  users, train, valid, test = [], [], [], []
  files = [os.path.join(directory, name) for name in manifest["files"]]
  for batch in tf.data.TFRecordDataset(files).batch(4096):
    parsed = tf.io.parse_example(batch, spec)
    users.append(parsed["user"].numpy())
    valid.append(parsed["valid_item"].numpy())
    test.append(parsed["test_item"].numpy())
    items = parsed["train_items"]
    lengths = np.bincount(items.indices[:, 0].numpy(), minlength=len(users[-1]))
    train += np.split(items.values.numpy(), np.cumsum(lengths)[:-1])
  frequencies = np.load(os.path.join(directory, manifest["item_frequencies"]))
  with open(os.path.join(directory, manifest["item_ids"]), encoding="utf-8") as stream:
    item_ids = stream.read().split("\n")[1:frequencies.shape[0]]
  empty = np.zeros(0, np.int64)
  data = SequenceData(
      users=np.concatenate(users) if users else empty, train=train,
      valid_items=np.concatenate(valid) if valid else empty,
      test_items=np.concatenate(test) if test else empty,
      item_frequencies=frequencies, stats=stats, item_ids=item_ids)
  if data.num_users != manifest["users"] or data.num_items != manifest["items"]:
    raise DprecError(f"{path}: manifest says {manifest['users']} users / {manifest['items']} "
                     f"items, files hold {data.num_users} / {data.num_items}")
  return data


def read_item_frequencies(path: str, item_ids: List[str]) -> np.ndarray:
  """float64[M + 1] p_i from an item frequency file (module docstring) for items 1..M with the
  original ids `item_ids` (p_0 = 0); bad lines and uncovered items raise `DprecError`."""
  index = {item: position + 1 for position, item in enumerate(item_ids)}
  frequencies = np.zeros(len(item_ids) + 1, np.float64)
  first_line = {}
  try:
    with open(path, encoding="utf-8") as stream:
      lines = stream.read().split("\n")
  except (OSError, UnicodeDecodeError) as error:
    raise DprecError(f"{path}: cannot read the item frequency file ({error})") from error
  for number, raw in enumerate(lines, start=1):
    fields = raw.split("#", 1)[0].split()
    if not fields:
      continue
    where = f"{path}:{number}"
    if len(fields) != 2:
      raise DprecError(f"{where}: expected 2 fields (item frequency), found {len(fields)}")
    item, text = fields
    try:
      value = float(text)
    except ValueError:
      raise DprecError(f"{where}: frequency: not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
      raise DprecError(f"{where}: frequency: must be in [0, 1], got {text}")
    if item in first_line:
      raise DprecError(f"{where}: item {item!r} again (first on line {first_line[item]})")
    first_line[item] = number
    if item in index:
      frequencies[index[item]] = value
  missing = [item for item in item_ids if item not in first_line]
  if missing:
    raise DprecError(
        f"{path}: no frequency for {len(missing)} of the {len(item_ids)} items of the data set "
        f"(e.g. {', '.join(repr(m) for m in missing[:3])}); the file must list every item by "
        "its id in the input logs")
  return frequencies


@dataclasses.dataclass
class SeqRecExamples:
  """Training examples (one per user with a next-item target) and the test users."""
  items: np.ndarray  # int32 [N, L] inputs, left-padded
  labels: np.ndarray  # int32 [N, L] next items (0 = none)
  test_histories: np.ndarray  # int32 [U', L]
  test_items: np.ndarray  # int64 [U']
  item_frequencies: np.ndarray  # float64 [M + 1]
  valid_histories: Optional[np.ndarray] = None  # int32 [U'', L] (held-out validation only)
  valid_items: Optional[np.ndarray] = None  # int64 [U'']

  @property
  def num_items(self):
    return len(self.item_frequencies) - 1


def _left_padded(histories, max_len):
  out = np.zeros((len(histories), max_len), np.int32)
  for row, history in enumerate(histories):
    tail = np.asarray(history)[-max_len:]
    out[row, max_len - len(tail):] = tail
  return out


def make_examples(data: SequenceData, max_len: int,
                  hold_out_validation: bool = False) -> SeqRecExamples:
  """The training examples of `train seqrec` (one per user: the training items plus the
  validation item, if any, each predicting the next) and the test users' histories (all of
  them). `hold_out_validation`: the validation item is not trained on but ranked after the
  training items (`valid_histories`, `valid_items`), for model selection."""
  histories = [np.append(train, valid) if valid > 0 else np.asarray(train)
               for train, valid in zip(data.train, data.valid_items)]
  trained = [np.asarray(t) for t in data.train] if hold_out_validation else histories
  trainable = [h for h in trained if len(h) >= 2]
  if not trainable:
    raise DprecError("no user has two or more training items: nothing to train on")
  items = np.zeros((len(trainable), max_len), np.int32)
  labels = np.zeros((len(trainable), max_len), np.int32)
  for row, history in enumerate(trainable):
    inputs, targets = history[:-1][-max_len:], history[1:][-max_len:]
    items[row, max_len - len(inputs):] = inputs
    labels[row, max_len - len(targets):] = targets
  tested = np.flatnonzero(data.test_items > 0)
  examples = SeqRecExamples(items, labels, _left_padded([histories[u] for u in tested], max_len),
                            data.test_items[tested], np.asarray(data.item_frequencies, np.float64))
  if hold_out_validation:
    validated = np.flatnonzero((data.valid_items > 0)
                               & np.array([len(t) > 0 for t in data.train], bool))
    examples = dataclasses.replace(
        examples, valid_histories=_left_padded([data.train[u] for u in validated], max_len),
        valid_items=data.valid_items[validated])
  return examples
