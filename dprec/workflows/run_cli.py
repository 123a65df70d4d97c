"""The command-line arguments of `RunOptions` and `FitOptions` (`dprec.workflows.run`), defined
once for `train ctr`, `train seqrec` and `stream`, and the options of parsed arguments."""
import dataclasses

from dprec.workflows import run as run_lib


def add_run_arguments(add, defaults, run_dir_help, randomness, diagnostics):
  """Adds the run's arguments with `add` (a parser's or group's `add_argument`); `defaults`: the
  options class; `randomness` and `diagnostics` say what the key derives and what
  `--diagnostics` adds for this command."""
  add("--run-dir", metavar="DIR", default=defaults.run_dir, help=run_dir_help)
  add("--ledger", help="privacy ledger JSON file (default: DIR/ledger.json with --run-dir, "
      "else a temporary one)")
  add("--accountant", choices=("pld", "rdp"), default=defaults.accountant,
      help="privacy accountant (default %(default)s)")
  add("--checkpoint-every", type=int, default=defaults.checkpoint_every, metavar="N",
      help="steps between checkpoints (one is always written at the end, and one when Ctrl-C "
           f"stops training; default: a quarter of the run's steps (stream: a period's), at most "
           f"{run_lib.CHECKPOINT_EVERY})")
  add("--seed", type=int, default=defaults.seed,
      help="seed of the public randomness only (initialisation, dropout; default %(default)s): "
           "noise and batches come from a secret key")
  add("--insecure-noise-seed", type=int, metavar="N",
      help=f"derive {randomness} from N: reproducible, NOT private (the summary and ledger say "
           "so)")
  add("--secure-noise", action="store_true",
      help="sample every noise draw of the DP step exactly (no floating-point artefacts; "
           "the same ε; slower): README 'Privacy model'")
  add("--diagnostics", action="store_true",
      help=f"also report non-private diagnostics ({diagnostics}), labelled so")
  add("--no-progress", action="store_true", help="no progress bars")
  add("--summary-json", metavar="PATH",
      help="write the JSON summary (strict JSON: null for ∞) to PATH, or to stdout with - (the "
           "one-line result then goes to stderr); default: DIR/summary.json with --run-dir, "
           "else none")


def add_fit_arguments(add, defaults):
  """Adds the arguments `FitOptions` adds to `RunOptions` (`model.fit` runs)."""
  add("--fixed-batches", action="store_true",
      help="fixed-size shuffled batches instead of Poisson sampling (ledger flags it)")
  add("--charge-every", type=int, default=defaults.charge_every, metavar="N",
      help="steps prepaid per ledger charge (default %(default)s)")
  add("--keep-checkpoints", type=int, default=defaults.keep_checkpoints, metavar="K",
      help="keep the newest K checkpoints (0: all, e.g. to evaluate a learning curve; default "
           "%(default)s)")


def options_from_args(options_class, args, **overrides):
  """The `options_class` options of parsed `args` (every field with an argument of its name;
  `progress` from `--no-progress`), with `overrides`."""
  fields = {f.name for f in dataclasses.fields(options_class)}
  values = {key: value for key, value in vars(args).items() if key in fields}
  return options_class(**dict(values, progress=not args.no_progress, **overrides))

