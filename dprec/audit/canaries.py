"""pCTR canaries: examples whose every categorical id is a fresh row only that canary touches.

Canary i (of m) looks up row V_f + i of each table f (the tables grow by m rows), has all-zero
integer features and label 1, so its influence on training shows up in its own rows: unchanged
unless some step updates them (kept by DP-AdaFEST's noisy count or as a false positive, in the
DP-FEST set, or any row under DP-SGD). Each canary joins the training data with probability 1/2.
At the user level a canary is a user of k rows: k copies of its row under a fresh user id.
"""
import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np

from dprec.models import ctr
from dprec.privacy_unit import USER_KEY


@dataclasses.dataclass
class CTRCanaries:
  """m canaries: `features` ({cat, int} arrays [m, ...]), `labels` [m], `included` [m] bool,
  `rows` [m, F] (each canary's row per table) and the grown `vocab_sizes`."""
  features: Dict[str, np.ndarray]
  labels: np.ndarray
  included: np.ndarray
  rows: np.ndarray
  vocab_sizes: Tuple[int, ...]


def make_ctr_canaries(vocab_sizes, num_integer_features: int, count: int,
                      rng: np.random.Generator) -> CTRCanaries:
  """`count` canaries on fresh rows appended to tables of `vocab_sizes` rows."""
  sizes = np.asarray(vocab_sizes, np.int64)
  rows = sizes[np.newaxis, :] + np.arange(count, dtype=np.int64)[:, np.newaxis]
  features = {ctr.CAT_FEATURES: rows.astype(np.int32),
              ctr.INT_FEATURES: np.zeros([count, num_integer_features], np.float32)}
  return CTRCanaries(features, np.ones(count, np.float32), rng.random(count) < 0.5, rows,
                     tuple(int(v) for v in sizes + count))


def with_canaries(train: Dict[str, np.ndarray], canaries: CTRCanaries,
                  rows_per_user: Optional[int] = None) -> Dict[str, np.ndarray]:
  """`train` (a `dprec.data.criteo.transform` dict) plus the included canaries, shuffled in
  place of the ordering (Poisson batches ignore order anyway); with `rows_per_user` k, each
  included canary k rows of a user of its own (ids after the largest of `train`'s `USER_KEY`)."""
  keep = np.flatnonzero(canaries.included)
  keys = (ctr.CAT_FEATURES, ctr.INT_FEATURES, "label")
  added = dict(canaries.features, label=canaries.labels)
  if rows_per_user is not None:
    keep = np.repeat(keep, rows_per_user)
    first = int(np.max(train[USER_KEY], initial=-1)) + 1
    added[USER_KEY], keys = first + np.arange(len(canaries.labels)), keys + (USER_KEY,)
  return {key: np.concatenate([np.asarray(train[key]), added[key][keep].astype(
      np.asarray(train[key]).dtype)]) for key in keys}
