"""Criteo batch preprocessing: TSV → validated rows → vocabularies → sharded TFRecords + manifest.

    python -m pipelines.criteo --input 'data/day_*' --output out/ [--vocab-mode ...] [Beam options]

One pipeline, two reads of the input (the second after the vocabulary exists), so nothing but
bucket counts is ever held in memory: (1) per-split parse → per-feature bucket counts
(CombinePerKey) → one vocabulary (min count, top-k, or DP top-k with Gumbel noise: Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models", arXiv:2311.08357,
§2.1);
(2) per-split parse → `transform` → `tf.train.Example`s, one TFRecord file per split under
`day_N/`, dead letters `(file, line, reason, raw)` to `dead_letters/`, per-split statistics →
`stats.json` and `manifest.json`. Parsing and the transform are `dprec.data.criteo`'s (the
in-process reader's) on whole blocks of lines; nothing runs per row in Python.

The manifest names the output's rows (`dataset_id`, derived from the input files: the same input
is the same data set, `dprec.data.identity`) and says whether its
vocabulary is DP (`vocab_privacy`); a DP top-k vocabulary is charged to the ledger before
anything runs, the charge recording that data set, so training on it composes its ε.
"""
import argparse
import collections
import dataclasses
import math
import os
import secrets
import shutil
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple, Union

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from dprec import progress
from dprec.cli_help import add_deprecated_alias
from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CATEGORICAL_FEATURES
from dprec.data.criteo import CriteoVocabulary
from dprec.data.criteo import ID_DOMAIN
from dprec.data.criteo import INTEGER_FEATURES
from dprec.data.criteo import TABLE3_VOCAB_SIZES
from dprec.data.criteo import count_categories
from dprec.data.criteo import parse_bytes
from dprec.data.criteo import transform
from dprec.errors import DprecError
from pipelines import beam_io

VOCAB_MODES = ("min_count", "top_k", "dp_top_k")
DEAD_LETTERS = "dead_letters"
METRICS_NAMESPACE = "dprec.criteo"
PROGRESS = "preprocess criteo"


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


@dataclasses.dataclass(frozen=True)
class CriteoJob:
  """One batch run: inputs, output directory, vocabulary, tolerance for bad rows, ledger."""
  inputs: Tuple[str, ...]
  output: str
  vocab: VocabConfig = VocabConfig()
  max_bad_fraction: float = 0.01
  split_bytes: int = beam_io.SPLIT_BYTES
  ledger: Optional[str] = None
  epsilon_budget: Optional[float] = None
  delta: Optional[float] = None  # of a new ledger; None: 1/N, N the input's lines (`run`)
  pad_short_lines: bool = False  # read lines with fewer than 40 fields as missing trailing values
  user_column: bool = False  # lines end with a user_id field, carried into the records
  dataset_id: Optional[str] = None  # `run` derives it from the input when not given
  overwrite: bool = False  # replace an existing output directory

  def __post_init__(self):
    if isinstance(self.vocab, dict):  # its fields, as `dprec.beam_jobs.launch` passes them
      object.__setattr__(self, "vocab", VocabConfig(**self.vocab))


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


def vocab_privacy_of(job: CriteoJob) -> dict:
  """`vocab_privacy` of the job's vocabulary: its DP top-k ε (charged to the job's ledger) and
  whether its randomness was secret, or that it is not DP."""
  if job.vocab.mode != "dp_top_k":
    return identity.public_vocab_privacy(job.vocab.mode)
  from dprec.privacy import split_selection_budget
  _, epsilon = split_selection_budget(job.vocab.per_feature_k(), job.vocab.epsilon)
  return {"dp": True, "private": job.vocab.insecure_noise_seed is None, "mode": "dp_top_k",
          "epsilon": epsilon, "delta": 0.0, "ledger": identity.location(job.ledger),
          "note": _seed_note(job.vocab.insecure_noise_seed) or (
              "pure epsilon of k exponential-mechanism draws per feature (Ghazi et al. 2023, "
              "arXiv:2311.08357, §2.1), charged to the ledger for this dataset_id")}


