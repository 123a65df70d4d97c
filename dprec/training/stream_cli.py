"""`dprec stream`: streaming online training on the periods of the Criteo streaming job.

    dprec preprocess criteo --streaming --input DAYS_DIR --output OUT ...   # writes periods
    dprec stream --data OUT --algorithm dp_adafest --epsilon-total 1 --period-days 1 \\
        --train-days 18 --run-dir RUN --summary-json summary.json

Trains period by period as they appear (evaluating each new period before training on it), one
privacy ledger for the whole run, a checkpoint every --checkpoint-every steps and at every
period's end; rerunning the same command after a crash (or kill -9) resumes where it stopped.
Batches, noise and DP top-k draws come from the run's secret key (RUN_DIR/secret: keep the run
directory private); `--insecure-noise-seed N` makes them reproducible and the run not private.
"""
import math
import os


from dprec.errors import DprecError
from dprec.progress import progress_bar
from dprec.models import ctr_cli
from dprec.training import stream_metrics
from dprec.training.period_source import BeamStreamSource
from dprec.training.plan import plan_stream
from dprec.training.stream_models import CTRPeriodModel
from dprec.training.streaming import StreamConfig, StreamingTrainer
from dprec.workflows.run import Run

FEST_ALGORITHMS = ("dp_fest", "dp_adafest_plus")


def register(subparsers):
  parser = subparsers.add_parser(
      "stream", help="train period by period on a streaming Criteo output (one privacy ledger)",
      description=__doc__.split("\n\n")[0] + " Rerun the same command to resume after a crash.")
  data = parser.add_argument_group("stream")
  data.add_argument("--data", required=True,
                    help="output directory of `dprec preprocess criteo [--streaming]`")
  data.add_argument("--run-dir", default="stream_run",
                    help="checkpoints, ledger, metrics.csv, TensorBoard logs, plot "
                    "(default %(default)s)")
  data.add_argument("--period-days", type=int, default=1,
                    help="days per training period (seed 001 Table 5: 1, 2, 4, 8, 16, 18)")
  data.add_argument("--train-days", type=int, default=None,
                    help="train on the first D days; later days are the final hold-out")
  data.add_argument("--idle-timeout", type=float, default=0.0,
                    help="seconds to wait for the next period before finishing (default 0)")
  data.add_argument("--poll-interval", type=float, default=1.0,
                    help="seconds between looks for a new period while waiting")
  data.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
  data.add_argument("--summary-json", default=None, help="also write the JSON summary here")
  data.add_argument("--diagnostics", action="store_true",
                    help="also keep non-private diagnostics (exact period sizes, batch sizes, "
                    "training losses) under 'diagnostics_nonprivate'")
  dp = parser.add_argument_group("privacy")
  dp.add_argument("--algorithm", default="dp_adafest", choices=ctr_cli.ALGORITHMS)
  dp.add_argument("--epsilon-total", type=float, default=None,
                  help="privacy budget of the whole run, what --ledger spent on this data before "
                  "included (required unless non_private)")
  dp.add_argument("--delta", type=float, default=None,
                  help="δ of the run (default: the ledger's if it exists, else 1 / expected "
                  "examples over all periods)")
  dp.add_argument("--expected-periods", type=int, default=None,
                  help="periods the budget must last (default: training periods of --train-days)")
  dp.add_argument("--examples-per-period", type=int, default=None,
                  help="expected examples per period; sets q = B / N (default: the first period's)")
  dp.add_argument("--epochs-per-period", type=float, default=1.0,
                  help="expected passes over a period's data (steps = epochs · N / B)")
  dp.add_argument("--noise-multiplier", type=float, default=None,
                  help="use this σ instead of calibrating it (the run stops at the budget)")
  dp.add_argument("--top-k", type=int, default=None,
                  help="DP-FEST / DP-AdaFEST+ rows per table, refreshed every period")
  dp.add_argument("--top-k-epsilon", type=float, default=0.1,
                  help="total pure ε of the per-period DP top-k refreshes; 0 treats the "
                  "counts as public")
  dp.add_argument("--accountant", default="pld", choices=("pld", "rdp"))
  dp.add_argument("--ledger", default=None, help="privacy ledger (default RUN_DIR/ledger.json)")
  model = parser.add_argument_group("model and step")
  model.add_argument("--batch-size", type=int, default=1024, help="expected (Poisson) batch size")
  model.add_argument("--l2-norm-clip", type=float, default=1.0, help="C2")
  model.add_argument("--ratio", type=float, default=5.0, help="σ1/σ2 of DP-AdaFEST")
  model.add_argument("--threshold", type=float, default=1.0, help="τ of DP-AdaFEST")
  model.add_argument("--contribution-clip", type=float, default=1.0, help="C1 of DP-AdaFEST")
  model.add_argument("--learning-rate", type=float, default=0.05)
  model.add_argument("--optimizer", default="adagrad", choices=sorted(ctr_cli.OPTIMIZERS))
  model.add_argument("--adambc-floor", type=float, default=ctr_cli.CTRTrainOptions.adambc_floor,
                     help="γ' of --optimizer adambc")
  model.add_argument("--hidden-units", default="598,598,598,598",
                     help="comma-separated Dense widths (default: App. D.1.1's four of 598)")
  model.add_argument("--headroom", type=float, default=1.5,
                     help="spare table rows for new ids, as a factor (default 1.5)")
  model.add_argument("--seed", type=int, default=0,
                     help="seed of initialisation only (public; default %(default)s)")
  model.add_argument("--insecure-noise-seed", type=int, default=None, metavar="N",
                     help="derive batches, noise and DP top-k draws from N: reproducible, NOT "
                     "private (the summary and ledger say so)")
  model.add_argument("--no-progress", action="store_true", help="no progress bars")
  parser.set_defaults(func=run)


