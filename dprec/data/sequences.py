"""Per-user item sequences written by `dprec preprocess sequences`: schema, writer and reader.

An output directory holds `manifest.json` (format `dprec-sequences-v1`), `stats.json` (`users`,
`items`, `actions`, ...), TFRecord shards of one `tf.train.Example` per user (`user` int64,
`train_items` int64 list in time order, `valid_item` and `test_item` int64, 0 = none), the item
frequencies p_i (`item_frequencies.npy`, float64[M + 1], p_0 = 0) and the original ids of items
and users (`item_ids.txt`, `user_ids.txt`: line i is the original id of index i). Items are
1..M; 0 is padding.
"""
import dataclasses
import io
import json
import os
from typing import List

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
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  def int64s(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

  return tf.train.Example(features=tf.train.Features(feature={
      "user": int64s([user]), "train_items": int64s(train), "valid_item": int64s([valid]),
      "test_item": int64s([test])})).SerializeToString()


def write_sequences(directory: str, result: dict, shard_users: int) -> List[str]:
  """Writes TFRecord shards, frequencies and id maps of `result`; returns the shard names."""
  from dprec.data.criteo_tfrecord import write_tfrecord  # pylint: disable=import-outside-toplevel
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
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from dprec.data.criteo_tfrecord import read_manifest  # pylint: disable=import-outside-toplevel
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
  empty = np.zeros(0, np.int64)
  data = SequenceData(
      users=np.concatenate(users) if users else empty, train=train,
      valid_items=np.concatenate(valid) if valid else empty,
      test_items=np.concatenate(test) if test else empty,
      item_frequencies=frequencies, stats=stats)
  if data.num_users != manifest["users"] or data.num_items != manifest["items"]:
    raise DprecError(f"{path}: manifest says {manifest['users']} users / {manifest['items']} "
                     f"items, files hold {data.num_users} / {data.num_items}")
  return data