def _seed_note(seed: Optional[int]) -> Optional[str]:
  from dprec.privacy.noise_key import INSECURE_NOTE
  return None if seed is None else INSECURE_NOTE.format(seed=seed)


def save_vocabulary(vocab: CriteoVocabulary, directory: str) -> None:
  """`CriteoVocabulary.save` into a temporary directory renamed into place (replacing any old)."""
  temporary = f"{directory}.tmp-{uuid.uuid4().hex}"
  vocab.save(temporary)
  if os.path.exists(directory):
    shutil.rmtree(directory)
  os.rename(temporary, directory)


class Finish(beam.DoFn):
  """Writes the vocabulary, `stats.json` and, unless there were too many bad rows, the manifest."""

  def __init__(self, job: CriteoJob):
    self._job = job

  def process(self, stats: ShardStats, vocab: CriteoVocabulary):
    save_vocabulary(vocab, os.path.join(self._job.output, "vocab"))
    summary = stats.summary(vocab)
    summary["vocab_mode"] = dataclasses.asdict(self._job.vocab)
    summary["vocab_mode"].pop("insecure_noise_seed")
    summary["dead_letter_files"] = os.path.join(self._job.output, DEAD_LETTERS, "*.jsonl")
    beam_io.write_json(os.path.join(self._job.output, criteo_tfrecord.STATS), summary)
    if summary["bad_fraction"] <= self._job.max_bad_fraction:
      written = manifest(stats, vocab, dataset_id=self._job.dataset_id,
                         vocab_privacy=vocab_privacy_of(self._job))
      if self._job.user_column:
        written[criteo_tfrecord.USER_COLUMN_KEY] = True
      beam_io.write_json(os.path.join(self._job.output, criteo_tfrecord.MANIFEST), written)
    yield summary


def build_pipeline(pipeline: beam.Pipeline, job: CriteoJob, splits: Sequence[beam_io.Split]):
  """Adds the batch job to `pipeline`; returns the PCollection of the final summary."""
  split_pc = pipeline | "Splits" >> beam.Create(list(splits))
  counts = (split_pc
            | "CountBuckets" >> beam.FlatMap(count_split, job.pad_short_lines, job.user_column)
            | "MergeCounts" >> beam.CombinePerKey(MergeCountsFn()))
  vocab = (counts
           | "AllFeatures" >> beam.combiners.ToList()
           | "BuildVocabulary" >> beam.Map(
               lambda pairs, config: build_vocabulary([p for _, p in sorted(
                   pairs, key=lambda kv: kv[0])], config), job.vocab))
  written = split_pc | "Write" >> beam.ParDo(
      WriteSplit(job.output, job.pad_short_lines, job.user_column), beam.pvalue.AsSingleton(vocab))
  return (written
          | "MergeStats" >> beam.CombineGlobally(MergeStatsFn())
          | "Finish" >> beam.ParDo(Finish(job), beam.pvalue.AsSingleton(vocab)))


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


def charge_selection(job: CriteoJob) -> Optional[dict]:
  """Charges DP top-k to the ledger before anything runs (refused if over budget, or if the
  ledger holds charges for another data set), as a preprocessing charge of the job (a run id of
  its own) for its output data set."""
  if job.vocab.mode != "dp_top_k":
    return None
  if not job.ledger:
    raise DprecError("--vocab-mode dp_top_k needs --ledger PATH (the privacy ledger to charge)")
  from dprec.privacy import PrivacyLedger, split_selection_budget
  from dprec.privacy.ledger import PREPROCESSING
  ks = job.vocab.per_feature_k()
  # k draws of ε_feature / k on each feature: the honest cost of one-shot top-k (Ghazi et al.
  # 2023, arXiv:2311.08357).
  per_draw, epsilon = split_selection_budget(ks, job.vocab.epsilon)
  dataset = identity.dataset_identity(job.output, job.dataset_id)
  marks = {"stage": PREPROCESSING, "dataset": dataset}
  if job.vocab.insecure_noise_seed is not None:
    marks.update(private=False, privacy_note=_seed_note(job.vocab.insecure_noise_seed))
  ledger = PrivacyLedger(job.ledger, job.epsilon_budget, job.delta,
                         run_id=f"preprocess-{secrets.token_hex(8)}", marks=marks)
  ledger.check_dataset(dataset)
  spent = ledger.charge_pure(epsilon, label=f"criteo vocabulary dp_top_k (k={ks[0]}"
                             f"{'' if len(set(ks)) == 1 else ' …'} per feature, 26 features)")
  return {"ledger": job.ledger, "epsilon_charged": epsilon,
          "epsilon_per_feature": job.vocab.epsilon / len(ks), "epsilon_per_draw": per_draw,
          "epsilon_spent": spent, "dataset": dataset}


