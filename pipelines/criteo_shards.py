"""The Criteo jobs' records: a split's lines parsed with their dead letters, written as one
TFRecord shard with its statistics, and the manifest of the shards.

Parsing (`dprec.data.criteo_parse`) and the transform (`dprec.data.criteo`) are the in-process
reader's, on whole blocks of lines; nothing runs per row in Python. Dead letters `(file, line,
reason, raw)` go to `dead_letters/`, per-shard statistics merge into `stats.json`. Used by the
batch job (`pipelines.criteo`) and the streaming job (`pipelines.criteo_stream`).
"""
import collections
import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Tuple

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CriteoVocabulary
from dprec.data.criteo import count_categories
from dprec.data.criteo import transform
from dprec.data.criteo_parse import CATEGORICAL_FEATURES
from dprec.data.criteo_parse import INTEGER_FEATURES
from dprec.data.criteo_parse import parse_bytes
from pipelines import beam_io

DEAD_LETTERS = "dead_letters"
METRICS_NAMESPACE = "dprec.criteo"


def parse_block(item, metrics: bool = False, pad_short_lines: bool = False,
                user_column: bool = False):
  """A `LineBlock` → (parsed chunk, dead letters); a `DeadLetter` from reading → (None, [it])."""
  if isinstance(item, beam_io.DeadLetter):
    letters, chunk = [item], None
  else:
    chunk = parse_bytes(item.data, item.path, item.first_line, strict=False,
                        pad_short_lines=pad_short_lines, user_column=user_column)
    letters = [beam_io.DeadLetter(*bad) for bad in chunk.bad_rows]
  if metrics:
    rows = 0 if chunk is None else len(chunk)
    Metrics.counter(METRICS_NAMESPACE, "rows_in").inc(rows + len(letters))
    Metrics.counter(METRICS_NAMESPACE, "rows_out").inc(rows)
    for letter in letters:
      Metrics.counter(METRICS_NAMESPACE, f"dead_letters.{beam_io.reason_kind(letter.reason)}").inc()
  return chunk, letters


def count_split(split: beam_io.Split, pad_short_lines: bool = False, user_column: bool = False):
  """(feature index, (ids, counts)) of every categorical feature of one split."""
  chunks = [chunk for chunk, _ in (parse_block(item, pad_short_lines=pad_short_lines,
                                               user_column=user_column)
                                   for item in beam_io.read_split(split)) if chunk is not None]
  yield from enumerate(count_categories(chunks))


@dataclasses.dataclass
class ShardStats:
  """What one written shard (or a merge of several) contributes to `stats.json`."""
  rows_in: int = 0
  rows_out: int = 0
  padded_rows: int = 0  # rows out whose line lacked trailing fields (read as missing values)
  bad_rows: Dict[str, int] = dataclasses.field(default_factory=dict)
  present: np.ndarray = dataclasses.field(
      default_factory=lambda: np.zeros(len(CATEGORICAL_FEATURES), np.int64))
  known: np.ndarray = dataclasses.field(
      default_factory=lambda: np.zeros(len(CATEGORICAL_FEATURES), np.int64))
  files: Dict[int, List[Tuple[str, int]]] = dataclasses.field(default_factory=dict)

  def add(self, other: "ShardStats") -> "ShardStats":
    self.rows_in += other.rows_in
    self.rows_out += other.rows_out
    self.padded_rows += other.padded_rows
    self.bad_rows = dict(collections.Counter(self.bad_rows) + collections.Counter(other.bad_rows))
    self.present = self.present + other.present
    self.known = self.known + other.known
    for day, files in other.files.items():
      self.files.setdefault(day, []).extend(files)
    return self

  def summary(self, vocab: CriteoVocabulary) -> dict:
    dead = sum(self.bad_rows.values())
    return {
        "rows_in": self.rows_in, "rows_out": self.rows_out, "padded_rows": self.padded_rows,
        "dead_letters": dead,
        "bad_fraction": dead / self.rows_in if self.rows_in else 0.0,
        "bad_rows_by_reason": dict(sorted(self.bad_rows.items())),
        "vocab_sizes": dict(zip(CATEGORICAL_FEATURES, vocab.sizes)),
        "coverage": {name: (float(k / p) if p else None) for name, k, p in
                     zip(CATEGORICAL_FEATURES, self.known, self.present)},
    }


