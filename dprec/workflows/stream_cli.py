"""`dprec stream`: the command line of `dprec.workflows.stream` (parse, then call)."""
import argparse

from dprec.cli_help import OptionGroups
from dprec.cli_help import add_deprecated_alias
from dprec.workflows import ctr
from dprec.workflows import ctr_cli
from dprec.workflows import ctr_options
from dprec.workflows import data_kinds
from dprec.workflows import interrupted
from dprec.workflows import result
from dprec.workflows import run_cli
from dprec.workflows import run_summary
from dprec.workflows import stream

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
  defaults = stream.StreamOptions  # one source for the defaults of the CLI and the Python API
  groups = OptionGroups(parser)
  data, privacy, model, training = groups.data, groups.privacy, groups.model, groups.training
  data.add("--data", required=True,
           help="output directory of `dprec preprocess criteo [--streaming]`")
  data.add("--period-days", type=int, default=defaults.period_days,
           help="days per training period (the streaming experiments of Ghazi et al. 2023, "
                "arXiv:2311.08357, Table 5: 1, 2, 4, 8, 16, 18)")
  data.add("--train-days", type=int, default=defaults.train_days,
           help="train on the first D days; later days are the final hold-out")
  data.add("--idle-timeout", type=float, default=defaults.idle_timeout,
           help="seconds to wait for the next period before finishing (default %(default)s)")
  data.add("--poll-seconds", type=float, default=defaults.poll_interval, dest="poll_interval",
           advanced=True, help="seconds between looks for a new period while waiting")
  add_deprecated_alias(data.add, "--poll-interval", "--poll-seconds", "poll_interval",
                       type=float)

  privacy.add("--algorithm", choices=ctr.ALGORITHMS,
              help=ctr_options.algorithm_help(defaults.algorithm))
  privacy.add("--epsilon", type=float, default=defaults.epsilon_total, dest="epsilon_total",
              help="privacy budget ε of the whole run, the total: what --ledger spent on this "
                   "data before is composed in (required unless non_private); 'inf': "
                   "--algorithm non_private")
  add_deprecated_alias(privacy.add, "--epsilon-total", "--epsilon", "epsilon_total",
                       type=float)
  privacy.add("--delta", type=float, default=defaults.delta,
              help="δ of the run (default: the ledger's if it exists, else 1 / expected "
                   "examples over all periods)")
  privacy.add("--privacy-unit", default=defaults.privacy_unit, choices=("row", "user"),
              help="what ε protects: a row (each lives in one period: the periods compose in "
                   "parallel, ε is the costliest period's plus the DP top-k refreshes) or a "
                   "user (the records' user_id; each step Poisson-samples users at q = B / U, U "
                   "the first period's users, each sampled user's rows clipped as one; periods "
                   "compose sequentially, in a user-level ledger)")
  privacy.add("--max-rows-per-user", type=int, default=defaults.max_rows_per_user,
              help="--privacy-unit user: k, the most rows a sampled user brings to a step "
                   "(drawn afresh each step by the run's key) and a user's rows in each DP base "
                   "rate and DP Platt scaling (default 16; public, bounds work not ε)")
  privacy.add("--top-k-per-feature", type=int, default=defaults.top_k, dest="top_k",
              metavar="K",
              help="DP-FEST / DP-AdaFEST+: rows kept per feature's table, refreshed every "
                   "period (no default: required by dp_fest and dp_adafest_plus)")
  add_deprecated_alias(privacy.add, "--top-k", "--top-k-per-feature", "top_k", type=int)
  privacy.add("--top-k-epsilon", type=float, default=defaults.top_k_epsilon,
              help="total pure ε of the per-period DP top-k refreshes; 0 treats the counts as "
                   "public")
  privacy.add("--expected-periods", type=int, default=defaults.expected_periods, advanced=True,
              help="periods the budget must last (default: training periods of --train-days)")
  privacy.add("--examples-per-period", type=int, default=defaults.examples_per_period,
              advanced=True,
              help="expected examples per period; sets q = B / N (default: the first period's; "
                   "row unit only: a user-level q uses the first period's users)")
  privacy.add("--noise-multiplier", type=float, default=defaults.noise_multiplier,
              advanced=True,
              help="use this σ instead of calibrating it (the run stops at the budget)")
  privacy.add("--base-rate-share", type=float, default=defaults.base_rate_share, advanced=True,
              help="share of ε for the DP click rate of the first period (the logit layer's "
                   "starting bias, DP Platt scaling's prior)")
  privacy.add("--calibration-share", type=float, default=defaults.calibration_share,
              advanced=True,
              help="share of ε for DP Platt scaling after each period, on its rows (row unit: "
                   "of every period; user unit: over all periods); 0: none")
  privacy.add("--calibration-logit-bound", type=float, default=defaults.calibration_logit_bound,
              advanced=True,
              help="DP Platt scaling fits on z − logit(base rate) clipped to ± this (default "
                   "%(default)s)")
  privacy.add("--calibration-prior-examples", type=float,
              default=defaults.calibration_prior_examples, advanced=True,
              help="DP Platt scaling's prior on the affine: worth this many rows that predict "
                   "the base rate (`train ctr`'s; default %(default)s)")
  privacy.add("--calibration-level-prior-examples", type=float,
              default=defaults.calibration_level_prior_examples, advanced=True,
              help="DP Platt scaling's prior on the level only (the logit at the mean): worth "
                   "this many rows at the base rate; the fit serves the next period, after the "
                   "click rate moved (default %(default)s; 0: none)")
  ctr_cli.add_step_arguments(groups, defaults)

  model.add("--hidden-units", type=ctr_cli.int_list, default=defaults.hidden_units,
            help="comma-separated Dense(relu) widths (default: "
                 + ",".join(map(str, defaults.hidden_units)) + ", train ctr's)")
  model.add("--logit-init", default=defaults.logit_init, choices=ctr.LOGIT_INITS, advanced=True,
            help="base_rate: the logit layer starts at the first period's (DP) click rate; "
                 "default: Keras' initialisation")
  model.add("--headroom", type=float, default=defaults.headroom, advanced=True,
            help="spare table rows for new ids, as a factor (default %(default)s)")
  model.add("--reference", default=defaults.reference, choices=stream.REFERENCES, advanced=True,
            help=f"also train a non-private stream on the same periods (RUN/"
                 f"{stream.REFERENCE_DIR}), shown in the plot and the summary")

  training.add("--batch-size", type=int, default=defaults.batch_size,
               help=f"expected (Poisson) batch size (default: {stream.DEFAULT_BATCH_SIZE}, at "
                    "most an eighth of the expected period size; not train ctr's N/150; "
                    "--privacy-unit user: expected users per batch, by the same rule on users)")
  training.add("--epochs-per-period", type=float, default=defaults.epochs_per_period,
               help="expected passes over a period's data (steps = epochs · N / B)")
  run_cli.add_run_arguments(
      groups, defaults, randomness="batches, noise and DP top-k draws",
      diagnostics="exact period sizes, batch sizes, training losses",
      run_dir_help="run id, secret noise key (DIR/secret: keep it private), checkpoints, "
                   "ledger, metrics.csv, TensorBoard logs, plot (default %(default)s)")
  parser.set_defaults(func=run, interrupted=interrupted.message)


def run(args):
  data_kinds.refuse_other_commands_data(args.data, "stream")
  algorithm, epsilon = ctr_options.algorithm_and_epsilon(args.algorithm, args.epsilon_total,
                                                     stream.StreamOptions.algorithm)
  options = run_cli.options_from_args(stream.StreamOptions, args, algorithm=algorithm,
                                      epsilon_total=epsilon)
  summary = stream.run(options)
  return run_summary.report(summary, options, result.stream(summary))
