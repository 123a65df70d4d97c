"""Where a streaming run finds its periods: complete windows of the streaming Beam job.

A period is `period_days` consecutive days (seed 001 Table 5: 1, 2, 4, 8, 16, 18). It is complete
when every one of its days is complete, i.e. its manifest is present: the Beam job writes a day's
TFRecords first and its manifest last, atomically, so a trainer tailing the directory never reads
a half-written day. Days past `train_days` are the hold-out (seed 001 §4.3: train on days 1–18,
evaluate on 19–24); they are still served as periods, for evaluation only.
"""
import abc
import dataclasses
import glob
import json
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from dprec.errors import DprecError

MANIFEST = "manifest.json"
CATEGORICAL_KEY = "cat_features"  # int [n, F] vocabulary ids, columns in `vocab_sizes` order
Arrays = Tuple[Dict[str, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Period:
  """One complete period.

  Attributes:
    index: 0-based position in the stream.
    days: the day indices it covers.
    vocab_sizes: {feature: rows incl. OOV row 0} of the vocabulary snapshot valid for it.
    load: callable() -> (features {name: array[n, ...]}, labels int array[n]).
    counts: callable() -> {feature: running bucket counts through this period (index = id)}.
  """
  index: int
  days: Tuple[int, ...]
  vocab_sizes: Mapping[str, int]
  load: Callable[[], Arrays]
  counts: Callable[[], Mapping[str, np.ndarray]]


class PeriodSource(abc.ABC):
  """Serves complete periods by index (None while a period is incomplete)."""

  @abc.abstractmethod
  def period(self, index: int) -> Optional[Period]:
    """Period `index` if all its days are complete, else None."""


def period_days_of(index, period_days, train_days, first_day=0):
  """Days of period `index`: training periods cut the first `train_days` days into chunks of
  `period_days` (the last one possibly shorter); hold-out periods follow, `period_days` each."""
  if train_days is None:
    start = first_day + index * period_days
    return tuple(range(start, start + period_days))
  train_periods = -(-train_days // period_days)
  if index < train_periods:
    start = index * period_days
    return tuple(range(first_day + start, first_day + min(start + period_days, train_days)))
  start = train_days + (index - train_periods) * period_days
  return tuple(range(first_day + start, first_day + start + period_days))


class ArrayPeriodSource(PeriodSource):
  """Periods from in-memory per-day arrays (tests, notebooks, data already in memory).

  `days` is a list of (features, labels) per day; vocabulary sizes are the running maxima of
  the ids seen and counts the running id counts, as the streaming Beam job would report them.
  """

  def __init__(self, days: Sequence[Arrays], period_days=1, train_days=None,
               categorical_key=CATEGORICAL_KEY, feature_names=None):
    self.days, self.period_days, self.train_days = list(days), period_days, train_days
    self.key = categorical_key
    width = self.days[0][0][categorical_key].shape[1]
    self.names = list(feature_names or [f"C{i + 1}" for i in range(width)])

  def _running(self, last_day):
    ids = np.concatenate([f[self.key] for f, _ in self.days[:last_day + 1]])
    return {name: np.bincount(ids[:, j], minlength=int(ids[:, j].max()) + 1)
            for j, name in enumerate(self.names)}

  def period(self, index):
    days = period_days_of(index, self.period_days, self.train_days)
    if days[-1] >= len(self.days):
      return None
    counts = self._running(days[-1])

    def load():
      parts = [self.days[d] for d in days]
      features = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
      return features, np.concatenate([p[1] for p in parts])

    return Period(index, days, {k: len(v) for k, v in counts.items()}, load, lambda: counts)


def _read_json(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


class BeamStreamSource(PeriodSource):
  """Periods of the streaming Beam job's output directory (`pipelines/criteo_stream.py`).

  Each closed window is a subdirectory with its TFRecords, its vocabulary snapshot (sizes and
  running counts) and, written last, its `manifest.json`; a batch-job output directory (one
  top-level manifest listing `days`) is read the same way, every day being complete at once.
  """

  def __init__(self, data_dir, period_days=1, train_days=None):
    if not os.path.isdir(data_dir):
      raise DprecError(f"{data_dir}: not a directory (expected the Beam job's output)")
    self.data_dir, self.period_days, self.train_days = data_dir, period_days, train_days
    self._days: Dict[int, dict] = {}

  def _scan(self):
    """Indexes complete days: {day: its manifest entry, with absolute paths}."""
    manifests = sorted(glob.glob(os.path.join(self.data_dir, "*", MANIFEST)))
    top = os.path.join(self.data_dir, MANIFEST)
    if os.path.exists(top):
      manifests.append(top)
    for path in manifests:
      manifest = _read_json(path)
      base = os.path.dirname(path)
      for day in manifest.get("days", []):
        entry = dict(day, base=base, manifest=manifest, manifest_path=path)
        self._days.setdefault(int(day["day"]), entry)
    return self._days

  def first_day(self):
    days = self._scan()
    return min(days) if days else None

  def period(self, index):
    known = self._scan()
    if not known:
      return None
    days = period_days_of(index, self.period_days, self.train_days, min(known))
    if any(d not in known for d in days):
      return None
    last = known[days[-1]]
    snapshot = last["manifest"]
    vocab_sizes = {k: int(v) for k, v in snapshot["vocab_sizes"].items()}
    data_dir = last["base"]

    def load():
      from dprec.data import criteo_tfrecord  # pylint: disable=import-outside-toplevel
      parts = []
      for day in days:
        entry = known[day]
        parts.append(_concat(criteo_tfrecord.criteo_tfrecord_dataset(
            entry["base"], [day], batch_size=65536)))
      merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
      labels = merged.pop("label").astype(np.int32).reshape(-1)
      return merged, labels

    def counts():
      return _load_counts(data_dir, snapshot, vocab_sizes)

    return Period(index, days, vocab_sizes, load, counts)


def _concat(dataset) -> Dict[str, np.ndarray]:
  parts: Dict[str, List[np.ndarray]] = {}
  for batch in dataset.as_numpy_iterator():
    for name, value in batch.items():
      parts.setdefault(name, []).append(value)
  return {name: np.concatenate(values) for name, values in parts.items()}


def _load_counts(data_dir, manifest, vocab_sizes):
  """Running bucket counts of the snapshot: `counts.npz` ({feature: counts by id}) beside it."""
  path = os.path.join(data_dir, manifest.get("vocab_dir", "vocab"), "counts.npz")
  if not os.path.exists(path):
    raise DprecError(f"{path}: the vocabulary snapshot has no running counts, which top-k "
                     "refreshes (--top-k) need")
  with np.load(path) as data:
    return {name: np.asarray(data[name])[:size] for name, size in vocab_sizes.items()}
