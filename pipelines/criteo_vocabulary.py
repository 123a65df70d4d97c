"""The Criteo jobs' vocabularies: how bucket counts become ids, merged counts, DP top-k.

Per-feature bucket counts are merged with numpy (`merge_counts`, `MergeCountsFn`), then kept by
minimum count, top-k, or DP top-k with Gumbel noise over the whole id domain (Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models", arXiv:2311.08357,
§2.1); `check_selection_useful` refuses, before anything is charged, a DP top-k that would keep
nothing. Used by the batch job (`pipelines.criteo`) and the streaming job
(`pipelines.criteo_stream`).
"""
import dataclasses
import math
import os
import shutil
import sys
import uuid
from typing import List, Optional, Sequence, Tuple, Union

import apache_beam as beam
import numpy as np

from dprec.data.criteo import ID_DOMAIN
from dprec.data.criteo import TABLE3_VOCAB_SIZES
from dprec.data.criteo import CriteoVocabulary
from dprec.data.criteo_parse import CATEGORICAL_FEATURES
from dprec.errors import DprecError

VOCAB_MODES = ("min_count", "top_k", "dp_top_k")


@dataclasses.dataclass(frozen=True)
class VocabConfig:
  """How buckets become vocabulary ids (index 0 stays OOV/missing).

  `top_k` is one k for every feature or 26 values (C1..C26). For `dp_top_k`, `epsilon` is the
  total pure-DP cost of the selection over all 26 features: each feature gets ε/26 for its k
  exponential-mechanism draws (the honest cost of one-shot Gumbel top-k, Ghazi et al. 2023,
  arXiv:2311.08357, §2.1). Each example adds one to one bucket per feature, so every feature's
  counts have sensitivity 1.
  """
  mode: str = "min_count"
  min_count: int = 1
  top_k: Union[None, int, Tuple[int, ...]] = None
  epsilon: Optional[float] = None
  insecure_noise_seed: Optional[int] = None

  def __post_init__(self):
    if self.mode not in VOCAB_MODES:
      raise DprecError(f"--vocab-mode must be one of {', '.join(VOCAB_MODES)}, got {self.mode!r}")
    if self.min_count < 1:
      raise DprecError(f"--vocab-min-count must be at least 1, got {self.min_count}")
    if self.mode != "min_count" and self.top_k is None:
      raise DprecError(f"--vocab-mode {self.mode} needs --top-k-per-feature")
    if self.mode == "dp_top_k" and not (self.epsilon and self.epsilon > 0):
      raise DprecError("--vocab-mode dp_top_k needs a positive --top-k-epsilon")
    if self.mode == "dp_top_k" and self.min_count != 1:
      raise DprecError("--vocab-min-count thresholds exact counts, which is not private: "
                       "--vocab-mode dp_top_k takes only --top-k-per-feature and --top-k-epsilon")

  def per_feature_k(self) -> List[Optional[int]]:
    if self.top_k is None or np.isscalar(self.top_k):
      return [self.top_k] * len(CATEGORICAL_FEATURES)
    if len(self.top_k) != len(CATEGORICAL_FEATURES):
      raise DprecError(f"--top-k-per-feature needs 1 or {len(CATEGORICAL_FEATURES)} values, "
                       f"got {len(self.top_k)}")
    return list(self.top_k)


def parse_top_k(text: Optional[str]):
  """`--top-k-per-feature` value: one int, 26 comma-separated ints, or `table3` (the sizes of
  Ghazi et al. 2023, arXiv:2311.08357, Table 3)."""
  if text is None:
    return None
  if text == "table3":
    return tuple(TABLE3_VOCAB_SIZES)
  try:
    values = tuple(int(v) for v in text.split(","))
  except ValueError:
    raise DprecError(f"--top-k-per-feature: expected an int, 26 comma-separated ints or 'table3', "
                     f"got {text!r}") from None
  if any(v < 1 for v in values):
    raise DprecError(f"--top-k values must be positive, got {text!r}")
  return values[0] if len(values) == 1 else values


def merge_counts(pairs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> Tuple[np.ndarray, np.ndarray]:
  """Sums `(ids, counts)` pairs into one pair with unique, sorted ids."""
  if not pairs:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  ids = np.concatenate([p[0] for p in pairs])
  counts = np.concatenate([p[1] for p in pairs])
  unique, inverse = np.unique(ids, return_inverse=True)
  return unique, np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)


class MergeCountsFn(beam.CombineFn):
  """Bucket counts of one feature, merged with numpy (never one Python object per bucket)."""

  def create_accumulator(self):
    return []

  def add_input(self, accumulator, pair):
    accumulator.append(pair)
    return [merge_counts(accumulator)] if len(accumulator) >= 16 else accumulator

  def merge_accumulators(self, accumulators):
    return [merge_counts([p for a in accumulators for p in a])]

  def extract_output(self, accumulator):
    return merge_counts(accumulator)