def input_dataset_id(job: CriteoJob, paths: Sequence[str]) -> str:
  """`identity.fingerprint_id` of the input files and of the one option that changes which rows
  exist (padding short lines): the same input preprocessed again is the same data set (and
  `dprec train ctr` on the same TSV days finds the same id)."""
  return identity.fingerprint_id(paths, {"pad_short_lines": True} if job.pad_short_lines else {},
                                 open_file=beam_io.open_raw)


def check_output(job: CriteoJob) -> None:
  """Refuses (one line) an output directory that already holds files, unless `overwrite`."""
  if job.overwrite or not os.path.isdir(job.output) or not os.listdir(job.output):
    return
  old = identity.manifest_field(job.output, identity.DATASET_ID)
  held = (f"already holds data set {old[:12]}… of this same input" if old == job.dataset_id
          else f"already holds {'data set ' + old[:12] + '… (other rows)' if old else 'files'}")
  raise DprecError(f"{job.output}: {held}; pass --overwrite to replace it, or another --output")


def run(job: CriteoJob, beam_args: Sequence[str] = ()) -> dict:
  """Runs the batch job; returns `stats.json`'s content. Fails above `max_bad_fraction`."""
  paths = beam_io.match_inputs(job.inputs)
  splits = beam_io.plan_splits(paths, job.split_bytes)
  job = dataclasses.replace(job, dataset_id=job.dataset_id or input_dataset_id(job, paths))
  check_output(job)
  if job.vocab.mode == "dp_top_k":
    lines = beam_io.count_lines(paths)
    check_selection_useful(job.vocab, lines)
    # δ = 1/N of a new ledger, as training's default (N public, here all the input's lines).
    job = dataclasses.replace(job, delta=job.delta or 1.0 / max(lines, 1))
  privacy = charge_selection(job)  # refused before the output directory is touched
  beam_io.makedirs(job.output)
  for stale in (criteo_tfrecord.MANIFEST, DEAD_LETTERS):
    beam_io.remove_stale(os.path.join(job.output, stale))
  options = beam_io.pipeline_options(beam_args)
  progress.phase(PROGRESS, f"{len(paths)} input files in {len(splits)} splits (data set "
                 f"{job.dataset_id[:12]}…): counting buckets, then writing records, on "
                 f"{beam_io.runner_name(options)}")
  started = time.monotonic()
  counters = beam_io.run_pipeline(options, lambda pipeline: build_pipeline(pipeline, job, splits),
                                  METRICS_NAMESPACE)
  summary = beam_io.read_json(os.path.join(job.output, criteo_tfrecord.STATS))
  progress.phase(PROGRESS, f"{summary['rows_in']:,} rows read, {summary['rows_out']:,} written, "
                 f"{summary['dead_letters']:,} dead letters, in {time.monotonic() - started:.0f} s")
  if privacy:
    summary["privacy"] = privacy
    beam_io.write_json(os.path.join(job.output, criteo_tfrecord.STATS), summary)
  if counters is not None:  # Not every runner reports metrics (the DaskRunner does not).
    summary["beam_counters"] = counters
  beam_io.check_bad_fraction(summary["dead_letters"], summary["rows_in"], job.max_bad_fraction,
                             "rows", summary["dead_letter_files"])
  summary["output"], summary["dataset_id"] = job.output, job.dataset_id
  return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Arguments of `dprec preprocess criteo` (Beam options are passed through untouched)."""
  parser.add_argument("--input", required=True, nargs="+",
                      help="TSV files, globs or a directory of day_N files (plain or .gz)")
  parser.add_argument("--output", required=True, help="output directory")
  parser.add_argument("--vocab-mode", default="min_count", choices=VOCAB_MODES,
                      help="how buckets become ids (default min_count)")
  parser.add_argument("--vocab-min-count", type=int, default=1, dest="min_count",
                      help="keep buckets seen at least this often (default 1; `train ctr "
                      "--vocab-min-count` on TSV days)")
  add_deprecated_alias(parser.add_argument, "--min-count", "--vocab-min-count", "min_count",
                       type=int)
  parser.add_argument("--top-k-per-feature", default=None, dest="top_k", metavar="K",
                      help="top_k/dp_top_k: k for every feature, 26 comma-separated values, or "
                      "'table3' for the sizes of Ghazi et al. 2023, arXiv:2311.08357, Table 3 "
                      "(per feature; `train ctr --top-k-total` counts rows over all 26 tables)")
  add_deprecated_alias(parser.add_argument, "--top-k", "--top-k-per-feature", "top_k")
  parser.add_argument("--top-k-epsilon", type=float, default=None, dest="epsilon",
                      help="dp_top_k: total pure-DP epsilon of the selection (split over the 26 "
                      "features, each paying for its k draws)")
  add_deprecated_alias(parser.add_argument, "--epsilon", "--top-k-epsilon", "epsilon",
                       type=float)
  parser.add_argument("--insecure-noise-seed", type=int, default=None, metavar="N",
                      help="dp_top_k: derive the selection randomness from this PUBLIC seed, for "
                      "tests and experiments only: the vocabulary is then NOT differentially "
                      "private, and the ledger charge and manifest say so (default: a secret key "
                      "from the OS CSPRNG)")
  parser.add_argument("--ledger", default=None, help="dp_top_k: privacy ledger JSON to charge")
  parser.add_argument("--epsilon-budget", type=float, default=None,
                      help="budget of a new ledger (an existing ledger keeps its own)")
  parser.add_argument("--delta", type=float, default=None,
                      help="delta of a new ledger (default 1/N, N the input's lines, as training "
                      "defaults to 1/N of its rows; training adopts the ledger's delta)")
  parser.add_argument("--max-bad-fraction", type=float, default=0.01,
                      help="fail if more than this fraction of lines is malformed (default 0.01)")
  parser.add_argument("--pad-short-lines", action="store_true",
                      help="read lines with fewer than 40 fields as missing trailing values, as "
                      "copies with stripped trailing tabs need, counted in stats.json's "
                      "padded_rows (default: such lines are malformed, dead letters; a file's "
                      "last line cut without a newline always is one: the rest of the file is "
                      "missing)")
  add_deprecated_alias(parser.add_argument, "--strict-columns",
                       "no flag (short lines are malformed by default)", "pad_short_lines",
                       nargs=0)
  parser.add_argument("--user-column", action="store_true",
                      help="every line ends with a 41st field, a user id (`dprec synth criteo "
                      "--users N`), carried into the records as user_id for `train ctr "
                      "--privacy-unit user` and `dprec stream --privacy-unit user`; a line whose "
                      "id is missing or not "
                      "a non-negative integer is a dead letter (default: the 40 Criteo columns)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an existing --output directory (default: refuse one that "
                      "holds files)")


def job_from_args(args) -> CriteoJob:
  vocab = VocabConfig(mode=args.vocab_mode, min_count=args.min_count,
                      top_k=parse_top_k(args.top_k), epsilon=args.epsilon,
                      insecure_noise_seed=args.insecure_noise_seed)
  return CriteoJob(inputs=tuple(args.input), output=args.output, vocab=vocab,
                   max_bad_fraction=args.max_bad_fraction, ledger=args.ledger,
                   epsilon_budget=args.epsilon_budget, delta=args.delta,
                   pad_short_lines=args.pad_short_lines, user_column=args.user_column,
                   overwrite=args.overwrite)


def main(argv=None) -> int:
  """`python -m pipelines.criteo`; the job classes are used from the imported module, not
  `__main__`, so Beam workers can unpickle them."""
  return beam_io.job_main("criteo", __doc__, add_arguments,
                         lambda args: run(job_from_args(args), args.beam_args), argv)


if __name__ == "__main__":
  sys.exit(main())
