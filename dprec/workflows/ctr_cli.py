"""`dprec train ctr`: the command line of `dprec.workflows.ctr` (parse, then call). Parsing needs
only `ctr_options` (no TensorFlow); `run` loads the workflow."""
import argparse

from dprec.cli_help import OptionGroups
from dprec.cli_help import add_deprecated_alias
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
GHAZI = "Ghazi et al. 2023, arXiv:2311.08357"  # the paper of DP-FEST and DP-AdaFEST
STACK_MULTIPLE = 8  # `--stack-tables` without M: Table 3's 20 widths in 5 stacks

def int_list(text):
  """argparse type of `--hidden-units`: comma-separated positive widths."""
  try:
    values = tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
  return values


def add_step_arguments(groups, defaults):
  """The DP step's options (noise ratio, τ, clips, optimizer), shared by `train ctr` and
  `stream`; `groups`: the command's `OptionGroups`; `defaults`: its options class."""
  privacy, training = groups.privacy, groups.training
  privacy.add("--l2-norm-clip", type=float, default=defaults.l2_norm_clip,
              help="per-example gradient clip C2 (small clips, e.g. 1, clip nearly every "
                   "example: the best AUC, with logits at the label median, which "
                   "--calibration-share recalibrates)")
  privacy.add("--ratio", type=float, default=defaults.ratio, advanced=True,
              help="DP-AdaFEST noise ratio r = σ1/σ2")
  privacy.add("--threshold", type=float, default=defaults.threshold, advanced=True,
              help="DP-AdaFEST threshold τ on noisy counts")
  privacy.add("--contribution-clip", type=float, default=defaults.contribution_clip,
              advanced=True, help="DP-AdaFEST contribution clip C1")
  training.add("--learning-rate", type=float, default=defaults.learning_rate,
               help="learning rate (default: " + (
                   f"{defaults.learning_rate:g}" if defaults.learning_rate is not None else
                   ", ".join(f"{rate:g} {run}"
                             for run, rate in ctr_options.DEFAULT_LEARNING_RATES.items()))
               + "; for --optimizer adam)")
  training.add("--optimizer", default=defaults.optimizer, advanced=True,
               choices=sorted(name for name in ctr_options.OPTIMIZER_NAMES  # table_sgd: ctr's
                              if name != "table_sgd" or hasattr(defaults, "table_learning_rate")),
               help="row-sparse optimizer applying the noisy gradient (adam = lazy Adam; adambc "
                    "= DP-AdamBC: Adam with the noise variance subtracted, Tang et al. 2024, "
                    "arXiv:2411.04205)")
  training.add("--adambc-floor", type=float, default=defaults.adambc_floor, advanced=True,
               help="γ' of --optimizer adambc: floor of the corrected second moment")


