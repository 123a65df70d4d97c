"""`dprec stream`: the command line of `dprec.workflows.stream` (parse, then call). Parsing needs
only `stream_options` (no TensorFlow); `run` loads the workflow."""
import argparse

from dprec.cli_help import OptionGroups
from dprec.cli_help import add_fields
from dprec.workflows import ctr_options
from dprec.workflows import data_kinds
from dprec.workflows import interrupted
from dprec.workflows import result
from dprec.workflows import run_cli
from dprec.workflows import run_summary
from dprec.workflows.stream_options import StreamOptions

DESCRIPTION = """\
    dprec preprocess criteo --streaming --input DAYS_DIR --output OUT ...   # writes periods
    dprec stream --data OUT --algorithm dp_adafest --epsilon 1 --period-days 1 \\
        --train-days 18 --run-dir RUN --summary-json summary.json

Trains the pCTR model period by period as the streaming Beam job writes periods, evaluating each
new period before training on it, with one privacy ledger for the whole run. Rerunning the same
command resumes a killed run. --privacy-unit says what ε protects: a row (its period's training
and the shared releases) or a user (every period). Ends with one line (the last held-out
period's AUC and log loss beside their baselines, ε spent, δ); the JSON summary goes to
--summary-json and RUN_DIR/summary.json, beside metrics.csv, TensorBoard logs and a plot.
Guide: docs/guide/stream.md.
"""


def register(subparsers):
  parser = subparsers.add_parser(
      "stream", help="train period by period on a streaming Criteo output (one privacy ledger)",
      description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
  defaults = StreamOptions  # one source for the options of the CLI and the Python API
  groups = OptionGroups(parser)
  add_fields(groups, defaults)  # its fields' options (`cli_help.option`), then the run's
  run_cli.add_run_arguments(
      groups, defaults, randomness="batches, noise and DP top-k draws",
      diagnostics="exact period sizes, batch sizes, training losses",
      run_dir_help="run id, secret noise key (DIR/secret: keep it private), checkpoints, "
                   "ledger, metrics.csv, TensorBoard logs, plot (default %(default)s)")
  parser.set_defaults(func=run, interrupted=interrupted.message)


def run(args):
  data_kinds.refuse_other_commands_data(args.data, "stream")
  algorithm, epsilon = ctr_options.algorithm_and_epsilon(args.algorithm, args.epsilon_total,
                                                     StreamOptions.algorithm)
  options = run_cli.options_from_args(StreamOptions, args, algorithm=algorithm,
                                      epsilon_total=epsilon)
  from dprec.workflows import stream  # TensorFlow loads here, after the arguments parsed
  summary = stream.run(options)
  return run_summary.report(summary, options, result.stream(summary))
