"""Where a streaming run finds its periods: complete windows of the streaming Beam job.

A period is `period_days` consecutive days (Ghazi et al., "Sparsity-Preserving Differentially
Private Training of Large Embedding Models", arXiv:2311.08357, Table 5: 1, 2, 4, 8, 16, 18). It is
complete when every one of its days is listed in the manifest: the Beam job writes a window's
TFRecords and vocabulary snapshot first and replaces the manifest last, atomically, so a trainer
tailing the directory never reads a half-written period. Days past `train_days` are the hold-out
(Ghazi et al. 2023, §4.3: train on days 1–18, evaluate on 19–24); they are served as one-day
periods, for evaluation only.
"""
import abc
import dataclasses
import os
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from dprec.errors import DprecError

CATEGORICAL_KEY = "cat_features"  # int [n, F] vocabulary ids, columns in `vocab_sizes` order
Arrays = Tuple[Dict[str, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Period:
  """One complete period.

  Attributes:
    index: 0-based position in the stream.
    days: the day indices it covers.
    vocab_sizes: {feature: rows incl. OOV row 0} of the vocabulary snapshot valid for it, in
      the column order of `cat_features`.
    load: callable() -> (features {name: array[n, ...]}, labels int array[n]).
    counts: callable() -> {feature: running bucket counts through this period (index = id)}.
    examples: rows in the period (from the manifest, without loading them).
  """
  index: int
  days: Tuple[int, ...]
  vocab_sizes: Mapping[str, int]
  load: Callable[[], Arrays]
  counts: Callable[[], Mapping[str, np.ndarray]]
  examples: int


class PeriodSource(abc.ABC):
  """Serves complete periods by index (None while a period is incomplete)."""

  @abc.abstractmethod
  def period(self, index: int) -> Optional[Period]:
    """Period `index` if all its days are complete, else None."""


def period_days_of(index, period_days, train_days, first_day=0):
  """Days of period `index`: training periods cut the first `train_days` days into chunks of
  `period_days` (the last one possibly shorter); hold-out periods follow, one day each (the
  final evaluation pools all of them)."""
  if train_days is None:
    start = first_day + index * period_days
    return tuple(range(start, start + period_days))
  train_periods = -(-train_days // period_days)
  if index < train_periods:
    start = index * period_days
    return tuple(range(first_day + start, first_day + min(start + period_days, train_days)))
  return (first_day + train_days + index - train_periods,)


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

    return Period(index, days, {k: len(v) for k, v in counts.items()}, load, lambda: counts,
                  sum(len(self.days[d][1]) for d in days))


class BeamStreamSource(PeriodSource):
  """Periods of a Criteo preprocessing output (`dprec preprocess criteo [--streaming]`).

  The streaming job replaces `manifest.json` atomically after writing each closed window's
  directory; each entry lists the window's `days`, its `vocab_dir` snapshot (ids stable across
  windows, running counts) and `vocab_sizes`. A batch-job output (one vocabulary) reads the same
  way, all its days being complete. The trainer's period must be a multiple of the job's window.
  """

  def __init__(self, data_dir, period_days=1, train_days=None):
    if not os.path.isdir(data_dir):
      raise DprecError(f"{data_dir}: not a directory (expected a `dprec preprocess criteo` output)")
    self.data_dir, self.period_days, self.train_days = data_dir, period_days, train_days

  def _by_day(self):
    """({day: the manifest entry covering it}, manifest), or ({}, None) before the first window."""
    from dprec.data import criteo_tfrecord
    if not os.path.exists(os.path.join(self.data_dir, criteo_tfrecord.MANIFEST)):
      return {}, None
    manifest = criteo_tfrecord.load_manifest(self.data_dir)
    by_day = {}
    for entry in manifest["days"]:
      for day in entry.get("days", [entry["day"]]):
        by_day[int(day)] = entry
    return by_day, manifest

  def days_present(self):
    """The days the output holds now, sorted."""
    return sorted(self._by_day()[0])

  def period(self, index):
    by_day, manifest = self._by_day()
    if not by_day:
      return None
    days = period_days_of(index, self.period_days, self.train_days, min(by_day))
    if any(day not in by_day for day in days):
      return None
    entries = list({id(by_day[d]): by_day[d] for d in days}.values())
    for entry in entries:
      if not set(entry.get("days", [entry["day"]])) <= set(days):
        raise DprecError(
            f"{os.path.join(self.data_dir, 'manifest.json')}: window of day {entry['day']} covers "
            f"days {entry['days']}, which straddle the trainer's period {list(days)}; use a "
            "--period-days that is a multiple of the preprocessing job's")
    last = by_day[days[-1]]
    sizes = last.get("vocab_sizes", manifest["vocab_sizes"])
    vocab_sizes = {name: int(sizes[name]) for name in manifest["categorical_features"]}  # columns
    vocab_dir = os.path.join(self.data_dir, last.get("vocab_dir", manifest["vocab_dir"]))
    data_dir = self.data_dir

    def load():
      from dprec.data import criteo_tfrecord
      from dprec.training import poisson
      arrays = poisson.dataset_to_arrays(criteo_tfrecord.criteo_tfrecord_dataset(
          data_dir, [e["day"] for e in entries], batch_size=65536))
      return arrays, arrays.pop("label")

    def counts():
      from dprec.data.criteo import CriteoVocabulary
      vocab = CriteoVocabulary.load(vocab_dir)  # running counts of ids 1..V; OOV row 0 gets 0
      return {name: np.concatenate([[0], c]) for name, c in zip(vocab_sizes, vocab.counts)}

    return Period(index, days, vocab_sizes, load, counts, sum(int(e["rows"]) for e in entries))