def register(subparsers):
  parser = subparsers.add_parser(
      "ctr", help="train the pCTR model with DP-SGD, DP-FEST, DP-AdaFEST or DP-AdaFEST+",
      description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_options(parser)
  parser.set_defaults(func=run, interrupted=interrupted.message)


def add_options(parser, run_directory=True):
  """Adds `train ctr`'s options to `parser` in groups by concern and returns the groups.
  `run_directory` False (`dprec audit`, which keeps no run directory, ledger, checkpoints, logs
  nor evaluation): their options are not added, and no help names them."""
  groups = OptionGroups(parser)
  data, privacy, model, training = groups.data, groups.privacy, groups.model, groups.training
  defaults = CTRTrainOptions  # one source for the defaults of the CLI and the Python API
  data.add("--data", required=True, help="directory of Criteo TSV day_N files, or a Beam output "
           "dir")
  data.add("--vocab", advanced=True,
           help="directory of a saved (public) CriteoVocabulary instead of building one")
  data.add("--vocab-min-count", type=int, default=defaults.vocab_min_count, advanced=True,
           help="min count of an id kept in the vocabulary")
  data.add("--out-of-core", action="store_true",
           help="for more rows than memory holds: a Beam job writes the run's Poisson batches "
                "(one shard per step, drawn from the run's key) and training streams them; the "
                "base rate, calibration and evaluation are streaming passes (memory grows with "
                "B and the model, not with N; slower): docs/guide/train_ctr.md, 'Data larger "
                "than memory'. Without it, runs above --out-of-core-above rows train out of core")
  data.add("--out-of-core-above", type=int, default=defaults.out_of_core_above, metavar="ROWS",
           advanced=True,
           help="train out of core when the training rows (the manifest's count, or TSV bytes / "
                "240) exceed ROWS and the options allow it (default %(default)s: ~8.6 GB in "
                "memory)")
  data.add("--runner", default=defaults.runner, advanced=True,
           help="out of core: the Beam runner of its jobs (default: embedded; DaskRunner, "
                "DataflowRunner, ...)")
  data.add("--dask-workers", type=int, default=defaults.dask_workers, metavar="N", advanced=True,
           help="out of core with --runner DaskRunner: the local Dask cluster's worker "
                "processes")
  data.add("--beam-option", dest="beam_options", action="append", default=[],
           metavar="NAME=VALUE", advanced=True,
           help="out of core: another Beam pipeline option (e.g. dask_client_address=HOST:PORT)"
                "; repeatable")

  privacy.add("--algorithm", choices=ctr_options.ALGORITHMS,
              help=ctr_options.algorithm_help(defaults.algorithm))
  privacy.add("--epsilon", type=float,
              help="privacy budget ε, the total" + (
                  ": what --ledger spent on this data before (e.g. a DP top-k vocabulary) is "
                  "composed in" if run_directory else "") + " (required unless non_private); "
              "'inf': --algorithm non_private")
  privacy.add("--delta", type=float,
              help="δ (default: " + ("the --ledger's if it exists, else " if run_directory
                                     else "") + "1/N, N = training rows; 1/U, U = training "
              "users, at --privacy-unit user)")
  privacy.add("--privacy-unit", choices=ctr_options.PRIVACY_UNITS, default=defaults.privacy_unit,
              help="what ε protects: a row, or a user (all rows with one user_id: the day files' "
                   "41st field, as `dprec synth criteo --users N` writes; a user-level ledger, δ "
                   "1/U; in memory, on one device): docs/guide/train_ctr.md, 'The privacy unit' "
                   "(default: %(default)s)")
  privacy.add("--max-rows-per-user", type=int, default=defaults.max_rows_per_user, metavar="K",
              help="--privacy-unit user: k, the most rows of a user a step or a release reads "
                   "(drawn by the run's key; public, never read off the data) "
                   f"(default: {ctr_options.DEFAULT_MAX_ROWS_PER_USER})")
  privacy.add("--user-sampling", choices=ctr_options.USER_SAMPLINGS,
              default=defaults.user_sampling,
              help="--privacy-unit user: users (each step Poisson-samples users at q = B / U, each "
                   "sampled user's at most K rows clipped as one: the sampled Gaussian over users) "
                   "or rows (the baseline: each user's rows cut once to at most K, rows "
                   "Poisson-sampled as at the row level, ε converted for a group of K rows) "
                   "(default: %(default)s)")
  privacy.add("--top-k-total", type=int, dest="top_k", metavar="K",
              help="DP-FEST / DP-AdaFEST+: rows kept over all tables, K/F per table of the F "
                   "tables (no default: required by dp_fest and dp_adafest_plus)")
  add_deprecated_alias(privacy.add, "--top-k", "--top-k-total", "top_k", type=int)
  privacy.add("--top-k-epsilon", type=float, default=defaults.top_k_epsilon,
              help="pure ε of the DP top-k (Gumbel) selection, deducted from --epsilon; 0 = treat "
                   "the training counts as public")
  add_step_arguments(groups, defaults)
  lowest, highest = ctr_options.BATCH_SIZE_RANGE
  privacy.add("--max-batch-size", type=int, default=defaults.max_batch_size, metavar="B_MAX",
              advanced=True,
              help="truncate each Poisson batch to B_MAX rows (default: none, exact Poisson): a "
                   "fixed upper bound on a step's memory, paid for as δ (the chance any step's "
                   "batch exceeds it, times 1 + e^ε: Chua et al. 2024), taken from training's δ "
                   "and shown in the summary's truncation_delta; refused where it would cost "
                   "over a tenth of δ")
  privacy.add("--base-rate-share", type=float, default=defaults.base_rate_share, advanced=True,
              help="share of --epsilon the DP base rate is calibrated for (composed with "
                   "training in the accountant, so it costs training far less)")
  privacy.add("--calibration-share", type=float, default=defaults.calibration_share,
              advanced=True,
              help="share of --epsilon for recalibrating the logits after training (DP Platt "
                   "scaling on the training data, dprec.privacy.dp_platt_scaling, composed with "
                   "training in the accountant, so it costs training far less); 0: none")

  model.add("--hidden-units", type=int_list, default=defaults.hidden_units,
            help="comma-separated Dense(relu) widths (default: "
                 + ",".join(map(str, defaults.hidden_units))
                 + f"; the paper's model ({GHAZI}, App. D.1.1) has 598,598,598,598, which trains "
                 "worse under DP: docs/experiments/ctr_utility.md)")
  model.add("--logit-init", choices=ctr_options.LOGIT_INITS, default=defaults.logit_init,
            advanced=True,
            help="base_rate: the logit layer starts at zero weights and the bias at the logit of "
                 "the training click rate (DP: a Gaussian estimate charged to the ledger), so "
                 "the untrained model predicts the base rate; default: Keras' Glorot init "
                 "(p ≈ 0.5)")
  model.add("--stack-tables", type=int, nargs="?", const=STACK_MULTIPLE,
            default=defaults.stack_tables, metavar="M", advanced=True,
            help=f"hold the tables whose widths round up to the same multiple of M in one "
                 f"variable (M alone: {STACK_MULTIPLE}; 1: exact widths): the same model and DP "
                 f"step (same key, same noise), with the step's per-table work done once per "
                 f"stack (docs/experiments/dp_step_time.md, 'Stacked tables'). Costs: the "
                 f"padding columns (never read nor updated) are stored, in the model and in "
                 f"every optimizer slot (M = 8: +14%% embedding parameters at the Criteo "
                 f"vocabularies of {GHAZI}, Table 3, +5%% at 10M rows), and checkpoints hold one "
                 f"variable per stack, so a run resumes only with the same setting. Default: off "
                 f"(one variable per table)")

  training.add("--batch-size", type=int, default=defaults.batch_size,
               help=f"expected (Poisson) batch size B (default: from the N training rows, the "
                    f"power of two nearest N/{ctr_options.STEPS_PER_EPOCH}, an epoch in about "
                    f"{ctr_options.STEPS_PER_EPOCH} steps, within [{lowest}, {highest}], at most "
                    f"N/8; --user-sampling users: expected users per batch, --user-sampling "
                    f"rows' B on the same data, at most U/8)")
  training.add("--steps", type=int, default=defaults.steps,
               help="training steps T (default: one epoch, ⌈N/B⌉; --user-sampling users: "
                    "one epoch of the users or, if more, --user-sampling rows' T on the same "
                    "data)")
  training.add("--table-learning-rate", type=float, default=defaults.table_learning_rate,
               advanced=True,
               help="--optimizer table_sgd (SGD on the embedding tables, lazy Adam at "
                    "--learning-rate on the dense layers): the tables' learning rate (default: "
                    "B·(1 − momentum)/(80·C2) for a private run, the best on validation at 400k "
                    f"and 5M rows; {ctr_options.NON_PRIVATE_TABLE_LEARNING_RATE:g} without DP)")
  training.add("--momentum", type=float, default=defaults.momentum, advanced=True,
               help="--optimizer table_sgd: the tables' momentum (0: plain SGD)")
  training.add("--select-on-validation", type=float, default=defaults.select_on_validation,
               metavar="SHARE", advanced=True,
               help="--algorithm non_private: hold out this share of the training rows (the end "
                    "of the last training day) and keep the weights of the best validation log "
                    f"loss, measured {ctr_options.SELECTION_POINTS} times a run (early "
                    "stopping's choice; never on the evaluation day); default: off")
  training.add("--strategy", choices=ctr_options.STRATEGIES, default=defaults.strategy,
               help="tf.distribute strategy: none (one device), mirrored (this machine's "
                    "devices), multi_worker (the cluster in TF_CONFIG, one process per worker, "
                    "worker 0 the chief" + (
                        "; needs --run-dir on a file system all workers share, holding the "
                        "secret noise key" if run_directory else "") + "), parameter_server "
                    "(TF_CONFIG's chief, workers and ps: tables sharded by rows over the ps, "
                    "steps scheduled by the chief; worker and ps tasks serve until stopped): "
                    "docs/guide/train_ctr.md, 'Distributed training'")
  training.add("--local-workers", type=int, default=defaults.local_workers, metavar="N",
               advanced=True,
               help="with --strategy multi_worker: start N worker processes on localhost (their "
                    "TF_CONFIG made up) and print the chief's summary; with parameter_server: N "
                    "workers (and --local-ps K servers) in this process, the chief; 0: the "
                    "cluster of TF_CONFIG")
  training.add("--local-ps", type=int, default=defaults.local_ps, metavar="K", advanced=True,
               help="with --strategy parameter_server --local-workers N: K parameter servers")
  training.add("--min-shard-rows", type=int, default=defaults.min_shard_rows, metavar="ROWS",
               advanced=True,
               help="with --strategy parameter_server: a table is split by rows over up to all "
                    "parameter servers, each shard at least ROWS rows (smaller tables and dense "
                    "layers stay whole)")
  if run_directory:
    training.add("--eval-batch-size", type=int, default=defaults.eval_batch_size, advanced=True,
                 help="batch size of the evaluation")
    groups.run.add("--log-dir", help="TensorBoard directory (loss, AUC, ε, gradient size)")
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
