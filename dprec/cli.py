"""The `dprec` command: one sub-command per way in, each registered by its own module(s).

A command module exposes `register(subparsers)`, which adds its parser(s) and sets `func` to a
handler taking the parsed args. A handler returns an int exit code or a dict, which is printed as
strict JSON on stdout (`atomic_io.dumps`: null for a non-finite number); a training command prints
its one-line result itself (`dprec.workflows.run.report`) and returns 0. User errors
(`DprecError`) print one line on stderr and exit 2; any other exception prints one line too
unless `--debug` asks for the traceback. Ctrl-C prints one line (a training command's
`args.interrupted(args, command_line)`, `dprec.workflows.interrupted`, says what its run
kept and how to resume) and exits 130.

Only the modules of the command being run are imported (TensorFlow and Beam take seconds to
import), and of a group's (`train`) the sub-command's; the others appear in `dprec --help`
through their one-line summary below. TensorFlow is imported after the arguments are parsed, so
that a mistake in them is refused at once (where the command's module parses without it).
"""
import contextlib
import importlib
import shlex
import sys
import warnings

from dprec import atomic_io
from dprec import progress
from dprec import quiet
from dprec.cli_help import SuggestingParser
from dprec.cli_help import use_formatter
from dprec.errors import DprecError

# command → (summary for `dprec --help`, modules registering it). A group (`train`) maps each
# sub-command to the module adding it to the group's sub-parsers.
COMMANDS = {
    "demo": ("generate a small Criteo-like dataset, account privacy and train on it",
             ("dprec.demo",)),
    "privacy": ("privacy accounting: ε for a training run, σ for a target ε, the ledger",
                ("dprec.privacy.cli",)),
    "synth": ("write synthetic Criteo-like day files or interaction sequences",
              ("dprec.data.cli",)),
    "preprocess": ("Apache Beam preprocessing jobs (Criteo batch/streaming, sequences)",
                   ("dprec.beam_jobs",)),
    "train": ("train a CTR or sequential recommender model, non-privately or with DP",
              {"ctr": "dprec.workflows.ctr_cli", "seqrec": "dprec.workflows.seqrec_cli"}),
    "stream": ("online training period by period on a growing Criteo time series",
               ("dprec.workflows.stream_cli",)),
    "audit": ("empirical privacy audit: an ε lower bound from canaries",
              ("dprec.audit.ctr",)),
}
GROUPS = ("train",)
INTERRUPTED = 128 + 2  # the exit status of a command stopped by SIGINT (Ctrl-C)
# Commands that import TensorFlow (held quiet, below); `preprocess` runs Beam alone (its jobs
# write TFRecords through Beam, without TensorFlow), which saves its import: seconds a job.
USES_TENSORFLOW = ("demo", "train", "stream", "audit")


def build_parser(load=None):
  """The argument parser; `load` ({command: sub-command or None}, `_command_in`) names the
  commands (and of a group, the sub-command; None: all) whose modules are imported (all if
  None)."""
  parser = SuggestingParser(
      prog="dprec",
      description="Differentially private training for large-embedding recommender models.")
  parser.add_argument("--debug", action="store_true",
                      help="show tracebacks on errors (and what --verbose shows)")
  parser.add_argument("--verbose", action="store_true",
                      help="show the logs of TensorFlow, Beam and Dask (start-up, workers), "
                           "which are otherwise held back")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  for command, (summary, module_names) in COMMANDS.items():
    if load is not None and command not in load:
      subparsers.add_parser(command, help=summary, add_help=False)
      continue
    target = subparsers
    if command in GROUPS:
      group = subparsers.add_parser(command, help=summary, description=summary)
      target = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    members = (module_names.items() if isinstance(module_names, dict)
               else ((None, module_name) for module_name in module_names))
    for name, module_name in members:
      if name is not None and load is not None and load[command] not in (None, name):
        target.add_parser(name, add_help=False)  # another sub-command: not imported
      else:
        importlib.import_module(module_name).register(target)
  use_formatter(parser)
  return parser


def _command_in(argv):
  """{command: sub-command or None} named by argv (its first positional words), for
  `build_parser`: a group's sub-command is the word after it."""
  words = [word for word in argv if not word.startswith("-")]
  if not words:
    return {}
  return {words[0]: words[1] if words[0] in GROUPS and len(words) > 1 else None}


def import_tensorflow_quietly():
  """Imports TensorFlow with the native stderr held back: its C++ start-up log (CUDA probing,
  oneDNN, CPU features) is noise to a CLI user, and TF >= 2.19 writes it through absl before
  TF_CPP_MIN_LOG_LEVEL is read (tensorflow/tensorflow#100442). Replayed if the import fails."""
  if "tensorflow" in sys.modules:
    return
  with quiet.held_stderr():
    import tensorflow  # noqa: F401


def _format_warning(message, *unused_args, **unused_kwargs):
  """A Python warning as the command prints it: one line, no source location."""
  return f"dprec: warning: {message}\n"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  warnings.formatwarning = _format_warning
  command = _command_in(argv)
  held = not {"--debug", "--verbose"} & set(argv)
  if held:
    quiet.hold_library_logs()
  # A command module that imports TensorFlow to register: its start-up log held back.
  with quiet.held_stderr() if held else contextlib.nullcontext():
    parser = build_parser(load=command)
  args = parser.parse_args(argv)  # refuses bad arguments before TensorFlow is loaded
  if held and set(command) & set(USES_TENSORFLOW):
    import_tensorflow_quietly()
  try:
    result = args.func(args)
  except KeyboardInterrupt:  # Ctrl-C: one line on what was kept and how to go on
    if args.debug:
      raise
    progress.close_all()
    explain = getattr(args, "interrupted", None)
    print("dprec: " + (explain(args, shlex.join(["dprec", *argv])) if explain else "interrupted"),
          file=sys.stderr)
    return INTERRUPTED
  except (DprecError, FileNotFoundError, ValueError) as error:
    if args.debug:
      raise
    print(f"dprec: error: {error}", file=sys.stderr)
    return 2
  except Exception as error:
    if args.debug:
      raise
    print(f"dprec: error: {type(error).__name__}: {error} (rerun with --debug for details)",
          file=sys.stderr)
    return 1
  if isinstance(result, dict):
    print(atomic_io.dumps(result, indent=2, sort_keys=True))
    return 0
  return int(result or 0)


if __name__ == "__main__":
  sys.exit(main())