def dp_top_k_ids(ids: np.ndarray, counts: np.ndarray, k: int, epsilon: float,
                 rng: np.random.Generator, domain: int = ID_DOMAIN) -> np.ndarray:
  """One-shot Gumbel top-k (Ghazi et al. 2023, arXiv:2311.08357, §2.1) of one feature over its
  whole id domain; best first.

  `dprec.privacy.gumbel_top_k` with the never-seen ids of the domain as candidates counting 0; a
  slot one of them wins gets a uniformly random unseen id.
  """
  from dprec.privacy.top_k import ABSENT, gumbel_top_k
  top = gumbel_top_k(counts, k, epsilon, rng, domain)
  chosen = np.full(len(top), ABSENT, np.int64)
  chosen[top != ABSENT] = np.asarray(ids, np.int64)[top[top != ABSENT]]
  while (chosen == ABSENT).any():
    slots = np.flatnonzero(chosen == ABSENT)
    fresh = rng.integers(0, domain, size=len(slots))
    fresh[np.isin(fresh, ids) | np.isin(fresh, chosen)] = ABSENT
    chosen[slots] = fresh
  return chosen.astype(np.int64)


def build_vocabulary(counts: Sequence[Tuple[np.ndarray, np.ndarray]],
                     config: VocabConfig) -> CriteoVocabulary:
  """The vocabulary of `config.mode` from per-feature `(ids, counts)` in C1..C26 order.

  DP top-k gives each feature ε/26 (one example adds one to one bucket of every feature), keeps
  the selected ids in their noisy rank order and releases no counts (zeros): they are not private.
  """
  if config.mode == "min_count":
    return CriteoVocabulary.from_counts(counts, min_count=config.min_count)
  if config.mode == "top_k":
    return CriteoVocabulary.from_counts(counts, min_count=config.min_count,
                                        top_k=config.per_feature_k())
  from dprec.privacy import split_selection_budget
  from dprec.privacy.noise_key import NoiseKey
  rng = NoiseKey.new(config.insecure_noise_seed).numpy_rng("criteo dp_top_k")
  ks = config.per_feature_k()
  per_draw, _ = split_selection_budget(ks, config.epsilon)
  ids = tuple(dp_top_k_ids(feature_ids, feature_counts, k, k * epsilon, rng)
              for (feature_ids, feature_counts), k, epsilon in zip(counts, ks, per_draw))
  return CriteoVocabulary(ids, tuple(np.zeros(len(i), np.int64) for i in ids))


def save_vocabulary(vocab: CriteoVocabulary, directory: str) -> None:
  """`CriteoVocabulary.save` into a temporary directory renamed into place (replacing any old)."""
  temporary = f"{directory}.tmp-{uuid.uuid4().hex}"
  vocab.save(temporary)
  if os.path.exists(directory):
    shutil.rmtree(directory)
  os.rename(temporary, directory)


def check_selection_useful(vocab: VocabConfig, lines: int) -> None:
  """Refuses, before anything is charged, a DP top-k that would keep no bucket with probability
  1/2 or more in any feature, however the data look (a warning names the features where that
  holds while others can keep some).

  Feature f's draws are exponential mechanisms of ε_f/k_f (scale b = 26k/ε), their candidates
  all `ID_DOMAIN` ids, those never seen counting 0: a bucket of count c wins a draw over the
  never-seen ids with probability at most e^(c/b) / (e^(c/b) + D − lines), below 1/2 while
  c < b·ln(D − lines). No bucket counts more than the rows, at most `lines`. The check reads only
  the input's line count (the number of rows, which dprec treats as public: training's N) and
  the options; it releases nothing about the rows' contents.
  """
  from dprec.privacy import split_selection_budget
  ks = vocab.per_feature_k()
  per_draw, _ = split_selection_budget(ks, vocab.epsilon)
  log_domain = math.log(ID_DOMAIN - lines)
  needed = [log_domain / e for e in per_draw]
  hopeless = [name for name, count in zip(CATEGORICAL_FEATURES, needed) if count > lines]
  if not hopeless:
    return
  worst = int(np.argmax(needed))
  k_max = int(vocab.epsilon / len(ks) * lines / log_domain)
  epsilon_min = len(ks) * ks[worst] * log_domain / max(lines, 1)
  what = (f"a bucket needs a count above {needed[worst]:,.0f} to be kept (noise scale "
          f"26k/ε = {1 / per_draw[worst]:,.0f} against 2^32 never-seen ids, k {ks[worst]}), more "
          f"than the input's {lines:,} lines")
  fix = ("use " + (f"--top-k-per-feature {k_max} or less at this ε, " if k_max else "")
         + f"--top-k-epsilon {epsilon_min:.3g} or more at this k, or more rows")
  if len(hopeless) == len(ks):
    raise DprecError(f"--vocab-mode dp_top_k would release nothing useful: {what}; nothing "
                     f"charged; {fix}")
  print(f"warning: dp_top_k keeps nothing in {', '.join(hopeless)} (their ε is spent for "
        f"nothing): {what}; {fix}", file=sys.stderr)