def _check(args):
  private = args.algorithm != "non_private"
  if private and not (args.epsilon_total or 0) > 0:
    raise DprecError(f"--algorithm {args.algorithm} needs a positive --epsilon-total")
  if args.algorithm in FEST_ALGORITHMS and not (args.top_k or 0) > 0:
    raise DprecError(f"--algorithm {args.algorithm} needs --top-k (rows per table)")
  if args.period_days < 1 or (args.train_days is not None and args.train_days < 1):
    raise DprecError("--period-days and --train-days must be positive")
  if args.expected_periods is None and args.train_days is None:
    raise DprecError("give --expected-periods (or --train-days) so the budget can be planned")


def build_trainer(args):
  """The StreamingTrainer the command runs (also used by benchmarks/streaming_criteo.py)."""
  _check(args)
  source = BeamStreamSource(args.data, args.period_days, args.train_days)
  expected = args.expected_periods or -(-args.train_days // args.period_days)
  per_period = args.examples_per_period
  if per_period is None:
    first = source.period(0)
    if first is None:
      raise DprecError(f"{args.data}: no complete period yet; give --examples-per-period to "
                       "start before the first one arrives")
    per_period = first.examples
  private = args.algorithm != "non_private"
  selection = args.top_k_epsilon if private and args.algorithm in FEST_ALGORITHMS else 0.0
  run = Run("stream", args.run_dir, args.ledger, args.insecure_noise_seed, args.data)
  ledger = run.open_ledger(args.epsilon_total, args.delta, args.accountant,
                           default_delta=1.0 / (expected * per_period)) if private else None
  plan = plan_stream(
      args.epsilon_total if private else math.inf,
      ledger.delta if ledger else args.delta or 1.0 / (expected * per_period), expected,
      per_period, args.batch_size, epochs_per_period=args.epochs_per_period,
      selection_epsilon=selection, noise_multiplier=args.noise_multiplier,
      accountant=args.accountant, spent=run.spent_before(ledger))
  options = ctr_cli.CTRTrainOptions(
      data=args.data, algorithm=args.algorithm, l2_norm_clip=args.l2_norm_clip, ratio=args.ratio,
      threshold=args.threshold, contribution_clip=args.contribution_clip,
      learning_rate=args.learning_rate, optimizer=args.optimizer,
      adambc_floor=args.adambc_floor,
      hidden_units=tuple(int(u) for u in args.hidden_units.split(",") if u), seed=args.seed)
  model = CTRPeriodModel(options, plan.noise_multiplier,
                         plan.sampling_rate * plan.examples_per_period)
  config = StreamConfig(
      run_dir=args.run_dir, seed=args.seed, checkpoint_every=args.checkpoint_every,
      train_periods=None if args.train_days is None else expected,
      idle_timeout=args.idle_timeout, poll_interval=args.poll_interval,
      top_k=args.top_k if args.algorithm in FEST_ALGORITHMS else None,
      ledger_path=args.ledger, headroom=args.headroom,
      insecure_noise_seed=args.insecure_noise_seed, diagnostics=args.diagnostics)
  return StreamingTrainer(model, source, plan, config,
                          progress=None if args.no_progress else _ProgressBars(plan,
                                                                               args.diagnostics),
                          run=run)


class _ProgressBars:
  """One tqdm bar per period (steps), on stderr; the (non-private) loss only with diagnostics."""

  def __init__(self, plan, diagnostics=False):
    self.total, self.bar, self.period = plan.steps_per_period, None, None
    self.diagnostics = diagnostics

  def __call__(self, period, step, logs):
    if period != self.period:
      if self.bar is not None:
        self.bar.close()
      self.period = period
      self.bar = progress_bar(total=self.total, initial=step, desc=f"period {period}",
                              unit="step")
    self.bar.update(1)
    if self.diagnostics:
      self.bar.set_postfix(loss=f"{logs.get('loss', float('nan')):.4f}")
    if step + 1 == self.total:
      self.bar.close()
      self.bar, self.period = None, None


def run(args):
  summary = build_trainer(args).run()
  summary["algorithm"] = args.algorithm
  if args.summary_json:
    stream_metrics.write_summary(os.path.abspath(args.summary_json), summary)
  return summary
