"""`dprec privacy epsilon|sigma|agm|ledger`: accounting from the command line, printed as JSON."""
import argparse
import os
import sys


from dprec.errors import DprecError
from dprec.progress import progress_bar
from dprec.privacy import accounting
from dprec.privacy import analytic_gaussian
from dprec.privacy import calibration
from dprec.privacy import composition
from dprec.privacy import ledger as ledger_lib

_SAMPLING_HELP = """\
The sampling can be given in one of three ways:
  --sampling-rate Q --steps T              rate q and number of steps T
  --dataset-size N --batch-size B [--epochs E]
                                           q = B/N, T = ceil(E*N/B) (E defaults to 1);
                                           delta then defaults to 1/N
  --period Q:T [--period Q:T ...]          several training periods composed (streaming)
Steps are accounted as Poisson-subsampled Gaussian steps (add/remove-one adjacency);
--fixed-batches records that batches were fixed-size shuffled (accounted as if Poisson)."""


def _add_sampling_arguments(parser):
  group = parser.add_argument_group("sampling")
  group.add_argument("--sampling-rate", type=float, metavar="Q", help="Poisson sampling rate q")
  group.add_argument("--steps", type=int, metavar="T", help="number of training steps")
  group.add_argument("--dataset-size", type=int, metavar="N", help="training examples N")
  group.add_argument("--batch-size", type=int, metavar="B", help="expected batch size B")
  group.add_argument("--epochs", type=float, metavar="E", help="epochs (default 1)")
  group.add_argument("--period", action="append", metavar="Q:T",
                     help="a training period (rate:steps); repeat to compose several")
  parser.add_argument("--delta", type=float, metavar="D", help="target delta (default 1/N)")
  parser.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld",
                      help="dp_accounting accountant (default: pld)")
  parser.add_argument("--fixed-batches", action="store_true",
                      help="batches were fixed-size shuffled, not Poisson: flagged in the output")
  parser.add_argument("--selection-epsilon", type=float, default=0.0, metavar="S",
                      help="epsilon spent on DP top-k selection, added to training's (basic "
                           "composition; k draws at e each cost k*e when pure)")
  parser.add_argument("--selection-delta", type=float, default=0.0, metavar="SD",
                      help="delta of the selection when it is (epsilon, delta)-DP (zCDP "
                           "accounted); training is accounted at delta minus this")


def _parse_period(text):
  try:
    rate, steps = text.split(":")
    return float(rate), int(steps)
  except ValueError as error:
    raise DprecError(f"--period {text!r}: expected RATE:STEPS, e.g. 0.001:5000") from error


def _sampling(args):
  """[(q, T), ...] and δ from whichever of the three forms was given."""
  forms = {
      "--sampling-rate/--steps": args.sampling_rate is not None or args.steps is not None,
      "--dataset-size/--batch-size": args.dataset_size is not None or args.batch_size is not None,
      "--period": bool(args.period),
  }
  given = [name for name, present in forms.items() if present]
  if len(given) != 1:
    raise DprecError("give the sampling exactly one way: --sampling-rate/--steps, "
                     "--dataset-size/--batch-size[/--epochs] or --period (see --help)")
  if args.epochs is not None and given[0] != "--dataset-size/--batch-size":
    raise DprecError("--epochs goes with --dataset-size/--batch-size")
  delta = args.delta
  if given[0] == "--sampling-rate/--steps":
    if args.sampling_rate is None or args.steps is None:
      raise DprecError("--sampling-rate and --steps go together")
    periods = [(args.sampling_rate, args.steps)]
  elif given[0] == "--period":
    periods = [_parse_period(p) for p in args.period]
  else:
    if args.dataset_size is None or args.batch_size is None:
      raise DprecError("--dataset-size and --batch-size go together")
    periods = [accounting.dataset_sampling(args.dataset_size, args.batch_size,
                                           1.0 if args.epochs is None else args.epochs)]
    if delta is None:
      delta = 1.0 / args.dataset_size
  if delta is None:
    raise DprecError("--delta is required (it defaults to 1/N only with --dataset-size)")
  return periods, delta


def _report(result: composition.CompositionResult, noise_multiplier, periods, args):
  report = {"noise_multiplier": noise_multiplier, **result.to_dict(),
            "poisson": not args.fixed_batches}
  if len(periods) == 1:
    report.update(sampling_rate=periods[0][0], steps=periods[0][1])
  return report


def run_epsilon(args):
  periods, delta = _sampling(args)
  training = [accounting.TrainingPeriod(args.noise_multiplier, q, steps, not args.fixed_batches)
              for q, steps in periods]
  result = composition.compose_periods(
      training, delta, args.accountant,
      selections=[(args.selection_epsilon, args.selection_delta)])
  return _report(result, args.noise_multiplier, periods, args)


