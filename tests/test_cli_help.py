"""Every command's help: options grouped by concern, `--help` short (the options most runs set),
`--help-all` complete, the options `--help` leaves out parsing as before, no help naming an
option its command does not have, every options field made by `cli_help.option` on its command
line and a parsed argument without a field refused."""
import argparse
import dataclasses
import re

import pytest

from dprec import cli
from dprec import cli_help

pytestmark = pytest.mark.commands

MOST_LISTED = 25  # options `--help` lists per command, -h and --help-all included
# The arguments each command needs before any other parses.
REQUIRED = {("train", "ctr"): ["--data", "d"],
            ("train", "seqrec"): ["--data", "d", "--epsilon", "5"],
            ("stream",): ["--data", "d"], ("audit",): ["--data", "d"],
            ("preprocess", "criteo"): ["--input", "i", "--output", "o"]}
# Commands whose --help leaves options out: REQUIRED's; these with each concern a group.
GROUPED = (("train", "ctr"), ("train", "seqrec"), ("stream",), ("audit",))
# A mention of another command's option: "`dprec preprocess --output`", "`train ctr --x`".
OTHER_COMMAND = re.compile(r"`[^`]*`|(?:train ctr|dprec \w+(?: \w+)?)(?:'s)? --[a-z][\w-]*")


@pytest.fixture(scope="module")
def commands():
  """{argv path: parser} of every command that runs something (`train ctr`, not `train`)."""
  found = {}

  def walk(parser, path):
    subcommands = [action for action in parser._actions
                   if isinstance(action, argparse._SubParsersAction)]
    if not subcommands:
      found[path] = parser
    for action in subcommands:
      for name, sub in action.choices.items():
        walk(sub, path + (name,))

  walk(cli.build_parser(), ())
  return found


def _help(capsys, argv):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 0
  return capsys.readouterr().out


def _listed(text):
  """The options a help text lists: in its sections (from argparse's first, "options:", on:
  not the description), each listed option's line starts with two spaces and -."""
  return re.findall(r"^  (-[\w-]+)", text.split("\noptions:\n", 1)[1], re.M)


def test_help_lists_at_most_25_options_a_command(commands, capsys):
  for path in commands:
    listed = _listed(_help(capsys, [*path, "--help"]))
    assert 3 <= len(listed) <= MOST_LISTED, (path, len(listed), listed)


def test_help_all_lists_every_option_and_help_names_it(commands, capsys):
  for path, parser in commands.items():
    everything = _help(capsys, [*path, "--help-all"])
    short = _help(capsys, [*path, "--help"])
    options = [action.option_strings[0] for action in parser._actions
               if action.option_strings and action.help is not argparse.SUPPRESS]
    assert _listed(everything) == [option for option in _listed(everything) if option in options]
    assert sorted(_listed(everything)) == sorted(options), path
    left_out = len(options) - len(_listed(short))
    if path in REQUIRED:
      assert left_out > 0 and f"--help-all also the {left_out} others" in " ".join(
          short.split()), path
      assert "usage: dprec" in everything and len(everything) > len(short)
    assert "--help-all" in short, path


def test_options_are_grouped_by_concern(commands):
  for path in GROUPED:
    groups = {group.title: [action.option_strings[0] for action in group._group_actions]
              for group in commands[path]._action_groups if group._group_actions}
    concerns = [title for _, title in cli_help.CONCERNS]
    assert set(concerns) <= set(groups), (path, sorted(groups))
    assert "--data" in groups["data"] and "--no-progress" in groups[concerns[-1]]
    assert "--epsilon" in groups["privacy"] and "--batch-size" in groups["training"]


def test_a_group_none_of_whose_options_is_listed_is_not_shown(capsys):
  short = _help(capsys, ["train", "seqrec", "--help"])
  everything = _help(capsys, ["train", "seqrec", "--help-all"])
  for title in ("model: item2item", "privacy: DP-Forward", "the DP pair statistics"):
    assert title not in short and title in everything
  assert re.search(r"^data:$", short, re.M) and "--pair-window" not in short


def _value(action, default):
  """A command-line value of `action` other than its default."""
  if action.choices:
    return [str(choice) for choice in action.choices if choice != default][0]
  return "13" if action.type in (int, float) or action.nargs == "?" or (
      action.type is not None and action.type.__name__ in ("int_list", "_epsilon",
                                                           "_prior_weight")) else "x"


