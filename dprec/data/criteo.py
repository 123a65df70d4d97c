"""Criteo click-log TSV files: readers, vocabularies and the model's inputs.

Lines are parsed by `dprec.data.criteo_parse` (the columns, validation and the optional trailing
`user_id` column) on whole blocks of lines; this module reads plain or gzipped files block by block
(`read_criteo_tsv`), counts and keeps categorical ids (`CriteoVocabulary`), and turns parsed rows
into the model's inputs (`transform`, `load_criteo`, `criteo_dataset`).
"""
import dataclasses
import gzip
import os
import re
import warnings
import zlib
from typing import Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from dprec.data.criteo_parse import CATEGORICAL_FEATURES
from dprec.data.criteo_parse import COLUMNS
from dprec.data.criteo_parse import INTEGER_FEATURES
from dprec.data.criteo_parse import USER_COLUMN
from dprec.data.criteo_parse import BadRow
from dprec.data.criteo_parse import ParsedChunk
from dprec.data.criteo_parse import format_hex
from dprec.data.criteo_parse import parse_bytes
from dprec.data.criteo_parse import parse_hex_ids
from dprec.errors import DprecError, InputError

ID_DOMAIN = 1 << 32  # categorical ids are 8 hex digits: the candidates of every DP selection

# Ghazi et al. 2023: the paper's categorical-feature-14 … -39 are C1 … C26 (sum 338,782).
TABLE3_VOCAB_SIZES = (
    1472, 577, 82741, 18940, 305, 23, 1172, 633, 3, 9090, 5918, 64300, 3207,
    27, 1550, 44262, 10, 5485, 2161, 3, 56473, 17, 15, 27360, 104, 12934)

DEFAULT_CHUNK_ROWS = 1 << 18
_DAY_FILE = re.compile(r"^day_(\d+)(\.gz)?$")