def run_sigma(args):
  periods, delta = _sampling(args)
  with progress_bar(desc="calibrating noise multiplier", unit=" sigma tried", leave=False,
                    disable=not sys.stderr.isatty()) as bar:

    def progress(sigma):
      bar.set_postfix(sigma=f"{sigma:.5f}")
      bar.update()

    plan = calibration.plan_training(
        args.epsilon, delta, periods, selection_epsilon=args.selection_epsilon,
        selection_delta=args.selection_delta, accountant=args.accountant,
        poisson=not args.fixed_batches, rtol=args.rtol, progress=progress)
  report = _report(plan.composition, plan.noise_multiplier, periods, args)
  report["target_epsilon"] = args.epsilon
  if args.adafest_ratio is not None:
    sigma1, sigma2 = accounting.adafest_noise_multipliers(plan.noise_multiplier,
                                                          args.adafest_ratio)
    report["adafest"] = {"ratio": args.adafest_ratio, "contribution_noise_multiplier": sigma1,
                         "gradient_noise_multiplier": sigma2}
  return report


def run_agm(args):
  return analytic_gaussian.calibration_report(args.epsilon, args.delta, args.sensitivity)


def run_ledger(args):
  if not os.path.exists(args.path):
    raise DprecError(f"{args.path}: no such privacy ledger")
  summary = ledger_lib.PrivacyLedger.read(args.path).summary()
  if not args.charges:
    summary["charges"] = len(summary["charges"])
  return summary


def register(subparsers):
  parser = subparsers.add_parser(
      "privacy", help="privacy accounting: epsilon, noise calibration, the ledger",
      description="Privacy accounting with dp_accounting (PLD by default, RDP optional).")
  commands = parser.add_subparsers(dest="privacy_command", metavar="SUBCOMMAND", required=True)
  formatter = argparse.RawDescriptionHelpFormatter

  epsilon = commands.add_parser(
      "epsilon", help="epsilon spent by DP-SGD-style training", formatter_class=formatter,
      description="Epsilon of Poisson-subsampled Gaussian training at a given delta, plus any "
                  "DP top-k selection cost.\n\n" + _SAMPLING_HELP)
  epsilon.add_argument("--noise-multiplier", type=float, required=True, metavar="S",
                       help="noise multiplier sigma (for DP-AdaFEST the composed one)")
  _add_sampling_arguments(epsilon)
  epsilon.set_defaults(func=run_epsilon)

  sigma = commands.add_parser(
      "sigma", help="smallest noise multiplier meeting a target epsilon",
      formatter_class=formatter,
      description="Calibrate the noise multiplier for a target (epsilon, delta); a selection "
                  "epsilon is deducted first.\n\n" + _SAMPLING_HELP)
  sigma.add_argument("--epsilon", type=float, required=True, metavar="E",
                     help="target total epsilon")
  _add_sampling_arguments(sigma)
  sigma.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance on sigma")
  sigma.add_argument("--adafest-ratio", type=float, metavar="R",
                     help="also split sigma for DP-AdaFEST: sigma1 = R*sigma2, composed = sigma")
  sigma.set_defaults(func=run_sigma)

  agm = commands.add_parser(
      "agm", help="sigma of one Gaussian release: analytic (Balle & Wang) and classical",
      description="Smallest sigma of i.i.d. Gaussian noise making one release of a query with "
                  "L2 sensitivity S (epsilon, delta)-DP, from the exact condition (analytic "
                  "Gaussian mechanism, Algorithm 1 of DP-Forward), beside the classical "
                  "sqrt(2 ln(1.25/delta)) S/epsilon (valid only for epsilon < 1) and the exact "
                  "delta each achieves. Multi-step training composes: use `sigma`.")
  agm.add_argument("--epsilon", type=float, required=True, metavar="E", help="target epsilon")
  agm.add_argument("--delta", type=float, required=True, metavar="D", help="target delta")
  agm.add_argument("--sensitivity", type=float, default=1.0, metavar="S",
                   help="L2 sensitivity of the query (default 1; 2C for a representation "
                        "normalised to norm C, replace-one)")
  agm.set_defaults(func=run_agm)

  ledger = commands.add_parser(
      "ledger", help="show a privacy ledger: budget, epsilon spent and left",
      description="Summarise a privacy ledger file written by training.")
  ledger.add_argument("--path", required=True, help="ledger JSON file")
  ledger.add_argument("--charges", action="store_true", help="list every charge")
  ledger.set_defaults(func=run_ledger)
