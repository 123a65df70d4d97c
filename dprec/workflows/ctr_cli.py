"""`dprec train ctr`: the command line of `dprec.workflows.ctr` (parse, then call). Parsing needs
only `ctr_options` (no TensorFlow); `run` loads the workflow."""
import argparse

from dprec.cli_help import OptionGroups
from dprec.cli_help import add_fields
from dprec.workflows import ctr_options
from dprec.workflows import data_kinds
from dprec.workflows import interrupted
from dprec.workflows import run_cli
from dprec.workflows.ctr_options import CTRTrainOptions

DESCRIPTION = """\
    dprec train ctr --data DIR --algorithm dp_adafest --epsilon 1

Trains the pCTR model of Ghazi et al., "Sparsity-Preserving Differentially Private Training of
Large Embedding Models" (arXiv:2311.08357), on Criteo TSV day files or a `dprec preprocess
criteo` output (the last day is held out for evaluation), non-privately or with DP-SGD, DP-FEST,
DP-AdaFEST or DP-AdaFEST+. σ comes from --epsilon; the ledger is paid before the steps run and
training stops at the budget; a DP run starts its logit at a DP base rate and ends with DP Platt
scaling. Ends with one line (held-out AUC and log loss beside their baselines, ε spent, δ); the
JSON summary (also the gradient-size reduction, steps/s, ...) goes to --summary-json, else
RUN_DIR/summary.json.
Guide: docs/guide/train_ctr.md.
"""
def register(subparsers):
  parser = subparsers.add_parser(
      "ctr", help="train the pCTR model with DP-SGD, DP-FEST, DP-AdaFEST or DP-AdaFEST+",
      description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_options(parser)
  parser.set_defaults(func=run, interrupted=interrupted.message)


def add_options(parser, run_directory=True):
  """Adds `train ctr`'s options to `parser` in groups by concern and returns the groups: those
  of `CTRTrainOptions`' fields (`cli_help.option`), then the run's (`run_cli`).
  `run_directory` False (`dprec audit`, which keeps no run directory, ledger, checkpoints, logs
  nor evaluation): their options are not added, and no help names them."""
  groups = OptionGroups(parser)
  defaults = CTRTrainOptions  # one source for the options of the CLI and the Python API
  add_fields(groups, defaults, omit=() if run_directory else ctr_options.RUN_DIRECTORY_ONLY,
             run_directory=run_directory)
  run_cli.add_run_arguments(
      groups, defaults,
      randomness="noise, batches, DP top-k draws, the DP base rate and Platt scaling",
      diagnostics="exact training loss/AUC",
      run_dir_help="keep the run's id, secret noise key (DIR/secret: keep it private), ledger "
                   "and checkpoints here; rerunning the same command resumes a killed run from "
                   "its last checkpoint (same batches and noise, no step paid twice)"
      if run_directory else None)
  run_cli.add_fit_arguments(groups, defaults, run_directory)
  return groups


def run(args) -> int:
  data_kinds.refuse_other_commands_data(args.data, "train ctr")
  algorithm, epsilon = ctr_options.algorithm_and_epsilon(args.algorithm, args.epsilon,
                                                     CTRTrainOptions.algorithm)
  # TensorFlow loads here, after the arguments parsed.
  from dprec.workflows import ctr as workflow
  from dprec.workflows import result
  from dprec.workflows import run_summary
  options = run_cli.options_from_args(CTRTrainOptions, args, algorithm=algorithm, epsilon=epsilon,
                                      beam_options=tuple(args.beam_options))
  summary = workflow.run(options)
  return run_summary.report(summary, options, result.train_ctr(summary))