def write_shard(path: str, chunks, vocab: CriteoVocabulary) -> ShardStats:
  """Transforms parsed chunks and writes them as one TFRecord file at `path`, atomically."""
  stats = ShardStats()

  def records():
    for chunk in chunks:
      batch = transform(chunk, vocab)
      stats.present += (chunk.cat_values >= 0).sum(axis=0)
      stats.known += (batch["cat_features"] > 0).sum(axis=0)
      stats.rows_out += len(chunk)
      stats.padded_rows += int(chunk.padded.sum())
      yield from criteo_tfrecord.encode_examples(batch)

  beam_io.makedirs(os.path.dirname(path))
  criteo_tfrecord.write_tfrecord(path, records())
  return stats


def count_dead_letters(stats: ShardStats, letters: Sequence[beam_io.DeadLetter]) -> ShardStats:
  """Completes a shard's statistics with its dead letters: rows in = rows out + dead letters."""
  stats.rows_in = stats.rows_out + len(letters)
  stats.bad_rows = dict(collections.Counter(beam_io.reason_kind(l.reason) for l in letters))
  return stats


class WriteSplit(beam.DoFn):
  """Second read of a split: transform with the vocabulary, write its shard and its dead letters
  (`dead_letters/part-NNNNN.jsonl`, in line order; none if it has none), emit its statistics.

  Writing the dead letters here, not in a branch of the pipeline of their own, keeps them on the
  path to the final summary: Beam's DaskRunner computes only what the last transform depends on.
  """

  def __init__(self, output: str, pad_short_lines: bool = False, user_column: bool = False):
    self._output, self._pad_short_lines = output, pad_short_lines
    self._user_column = user_column

  def process(self, split: beam_io.Split, vocab: CriteoVocabulary):
    letters = []

    def chunks():
      for item in beam_io.read_split(split):
        chunk, bad = parse_block(item, metrics=True, pad_short_lines=self._pad_short_lines,
                                 user_column=self._user_column)
        letters.extend(bad)
        if chunk is not None:
          yield chunk

    name = f"part-{split.index:05d}"
    stats = write_shard(os.path.join(self._output, f"day_{split.day}", f"{name}.tfrecord"),
                        chunks(), vocab)
    stats.files = {split.day: [(f"{name}.tfrecord", stats.rows_out)]}
    beam_io.write_dead_letters(os.path.join(self._output, DEAD_LETTERS, f"{name}.jsonl"), letters)
    yield count_dead_letters(stats, letters)


class MergeStatsFn(beam.CombineFn):

  def create_accumulator(self):
    return ShardStats()

  def add_input(self, accumulator, stats):
    return accumulator.add(stats)

  def merge_accumulators(self, accumulators):
    total = ShardStats()
    for accumulator in accumulators:
      total.add(accumulator)
    return total

  def extract_output(self, accumulator):
    return accumulator


def manifest(stats: ShardStats, vocab: CriteoVocabulary, vocab_dir: str = "vocab",
             extra_entries: Optional[Dict[int, dict]] = None, dataset_id: Optional[str] = None,
             vocab_privacy: Optional[dict] = None) -> dict:
  """The `dprec-criteo-v1` manifest the trainer reads (see `dprec.data.criteo_tfrecord`), with
  the output's `dataset_id` and its `vocab_privacy`."""
  days = []
  for day in sorted(stats.files):
    files = sorted(stats.files[day])
    entry = {"day": day, "dir": f"day_{day}", "files": [f for f, _ in files],
             "rows": sum(rows for _, rows in files)}
    entry.update((extra_entries or {}).get(day, {}))
    days.append(entry)
  return {"format": criteo_tfrecord.FORMAT, "integer_features": INTEGER_FEATURES,
          "categorical_features": CATEGORICAL_FEATURES,
          "vocab_sizes": dict(zip(CATEGORICAL_FEATURES, vocab.sizes)), "days": days,
          "vocab_dir": vocab_dir, identity.DATASET_ID: dataset_id,
          "vocab_privacy": vocab_privacy}
