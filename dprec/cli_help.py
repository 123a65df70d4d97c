"""Help text of every dprec command line (`dprec ...` and `python -m pipelines.<job>`): each
option's help ends with its default; old option names kept for a release as deprecated aliases."""
import argparse
import sys


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Descriptions as written; every option's help ends with its default unless it names it."""

  def _get_help_string(self, action):
    text = action.help or ""
    if (not action.option_strings or "default" in text or action.default is None
        or action.default is False or action.default is argparse.SUPPRESS):
      return text
    return f"{text} (default: %(default)s)".lstrip()


def use_formatter(parser, formatter_class=HelpFormatter):
  """Sets `formatter_class` on `parser` and every sub-command parser below it."""
  parser.formatter_class = formatter_class
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      for sub in action.choices.values():
        use_formatter(sub, formatter_class)


class _DeprecatedAlias(argparse.Action):
  """An old option name: stores into the new option's destination and says on stderr that the
  name is deprecated."""

  def __init__(self, option_strings, dest, new, **kwargs):
    super().__init__(option_strings, dest, **kwargs)
    self.new = new

  def __call__(self, parser, namespace, values, option_string=None):
    print(f"dprec: warning: {option_string} is deprecated and goes in the next release; use "
          f"{self.new}", file=sys.stderr)
    setattr(namespace, self.dest, values)


def add_deprecated_alias(add, old, new, dest, **kwargs):
  """Adds the old option name `old` of the option `new` (destination `dest`; `kwargs`: its
  `type`, `nargs`) with `add` (a parser's or group's `add_argument`), hidden from the help."""
  add(old, action=_DeprecatedAlias, new=new, dest=dest, default=argparse.SUPPRESS,
      help=argparse.SUPPRESS, **kwargs)