def test_options_help_leaves_out_parse_as_before(commands):
  """Every option `--help` does not list parses (into its destination, away from its
  default)."""
  parser = cli.build_parser()
  checked = 0
  for path in REQUIRED:
    defaults = vars(parser.parse_args([*path, *REQUIRED[path]]))
    for action in commands[path]._actions:
      if not cli_help.is_advanced(action) or action.help is argparse.SUPPRESS:
        continue
      given = [action.option_strings[0]] + (
          [] if action.nargs == 0 else [_value(action, defaults[action.dest])])
      parsed = vars(parser.parse_args([*path, *REQUIRED[path], *given]))
      assert parsed[action.dest] != defaults[action.dest], (path, given)
      assert {key: value for key, value in parsed.items() if key != action.dest} == {
          key: value for key, value in defaults.items() if key != action.dest}, (path, given)
      checked += 1
  assert checked > 100


def test_no_help_names_an_option_its_command_lacks(commands):
  """Options' help and groups' descriptions name only the command's own options (another
  command's in backquotes or after its name; Beam's pipeline options, spelt with underscores,
  pass through `preprocess`); and where --run-dir has a default, no help describes a run
  without it."""
  for path, parser in commands.items():
    own = {option for action in parser._actions for option in action.option_strings}
    texts = [action.help or "" for action in parser._actions]
    texts += [group.description or "" for group in parser._action_groups]
    named = {option for text in texts
             for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?!\w)",
                                      OTHER_COMMAND.sub("", text))}
    assert named <= own, (path, sorted(named - own))
    run_dir = parser._option_string_actions.get("--run-dir")
    if run_dir is not None and run_dir.default is not None:
      assert not [text for text in texts if "with --run-dir" in text], path


def test_audit_help_describes_a_run_without_directory_or_ledger(capsys):
  text = " ".join(_help(capsys, ["audit", "--help-all"]).split())
  for gone in ("--ledger", "--run-dir", "DIR/"):
    assert gone not in text
  assert "also to PATH (it is printed on stdout)" in text


def test_stream_help_says_the_run_directory_is_always_kept(capsys):
  text = " ".join(_help(capsys, ["stream", "--help"]).split())
  assert "(default stream_run)" in text
  assert "privacy ledger JSON file (default: DIR/ledger.json)" in text
  assert "the run keeps it in DIR/summary.json" in text


def test_an_argument_without_a_field_is_refused_not_dropped():
  """Each command's parsed arguments become its options (`run_cli.options_from_args`); an
  argument its options class has no field for (and the command does not read itself) is
  refused, not lost."""
  from dprec.workflows import run_cli
  from dprec.workflows import seqrec_cli
  from dprec.workflows.ctr_options import CTRTrainOptions
  from dprec.workflows.seqrec_options import SeqRecTrainOptions
  from dprec.workflows.stream_options import StreamOptions
  parser = cli.build_parser()
  for path, options_class, read in ((("train", "ctr"), CTRTrainOptions, ()),
                                    (("stream",), StreamOptions, ()),
                                    (("train", "seqrec"), SeqRecTrainOptions, seqrec_cli.READ)):
    args = parser.parse_args([*path, *REQUIRED[path]])
    assert run_cli.options_from_args(options_class, args, read=read).data == "d"
    args.stray = 1  # as a parser's `--stray` would, with no field of that name
    with pytest.raises(ValueError, match="no field for the argument.* stray"):
      run_cli.options_from_args(options_class, args, read=read)


def test_every_option_field_is_an_option_of_its_command(commands):
  """Each field made by `cli_help.option` is an option of its command (`cli_help.add_fields`;
  `train seqrec` adds its fields by name, in its help's order): none is left off."""
  from dprec.audit.ctr import CTRAuditOptions
  from dprec.workflows.ctr_options import CTRTrainOptions
  from dprec.workflows.seqrec_options import SeqRecTrainOptions
  from dprec.workflows.stream_options import StreamOptions
  for path, options_class in ((("train", "ctr"), CTRTrainOptions),
                              (("stream",), StreamOptions),
                              (("train", "seqrec"), SeqRecTrainOptions),
                              (("audit",), CTRAuditOptions)):
    fields = {field.name for field in dataclasses.fields(options_class)
              if cli_help.OPTION in field.metadata}
    missing = fields - {action.dest for action in commands[path]._actions}
    assert fields and not missing, (path, sorted(missing))