@dataclasses.dataclass(frozen=True)
class CriteoVocabulary:
  """Per categorical feature: hex id → index. Index 0 is OOV/missing, known ids are 1..V.

  Ids are ordered by decreasing count (index 1 = most frequent bucket), so a top-k prefix of the
  index space is the top-k buckets. Counting raw data is not private: build the vocabulary from
  public data, or select buckets with `dprec.privacy.gumbel_top_k` and charge the ledger.
  """
  ids: Tuple[np.ndarray, ...]  # per feature, int64 ids in index order (index = position + 1)
  counts: Tuple[np.ndarray, ...]  # per feature, int64 count of each id (same order)

  def __post_init__(self):
    if len(self.ids) != len(CATEGORICAL_FEATURES) or len(self.counts) != len(self.ids):
      raise DprecError(f"a Criteo vocabulary needs {len(CATEGORICAL_FEATURES)} features, "
                       f"got {len(self.ids)}")
    orders = tuple(np.argsort(ids, kind="stable") for ids in self.ids)
    object.__setattr__(self, "_orders", orders)
    object.__setattr__(self, "_sorted", tuple(ids[o] for ids, o in zip(self.ids, orders)))

  @property
  def sizes(self) -> Tuple[int, ...]:
    """Embedding table sizes, OOV index 0 included (V + 1)."""
    return tuple(len(ids) + 1 for ids in self.ids)

  def lookup(self, cat_values: np.ndarray) -> np.ndarray:
    """int64[n, 26] hex ids (-1 missing) → int32[n, 26] indices (0 for OOV and missing)."""
    out = np.zeros(cat_values.shape, dtype=np.int32)
    for j, (sorted_ids, order) in enumerate(zip(self._sorted, self._orders)):
      if not len(sorted_ids):
        continue
      column = cat_values[:, j]
      position = np.minimum(np.searchsorted(sorted_ids, column), len(sorted_ids) - 1)
      found = sorted_ids[position] == column
      out[:, j] = np.where(found, order[position] + 1, 0)
    return out

  @classmethod
  def from_counts(cls, counts: Union[Mapping[str, Mapping[Union[str, int], int]],
                                     Sequence[Tuple[np.ndarray, np.ndarray]]],
                  min_count: int = 1,
                  top_k: Union[None, int, Sequence[int]] = None) -> "CriteoVocabulary":
    """Keeps ids seen at least `min_count` times, then the `top_k` most frequent per feature.

    `counts` maps each feature name to {hex string or int id: count}, or is a sequence of 26
    `(ids, counts)` array pairs in C1..C26 order (as from `count_categories`). `top_k` is one
    int for all features or one per feature (e.g. `TABLE3_VOCAB_SIZES`).
    """
    if isinstance(counts, Mapping):
      unknown = set(counts) - set(CATEGORICAL_FEATURES)
      if unknown:
        raise DprecError(f"unknown categorical features in counts: {sorted(unknown)}")
      pairs = [_count_arrays(counts.get(name, {})) for name in CATEGORICAL_FEATURES]
    else:
      pairs = [(np.asarray(i, np.int64), np.asarray(c, np.int64)) for i, c in counts]
    limits = [top_k] * len(pairs) if top_k is None or np.isscalar(top_k) else list(top_k)
    if len(limits) != len(CATEGORICAL_FEATURES):
      raise DprecError(f"top_k needs one value per categorical feature, got {len(limits)}")
    kept_ids, kept_counts = [], []
    for (ids, cnt), limit in zip(pairs, limits):
      keep = cnt >= min_count
      ids, cnt = ids[keep], cnt[keep]
      order = np.lexsort((ids, -cnt))[:limit]
      kept_ids.append(ids[order])
      kept_counts.append(cnt[order])
    return cls(tuple(kept_ids), tuple(kept_counts))

  @classmethod
  def build(cls, paths, min_count: int = 1, top_k: Union[None, int, Sequence[int]] = None,
            strict: bool = True, user_column: bool = False) -> "CriteoVocabulary":
    """Counts the categorical ids of Criteo TSV files and keeps them as in `from_counts`."""
    return cls.from_counts(count_categories(read_criteo_tsv(paths, strict=strict,
                                                            user_column=user_column)),
                           min_count=min_count, top_k=top_k)

  def save(self, directory: str) -> None:
    """Writes `C1.tsv` … `C26.tsv`: line k is `hex_id<TAB>count` of index k."""
    os.makedirs(directory, exist_ok=True)
    for name, ids, cnt in zip(CATEGORICAL_FEATURES, self.ids, self.counts):
      table = pa.table({"id": pa.array(format_hex(ids).view("S8").ravel()).cast(pa.string()),
                        "count": cnt})
      pa_csv.write_csv(table, os.path.join(directory, f"{name}.tsv"),
                       pa_csv.WriteOptions(include_header=False, delimiter="\t",
                                           quoting_style="none"))

  @classmethod
  def load(cls, directory: str) -> "CriteoVocabulary":
    """Reads a vocabulary written by `save` (or by the Beam preprocessing job)."""
    ids, counts = [], []
    for name in CATEGORICAL_FEATURES:
      path = os.path.join(directory, f"{name}.tsv")
      if not os.path.exists(path):
        raise DprecError(f"{path}: vocabulary file missing")
      if not os.path.getsize(path):  # a feature with no kept ids
        ids.append(np.zeros(0, np.int64))
        counts.append(np.zeros(0, np.int64))
        continue
      try:
        table = pa_csv.read_csv(
            path, read_options=pa_csv.ReadOptions(column_names=["id", "count"]),
            parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pa_csv.ConvertOptions(column_types={"id": pa.string(),
                                                                "count": pa.int64()}))
      except pa.ArrowInvalid as error:
        raise DprecError(f"{path}: not a vocabulary file (id<TAB>count lines): {error}") from None
      column = table.column("id").combine_chunks()
      ok, values = parse_hex_ids(column)
      bad = np.flatnonzero(~ok if not ok.all() else values < 0)  # values are -1 unless all ok
      if len(bad):
        raise InputError(path, int(bad[0]) + 1, "id",
                         f"not an 8-hex-digit id: {column[int(bad[0])].as_py()!r}")
      ids.append(values)
      counts.append(np.asarray(table.column("count")).astype(np.int64))
    return cls(tuple(ids), tuple(counts))


