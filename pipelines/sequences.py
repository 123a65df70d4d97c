"""Interaction logs → per-user item sequences for sequential recommendation.

    python -m pipelines.sequences --input ratings.dat --format movielens --output OUT \
        [--min-count 5]

Formats: `movielens` (`ratings.dat` with `::` or `u.data` with tabs: user, item, rating, time),
`sasrec` (`user item` lines already in time order; the line order is the time) and `csv`
(`user,item,timestamp`, an optional header line). Lines are parsed in parallel blocks; malformed
ones become dead letters `(file, line, reason, raw)`. The filtering step needs every action's
(user, item) once, so it runs on one worker with numpy (16 bytes an action): iterative k-core
(users and items with fewer than `--min-count` actions removed until none is left; `sasrec`
defaults to no filtering because its files are filtered already), time-ordered sequences,
leave-last-out split (test = last item, validation = second to last unless `--no-validation`),
and item frequencies p_i = share of users whose training sequence contains item i (Re-Attention's
input in DPFormer: Ding et al., "DPFormer: Learning Differentially Private Transformer on
Long-Tailed Data", arXiv:2305.17633).
Items are re-indexed 1..M and users 1..U in the order of their original ids (0 = padding/none).
"""
import argparse
import collections
import dataclasses
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from dprec import progress
from dprec.data import identity
from dprec.data import sequences as sequence_data
from dprec.errors import DprecError
from pipelines import beam_io

FORMATS = ("movielens", "sasrec", "csv")
SHARD_USERS = 50_000
METRICS_NAMESPACE = "dprec.sequences"
PROGRESS = "preprocess sequences"


@dataclasses.dataclass(frozen=True)
class SequencesJob:
  """One run: input files and format, output, k-core threshold, split, bad-row tolerance."""
  inputs: Tuple[str, ...]
  input_format: str
  output: str
  min_count: Optional[int] = None
  validation: bool = True
  max_bad_fraction: float = 0.01
  dataset_id: Optional[str] = None  # `run` derives it from the input when not given

  def __post_init__(self):
    if self.input_format not in FORMATS:
      raise DprecError(f"--format must be one of {', '.join(FORMATS)}, got {self.input_format!r}")
    if self.min_count is not None and self.min_count < 1:
      raise DprecError(f"--min-count must be at least 1, got {self.min_count}")

  @property
  def k_core(self) -> int:
    """The k of the iterative k-core; 1 keeps everything (the `sasrec` default)."""
    if self.min_count is not None:
      return self.min_count
    return 1 if self.input_format == "sasrec" else 5


@dataclasses.dataclass
class Actions:
  """Parsed interactions of a block: original ids (as text), time, line number."""
  users: np.ndarray
  items: np.ndarray
  times: np.ndarray
  lines: np.ndarray
  path_index: np.ndarray

  @classmethod
  def concatenate(cls, parts: Sequence["Actions"]) -> "Actions":
    fields = [f.name for f in dataclasses.fields(cls)]
    if not parts:
      return cls(*(np.zeros(0, np.int64) for _ in fields))
    return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields))


def parse_interactions(block: beam_io.LineBlock, input_format: str, path_index: int):
  """(`Actions`, dead letters) of one block of lines of `input_format`."""
  users, items, times, lines, letters = [], [], [], [], []
  text = block.data.decode("utf-8", errors="replace").split("\n")
  if text and text[-1] == "":
    text.pop()
  for offset, raw in enumerate(text):
    line = block.first_line + offset
    reason = None
    if input_format == "movielens":
      fields = raw.split("::") if "::" in raw else raw.split()
      if len(fields) != 4:
        reason = f"line: expected 4 fields (user, item, rating, timestamp), found {len(fields)}"
    elif input_format == "sasrec":
      fields = raw.split()
      if len(fields) != 2:
        reason = f"line: expected 2 fields (user item), found {len(fields)}"
      fields = fields + [str(line)]
    else:
      fields = [f.strip() for f in raw.split(",")]
      if len(fields) != 3:
        reason = f"line: expected 3 fields (user,item,timestamp), found {len(fields)}"
      elif line == 1 and not _is_number(fields[2]):
        continue  # A header line.
      fields = fields + [""]
    if reason is None:
      user, item, time = fields[0], fields[1], fields[3] if input_format == "movielens" else \
          fields[2]
      if not user or not item:
        reason = "user/item: empty id"
      elif not _is_number(time):
        reason = f"timestamp: not a number: {time!r}"
    if reason is not None:
      letters.append(beam_io.DeadLetter(block.path, line, reason, raw))
      continue
    users.append(user)
    items.append(item)
    times.append(float(time))
    lines.append(line)
  actions = Actions(np.asarray(users, dtype=str), np.asarray(items, dtype=str),
                    np.asarray(times, np.float64), np.asarray(lines, np.int64),
                    np.full(len(users), path_index, np.int64))
  return actions, letters


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def iterative_k_core(users: np.ndarray, items: np.ndarray, k: int) -> Tuple[np.ndarray, int]:
  """Mask of actions left when users and items with < k actions are removed until stable."""
  keep = np.ones(len(users), bool)
  rounds = 0
  while k > 1:
    user_counts = np.bincount(users[keep], minlength=users.max(initial=0) + 1)
    item_counts = np.bincount(items[keep], minlength=items.max(initial=0) + 1)
    new_keep = keep & (user_counts[users] >= k) & (item_counts[items] >= k)
    rounds += 1
    if new_keep.sum() == keep.sum():
      break
    keep = new_keep
  return keep, rounds


