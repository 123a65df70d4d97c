"""The `dprec` command: one sub-command per way in, each registered by its own module.

Each module listed in COMMANDS exposes `register(subparsers)`, which adds its parser(s) and sets
`func` to a handler taking the parsed args. A handler returns an int exit code or a dict, which is
printed as JSON on stdout. User errors (`DprecError`) print one line on stderr and exit 2; any
other exception prints one line too unless `--debug` asks for the traceback.
"""
import argparse
import importlib
import json
import sys

from dprec.errors import DprecError

# (top-level command, module that registers it). A command shared by several modules (`train`)
# gets a sub-parser group that each of them extends.
COMMANDS = (
    ("demo", "dprec.demo"),
    ("privacy", "dprec.privacy.cli"),
    ("synth", "dprec.data.cli"),
    ("preprocess", "pipelines.cli"),
    ("train", "dprec.models.ctr_cli"),
    ("train", "dprec.models.seqrec_cli"),
    ("stream", "dprec.training.stream_cli"),
)
GROUPS = {
    "train": "Train a model (CTR or sequential recommender) non-privately or with DP.",
}


def build_parser():
  parser = argparse.ArgumentParser(
      prog="dprec",
      description="Differentially private training for large-embedding recommender models.")
  parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  groups = {}
  for command, module_name in COMMANDS:
    module = importlib.import_module(module_name)
    if command in GROUPS:
      if command not in groups:
        group = subparsers.add_parser(command, help=GROUPS[command], description=GROUPS[command])
        groups[command] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND",
                                               required=True)
      module.register(groups[command])
    else:
      module.register(subparsers)
  return parser


def main(argv=None):
  args = build_parser().parse_args(argv)
  try:
    result = args.func(args)
  except (DprecError, FileNotFoundError, ValueError) as error:
    if args.debug:
      raise
    print(f"dprec: error: {error}", file=sys.stderr)
    return 2
  except Exception as error:  # pylint: disable=broad-except
    if args.debug:
      raise
    print(f"dprec: error: {type(error).__name__}: {error} (rerun with --debug for details)",
          file=sys.stderr)
    return 1
  if isinstance(result, dict):
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0
  return int(result or 0)


if __name__ == "__main__":
  sys.exit(main())
