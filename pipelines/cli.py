"""`dprec preprocess criteo|sequences`: the Beam jobs on the command line.

Every option the job does not know is handed to Beam's `PipelineOptions` unchanged, so the same
command runs on the embedded multi-process DirectRunner (the default) or, with `--runner` and its
options, on Dask, Dataflow, Flink or Spark.
"""
import argparse

from dprec.cli_help import mark_advanced
from dprec.errors import DprecError
from pipelines.beam_io import BEAM_EPILOG
from pipelines.beam_io import INTERRUPTED
from pipelines.beam_io import STREAM_INTERRUPTED
from pipelines.beam_io import STREAMING_EPILOG
from pipelines.beam_io import BeamArgumentParser
from pipelines.beam_io import add_runner_arguments


CRITEO = """\
    dprec preprocess criteo --input data/criteo --output out [--vocab-mode ...] [Beam options]
    dprec preprocess criteo --streaming --input incoming/ --output stream_out --idle-timeout 600

Criteo TSV day files (plain or gzip) → validated rows → per-feature vocabularies (every bucket seen
--vocab-min-count times, the --top-k-per-feature most frequent, or a DP top-k selection charged to
--ledger) → sharded TFRecords per day, a manifest that `dprec train ctr` and `dprec stream` read,
stats.json, and malformed lines as dead letters (file, line, reason). With --streaming the job
watches the --input directory for day_N files and writes each closed period as it completes, ids
kept stable across periods. Guide: docs/guide/preprocess.md.
"""


def _interrupted_in_one_line(run):
  """`run` with Ctrl-C as a one-line error saying what the output then is (Beam's own logs of
  it held back: `beam_io.run_pipeline`)."""
  def job(args) -> dict:
    try:
      return run(args)
    except KeyboardInterrupt:
      streaming = getattr(args, "streaming", False)
      raise DprecError(STREAM_INTERRUPTED if streaming else INTERRUPTED) from None
  return job


@_interrupted_in_one_line
def run_criteo(args) -> dict:
  """Batch job, or with `--streaming` the directory-watching job."""
  if args.streaming:
    from pipelines import criteo_stream
    return criteo_stream.run(criteo_stream.job_from_args(args), args.beam_args)
  from pipelines import criteo
  return criteo.run(criteo.job_from_args(args), args.beam_args)


@_interrupted_in_one_line
def run_sequences(args) -> dict:
  from pipelines import sequences
  return sequences.run(sequences.job_from_args(args), args.beam_args)


# `preprocess criteo`'s options most runs leave at their defaults: listed by --help-all only.
CRITEO_LESS_USED = ("insecure_noise_seed", "max_bad_fraction", "poll_seconds", "stop_after_day",
                    "settle_seconds")


def add_jobs(jobs) -> None:
  """Adds the `criteo` and `sequences` parsers to a sub-parser group of `BeamArgumentParser`s."""
  from pipelines import criteo, criteo_stream, sequences
  raw = argparse.RawDescriptionHelpFormatter
  parser = jobs.add_parser("criteo", help="Criteo TSV → vocabularies + TFRecords (batch or "
                           "--streaming)", description=CRITEO,
                           epilog=BEAM_EPILOG + STREAMING_EPILOG, formatter_class=raw)
  criteo.add_arguments(parser)
  parser.add_argument("--streaming", action="store_true",
                      help="watch the --input directory for day_N files and write each closed "
                      "period as it completes (options below)")
  criteo_stream.add_arguments(parser.add_argument_group("streaming"))
  add_runner_arguments(parser)
  mark_advanced(parser, CRITEO_LESS_USED)
  parser.set_defaults(func=run_criteo)
  parser = jobs.add_parser("sequences", help="interaction logs → per-user sequences + TFRecords",
                           description=sequences.__doc__, epilog=BEAM_EPILOG,
                           formatter_class=raw)
  sequences.add_arguments(parser)
  add_runner_arguments(parser)
  parser.set_defaults(func=run_sequences)


def register(subparsers) -> None:
  """Adds `preprocess` to the `dprec` command."""
  parser = subparsers.add_parser(
      "preprocess", help="Apache Beam preprocessing jobs (Criteo, interaction sequences)",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_jobs(parser.add_subparsers(dest="job", metavar="JOB", required=True,
                                 parser_class=BeamArgumentParser))
