"""Criteo batch preprocessing: TSV → validated rows → vocabularies → sharded TFRecords + manifest.

    python -m pipelines.criteo --input 'data/day_*' --output out/ [--vocab-mode ...] [Beam options]

One pipeline, two reads of the input (the second after the vocabulary exists), so nothing but
bucket counts is ever held in memory: (1) per-split parse → per-feature bucket counts
(CombinePerKey) → one vocabulary (min count, top-k, or DP top-k with Gumbel noise: Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models", arXiv:2311.08357,
§2.1);
(2) per-split parse → `transform` → `tf.train.Example`s, one TFRecord file per split under
`day_N/`, dead letters `(file, line, reason, raw)` to `dead_letters/`, per-split statistics →
`stats.json` and `manifest.json`. The vocabularies are `pipelines.criteo_vocabulary`'s, the
records, dead letters and statistics of a split `pipelines.criteo_shards`'s; this module plans
the job, charges its selection, builds the pipeline and takes its options.

The manifest names the output's rows (`dataset_id`, derived from the input files: the same input
is the same data set, `dprec.data.identity`) and says whether its
vocabulary is DP (`vocab_privacy`); a DP top-k vocabulary is charged to the ledger before
anything runs, the charge recording that data set, so training on it composes its ε.
"""
import argparse
import dataclasses
import os
import secrets
import sys
import time
from typing import Optional, Sequence, Tuple

import apache_beam as beam

from dprec import progress
from dprec.cli_help import add_deprecated_alias
from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CriteoVocabulary
from dprec.errors import DprecError
from pipelines import beam_io
from pipelines.criteo_shards import DEAD_LETTERS
from pipelines.criteo_shards import METRICS_NAMESPACE
from pipelines.criteo_shards import MergeStatsFn
from pipelines.criteo_shards import ShardStats  # also where older stream states name it (pickle)
from pipelines.criteo_shards import WriteSplit
from pipelines.criteo_shards import count_split
from pipelines.criteo_shards import manifest
from pipelines.criteo_vocabulary import VOCAB_MODES
from pipelines.criteo_vocabulary import MergeCountsFn
from pipelines.criteo_vocabulary import VocabConfig
from pipelines.criteo_vocabulary import build_vocabulary
from pipelines.criteo_vocabulary import check_selection_useful
from pipelines.criteo_vocabulary import parse_top_k
from pipelines.criteo_vocabulary import save_vocabulary

PROGRESS = "preprocess criteo"


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
  parser.add_argument("--vocab-mode", default=VocabConfig.mode, choices=VOCAB_MODES,
                      help="how buckets become ids (default %(default)s)")
  parser.add_argument("--vocab-min-count", type=int, default=VocabConfig.min_count,
                      dest="min_count",
                      help="keep buckets seen at least this often (default %(default)s; `train "
                      "ctr --vocab-min-count` on TSV days)")
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
  parser.add_argument("--max-bad-fraction", type=float, default=CriteoJob.max_bad_fraction,
                      help="fail if more than this fraction of lines is malformed (default "
                      "%(default)s)")
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