def _count_arrays(mapping: Mapping[Union[str, int], int]) -> Tuple[np.ndarray, np.ndarray]:
  keys = [int(k, 16) if isinstance(k, str) else int(k) for k in mapping]
  return np.asarray(keys, np.int64), np.asarray(list(mapping.values()), np.int64)


def count_categories(chunks: Iterable[ParsedChunk]) -> List[Tuple[np.ndarray, np.ndarray]]:
  """Per categorical feature: the distinct ids in `chunks` and their counts (missing skipped)."""
  partial = [[] for _ in CATEGORICAL_FEATURES]
  for chunk in chunks:
    for j, column in enumerate(chunk.cat_values.T):
      partial[j].append(np.unique(column[column >= 0], return_counts=True))
  result = []
  for pieces in partial:
    ids = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, np.int64)
    cnt = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, np.int64)
    unique, inverse = np.unique(ids, return_inverse=True)
    result.append((unique, np.bincount(inverse, weights=cnt, minlength=len(unique))
                   .astype(np.int64)))
  return result


def transform(parsed: ParsedChunk, vocab: CriteoVocabulary) -> dict:
  """Model inputs: label, log(1 + max(x, 0)) integers (missing → 0), vocabulary indices, and
  the `USER_COLUMN` when the chunk has one."""
  batch = {
      "label": parsed.label.astype(np.int32),
      "int_features": np.log1p(np.maximum(parsed.int_values, 0)).astype(np.float32),
      "cat_features": vocab.lookup(parsed.cat_values),
  }
  if parsed.user_id is not None:
    batch[USER_COLUMN] = parsed.user_id
  return batch


def criteo_day_files(directory: str) -> List[str]:
  """The `day_N` (or `day_N.gz`) files of a directory, ordered by N."""
  if not os.path.isdir(directory):
    problem = "not a directory" if os.path.exists(directory) else "does not exist"
    raise DprecError(f"{directory}: {problem}")
  found = sorted((int(m.group(1)), name) for name in os.listdir(directory)
                 for m in [_DAY_FILE.match(name)] if m)
  if not found:
    raise DprecError(f"{directory}: no day_N files")
  return [os.path.join(directory, name) for _, name in found]


def _as_paths(paths) -> List[str]:
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  return [os.fspath(p) for p in paths]


def _open(path: str):
  """A binary stream of the file's text; gzip is recognised by its magic bytes."""
  if not os.path.isfile(path):
    raise DprecError(f"{path}: {'a directory' if os.path.isdir(path) else 'no such file'}")
  with open(path, "rb") as probe:
    magic = probe.read(2)
  if magic == b"\x1f\x8b":
    return gzip.open(path, "rb")
  if path.endswith(".gz"):
    raise DprecError(f"{path}: named .gz but is not gzip data")
  return open(path, "rb")


def read_criteo_tsv(paths, strict: bool = True, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                    pad_short_lines: bool = False,
                    user_column: bool = False) -> Iterator[ParsedChunk]:
  """Streams `ParsedChunk`s of at most `chunk_rows` lines from plain or gzipped TSV files (every
  line with the trailing `USER_COLUMN` if `user_column`)."""
  if chunk_rows < 1:
    raise DprecError(f"chunk_rows must be positive, got {chunk_rows}")
  for path in _as_paths(paths):
    for first_line_no, block in _line_blocks(path, chunk_rows):
      yield parse_bytes(block, path, first_line_no, strict, pad_short_lines, user_column)


def has_user_column(path: str) -> bool:
  """Whether the first line of `path` has the 41 fields of a file with the `USER_COLUMN` (the
  other lines are checked as they are parsed)."""
  with _open(path) as stream:
    first = stream.readline()
  return first.rstrip(b"\r\n").count(b"\t") + 1 == len(COLUMNS) + 1


