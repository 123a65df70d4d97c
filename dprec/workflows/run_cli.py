"""The command-line arguments of `RunOptions` and `FitOptions` (`dprec.workflows.run`), defined
once for `train ctr`, `train seqrec` and `stream`, and the options of parsed arguments."""
import dataclasses

from dprec.workflows import run as run_lib


def add_run_arguments(groups, defaults, randomness, diagnostics, run_dir_help=None):
  """Adds the run's arguments to `groups` (the command's `OptionGroups`); `defaults`: the
  options class; `randomness` and `diagnostics` say what the key derives and what
  `--diagnostics` adds for this command; `run_dir_help` None: a command without a run
  directory, ledger or checkpoints (`dprec audit`)."""
  privacy, run = groups.privacy, groups.run
  kept = run_dir_help is not None
  always = kept and defaults.run_dir is not None  # a run directory even without --run-dir
  if kept:
    run.add("--run-dir", metavar="DIR", default=defaults.run_dir, help=run_dir_help)
    run.add("--ledger", help="privacy ledger JSON file (default: DIR/ledger.json" + (
        ")" if always else " with --run-dir, else a temporary one)"))
  privacy.add("--accountant", choices=("pld", "rdp"), default=defaults.accountant, advanced=True,
              help="privacy accountant (default %(default)s)")
  if kept:
    run.add("--checkpoint-every", type=int, default=defaults.checkpoint_every, metavar="N",
            advanced=True,
            help="steps between checkpoints (one is always written at the end, and one when "
                 "Ctrl-C stops training; default: a quarter of the run's steps (stream: a "
                 f"period's), at most {run_lib.CHECKPOINT_EVERY})")
  groups.training.add("--seed", type=int, default=defaults.seed, advanced=True,
                      help="seed of the public randomness only (initialisation, dropout; default "
                           "%(default)s): noise and batches come from a secret key")
  privacy.add("--insecure-noise-seed", type=int, metavar="N", advanced=True,
              help=f"derive {randomness} from N: reproducible, NOT private (the summary "
                   + ("and ledger say" if kept else "says") + " so)")
  privacy.add("--secure-noise", action="store_true", advanced=True,
              help="sample every noise draw of the DP step exactly (no floating-point "
                   "artefacts; the same ε; slower): README 'Privacy model'")
  run.add("--diagnostics", action="store_true", advanced=True,
          help=f"also report non-private diagnostics ({diagnostics}), labelled so")
  run.add("--no-progress", action="store_true", help="no progress bars")
  if always:
    where = "also to PATH (the run keeps it in DIR/summary.json)"
  elif kept:
    where = "to PATH (default: DIR/summary.json with --run-dir, else none)"
  else:
    where = "also to PATH (it is printed on stdout)"
  run.add("--summary-json", metavar="PATH",
          help=f"write the JSON summary (strict JSON: null for ∞) {where}" + (
              ", or to stdout with - (the one-line result then goes to stderr)" if kept else ""))


def add_fit_arguments(groups, defaults, run_directory=True):
  """Adds the arguments `FitOptions` adds to `RunOptions` (`model.fit` runs); `run_directory`
  False: not those of the ledger and checkpoints."""
  groups.privacy.add("--fixed-batches", action="store_true", advanced=True,
                     help="fixed-size shuffled batches instead of Poisson sampling (ledger flags "
                          "it)" if run_directory else "fixed-size shuffled batches instead of "
                     "Poisson sampling")
  if run_directory:
    groups.run.add("--charge-every", type=int, default=defaults.charge_every, metavar="N",
                   advanced=True, help="steps prepaid per ledger charge (default %(default)s)")
    groups.run.add("--keep-checkpoints", type=int, default=defaults.keep_checkpoints,
                   metavar="K", advanced=True,
                   help="keep the newest K checkpoints (0: all, e.g. to evaluate a learning "
                        "curve; default %(default)s)")


# Arguments every command's parse holds that are not options of its run: `dprec`'s own and its
# dispatch's (`dprec.cli`: the command's words, the function it calls, its Ctrl-C message), and
# `--no-progress` (`progress`).
NOT_OPTIONS = ("debug", "verbose", "command", "subcommand", "func", "interrupted", "no_progress")


def options_from_args(options_class, args, read=(), **overrides):
  """The `options_class` options of parsed `args` (every field with an argument of its name;
  `progress` from `--no-progress`), with `overrides`. Any other argument, unless `read` names it
  (the command reads it itself), is refused: a parser's option without a field would otherwise
  be dropped silently."""
  fields = {f.name for f in dataclasses.fields(options_class)}
  values = vars(args)
  unread = sorted(set(values) - fields - set(overrides) - set(read) - set(NOT_OPTIONS))
  if unread:
    raise ValueError(f"{options_class.__name__} has no field for the argument(s) "
                     f"{', '.join(unread)}: add one (`cli_help.option`) or name them in `read`")
  values = {key: value for key, value in values.items() if key in fields}
  return options_class(**dict(values, progress=not args.no_progress, **overrides))