def reindex(ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Codes 1..N for ids (text) in the order of the original ids (numeric order if all are
  integers), and the original id of each code."""
  unique, inverse = np.unique(ids, return_inverse=True)
  if len(unique) and np.char.isdigit(unique).all():
    order = np.argsort(unique.astype(np.int64), kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse] + 1, unique[order]
  return inverse + 1, unique


def build_sequences(actions: Actions, job: SequencesJob) -> dict:
  """k-core, per-user time-ordered sequences, leave-last-out split, item frequencies."""
  all_users, all_items = reindex(actions.users)[0], reindex(actions.items)[0]
  keep, rounds = iterative_k_core(all_users, all_items, job.k_core)
  items, item_ids = reindex(actions.items[keep])
  users, user_ids = reindex(actions.users[keep])
  order = np.lexsort((actions.lines[keep], actions.path_index[keep], actions.times[keep], users))
  users, items = users[order], items[order]
  starts = np.flatnonzero(np.diff(users)) + 1
  sequences = np.split(items, starts) if len(users) else []
  held_out = 2 if job.validation else 1
  train, valid, test = [], [], []
  for sequence in sequences:
    if len(sequence) <= held_out:  # Too short to hold items out: all of it trains (SASRec).
      train.append(sequence)
      valid.append(0)
      test.append(0)
      continue
    train.append(sequence[:-held_out])
    valid.append(int(sequence[-2]) if job.validation else 0)
    test.append(int(sequence[-1]))
  contains = np.zeros(len(item_ids) + 1, np.int64)
  for sequence in train:
    contains[np.unique(sequence)] += 1
  valid, test = np.asarray(valid, np.int64), np.asarray(test, np.int64)
  return {"train": train, "valid": valid, "test": test,
          "item_frequencies": contains / max(len(train), 1),
          "user_ids": user_ids, "item_ids": item_ids,
          "stats": {"users": len(train), "items": len(item_ids), "actions": int(len(items)),
                    "input_actions": int(len(actions.users)),
                    "input_users": int(all_users.max(initial=0)),
                    "input_items": int(all_items.max(initial=0)), "k_core": job.k_core,
                    "k_core_rounds": rounds, "validation": job.validation,
                    "train_actions": int(sum(len(s) for s in train)),
                    "valid_users": int((valid > 0).sum()), "test_users": int((test > 0).sum()),
                    "item_frequencies_from": "train_items"}}


def check_not_empty(stats: dict) -> None:
  """Refuses a job whose filters left no user (its manifest was withheld), with the counts
  before and after each filter and the option that would keep more."""
  if stats["users"]:
    return
  parsed = (f"{stats['lines_in']} lines, {stats['dead_letters']} malformed → "
            f"{stats['input_actions']} actions of {stats['input_users']} users and "
            f"{stats['input_items']} items")
  if not stats["input_actions"]:
    raise DprecError(f"no sequences: {parsed}; nothing to write (check --input and --format)")
  raise DprecError(
      f"no sequences: {parsed}; the {stats['k_core']}-core (users and items with fewer than "
      f"{stats['k_core']} actions removed until none is left) leaves 0 actions, "
      f"0 users, 0 items; lower --min-count (e.g. --min-count 2, or 1 for no filtering); no "
      "manifest written")


class ParseBlocks(beam.DoFn):
  """`LineBlock`s → (`Actions` or None, dead letters) pairs, counted in Beam metrics.

  One output, not a tagged one for the dead letters: Beam's DaskRunner does not separate tagged
  outputs (its main output then held the dead letters too).
  """

  def __init__(self, input_format: str, paths: Sequence[str]):
    self._format = input_format
    self._paths = list(paths)

  def process(self, item):
    if isinstance(item, beam_io.DeadLetter):
      actions, letters = None, [item]
    else:
      actions, letters = parse_interactions(item, self._format, self._paths.index(item.path))
    Metrics.counter(METRICS_NAMESPACE, "lines_in").inc(
        len(letters) + (0 if actions is None else len(actions.users)))
    Metrics.counter(METRICS_NAMESPACE, "dead_letters").inc(len(letters))
    yield actions, letters


class WriteSequences(beam.DoFn):
  """Writes the sequence TFRecords, id maps, item frequencies, stats and manifest."""

  def __init__(self, job: SequencesJob):
    self._job = job

  def process(self, parsed: List[Tuple[Optional[Actions], List[beam_io.DeadLetter]]]):
    job = self._job
    actions = Actions.concatenate([a for a, _ in parsed if a is not None])
    letters = [letter for _, block_letters in parsed for letter in block_letters]
    lines_in = len(actions.users) + len(letters)
    bad_fraction = len(letters) / lines_in if lines_in else 0.0
    result = build_sequences(actions, job)
    stats = dict(result["stats"], dead_letters=len(letters), lines_in=lines_in,
                 bad_fraction=bad_fraction,
                 bad_rows_by_reason=dict(collections.Counter(
                     beam_io.reason_kind(l.reason) for l in letters)))
    out = job.output
    beam_io.write_dead_letters(os.path.join(out, "dead_letters.jsonl"),
                               sorted(letters, key=lambda l: (l.path, l.line)))
    beam_io.write_json(os.path.join(out, sequence_data.STATS), stats)
    if bad_fraction > job.max_bad_fraction or not stats["users"]:
      yield stats
      return
    files = sequence_data.write_sequences(out, result, SHARD_USERS)
    manifest = {"format": sequence_data.FORMAT, "files": files, "users": stats["users"],
                "items": stats["items"], "actions": stats["actions"],
                "validation": job.validation, "item_frequencies": sequence_data.FREQUENCIES,
                "item_ids": sequence_data.ITEM_IDS, "user_ids": sequence_data.USER_IDS,
                identity.DATASET_ID: job.dataset_id,
                "vocab_privacy": identity.public_vocab_privacy(f"{job.k_core}-core items")}
    beam_io.write_json(os.path.join(out, sequence_data.MANIFEST), manifest)
    yield stats


def build_pipeline(pipeline: beam.Pipeline, job: SequencesJob, paths: Sequence[str]):
  splits = beam_io.plan_splits(paths)
  return (pipeline
          | "Splits" >> beam.Create(splits)
          | "Read" >> beam.FlatMap(beam_io.read_split)
          | "Parse" >> beam.ParDo(ParseBlocks(job.input_format, paths))
          | "AllBlocks" >> beam.combiners.ToList()
          | "Sequences" >> beam.ParDo(WriteSequences(job)))


def run(job: SequencesJob, beam_args: Sequence[str] = ()) -> dict:
  """Runs the job; returns `stats.json`. Fails (no manifest) above `max_bad_fraction` or when
  the filters leave no user."""
  paths = beam_io.match_inputs(job.inputs)
  # The same input and filter are the same rows, so the same data set (`identity`).
  job = dataclasses.replace(job, dataset_id=job.dataset_id or identity.fingerprint_id(
      paths, {"format": job.input_format, "k_core": job.k_core}, open_file=beam_io.open_raw))
  beam_io.makedirs(job.output)
  beam_io.remove_stale(os.path.join(job.output, sequence_data.MANIFEST))
  options = beam_io.pipeline_options(beam_args)
  progress.phase(PROGRESS, f"{len(paths)} input files: parsing, then the {job.k_core}-core and "
                 f"the sequences, on {beam_io.runner_name(options)}")
  started = time.monotonic()
  counters = beam_io.run_pipeline(options, lambda pipeline: build_pipeline(pipeline, job, paths),
                                  METRICS_NAMESPACE)
  stats = beam_io.read_json(os.path.join(job.output, sequence_data.STATS))
  progress.phase(PROGRESS, f"{stats['lines_in']:,} lines read, {stats['dead_letters']:,} dead "
                 f"letters, {stats['users']:,} users kept, in {time.monotonic() - started:.0f} s")
  if counters is not None:  # Not every runner reports metrics (the DaskRunner does not).
    stats["beam_counters"] = counters
  beam_io.check_bad_fraction(stats["dead_letters"], stats["lines_in"], job.max_bad_fraction,
                             "lines", os.path.join(job.output, "dead_letters.jsonl"))
  check_not_empty(stats)
  stats["output"] = job.output
  return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--input", required=True, nargs="+", help="interaction file(s) or glob")
  parser.add_argument("--format", required=True, choices=FORMATS, dest="input_format",
                      help="movielens (ratings.dat '::' or u.data tabs), sasrec ('user item' "
                      "in time order) or csv (user,item,timestamp)")
  parser.add_argument("--output", required=True, help="output directory")
  parser.add_argument("--min-count", type=int, default=None,
                      help="iterative k-core: drop users/items with fewer actions until stable "
                      "(default 5; none for sasrec, whose files are already filtered)")
  parser.add_argument("--no-validation", action="store_true",
                      help="hold out only the last item (test), not the second to last")
  parser.add_argument("--max-bad-fraction", type=float, default=0.01,
                      help="fail if more than this fraction of lines is malformed (default 0.01)")


def job_from_args(args) -> SequencesJob:
  return SequencesJob(inputs=tuple(args.input), input_format=args.input_format,
                      output=args.output, min_count=args.min_count,
                      validation=not args.no_validation, max_bad_fraction=args.max_bad_fraction)


def main(argv=None) -> int:
  """`python -m pipelines.sequences`; the job classes are used from the imported module, not
  `__main__`, so Beam workers can unpickle them."""
  return beam_io.job_main("sequences", __doc__, add_arguments,
                         lambda args: run(job_from_args(args), args.beam_args), argv)


if __name__ == "__main__":
  sys.exit(main())