def _line_blocks(path: str, chunk_rows: int) -> Iterator[Tuple[int, bytes]]:
  """Blocks of `chunk_rows` whole lines (the last may be shorter) with their first line number."""
  read_size = max(1 << 16, chunk_rows * 256)
  line_no, pending = 1, b""
  with _open(path) as stream:
    while True:
      try:
        data = stream.read(read_size)
      except (OSError, EOFError, zlib.error) as error:
        if not isinstance(stream, gzip.GzipFile):
          raise
        raise DprecError(f"{path}: corrupt gzip data after line {line_no - 1} ({error})") from error
      pending += data
      newlines = np.flatnonzero(np.frombuffer(pending, dtype=np.uint8) == 10)
      start = 0
      for end in newlines[chunk_rows - 1::chunk_rows]:
        yield line_no, pending[start:end + 1]
        line_no, start = line_no + chunk_rows, end + 1
      pending = pending[start:]
      if not data:
        break
  if pending:
    yield line_no, pending


def load_criteo(paths, vocab: CriteoVocabulary, strict: bool = True,
                bad_rows: Optional[list] = None, user_column: bool = False) -> dict:
  """Whole files as one dict of numpy arrays (see `transform`; with the `USER_COLUMN` of every
  line if `user_column`).

  In permissive mode malformed lines are appended to `bad_rows` if given, otherwise counted in a
  warning; they are never dropped silently.
  """
  parts, skipped = [], []
  for chunk in read_criteo_tsv(paths, strict=strict, user_column=user_column):
    parts.append(transform(chunk, vocab))
    skipped.extend(chunk.bad_rows)
  _report_bad_rows(skipped, bad_rows)
  if not parts:
    return transform(ParsedChunk.empty("", user_column), vocab)
  return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _report_bad_rows(skipped: List[BadRow], sink: Optional[list]) -> None:
  if sink is not None:
    sink.extend(skipped)
  elif skipped:
    first = skipped[0]
    warnings.warn(f"skipped {len(skipped)} malformed Criteo lines; first: "
                  f"{first.path}:{first.line_no}: {first.reason}")


def criteo_dataset(paths, vocab: CriteoVocabulary, batch_size: int, strict: bool = True,
                   drop_remainder: bool = False, bad_rows: Optional[list] = None,
                   chunk_rows: int = DEFAULT_CHUNK_ROWS, user_column: bool = False):
  """A `tf.data.Dataset` of `({"int_features", "cat_features"}, label)` batches in file order
  (lines with the trailing `USER_COLUMN` if `user_column`: read, checked and left out).

  Files stream chunk by chunk (bounded memory); rows are re-batched across chunk and file edges.
  """
  import tensorflow as tf
  if batch_size < 1:
    raise DprecError(f"batch_size must be positive, got {batch_size}")
  paths = _as_paths(paths)

  def batches():
    pending, skipped = [], []
    for chunk in read_criteo_tsv(paths, strict=strict, chunk_rows=chunk_rows,
                                 user_column=user_column):
      skipped.extend(chunk.bad_rows)
      pending.append(transform(dataclasses.replace(chunk, user_id=None), vocab))
      merged = {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
      full = len(merged["label"]) // batch_size * batch_size
      for start in range(0, full, batch_size):
        yield {k: v[start:start + batch_size] for k, v in merged.items()}
      pending = [{k: v[full:] for k, v in merged.items()}]
    _report_bad_rows(skipped, bad_rows)
    if pending and len(pending[0]["label"]) and not drop_remainder:
      yield pending[0]

  signature = {"label": tf.TensorSpec([None], tf.int32),
               "int_features": tf.TensorSpec([None, len(INTEGER_FEATURES)], tf.float32),
               "cat_features": tf.TensorSpec([None, len(CATEGORICAL_FEATURES)], tf.int32)}
  dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
  return dataset.map(lambda b: ({"int_features": b["int_features"],
                                 "cat_features": b["cat_features"]}, b["label"]))
