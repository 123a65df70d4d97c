"""Help text of every dprec command line (`dprec ...` and `python -m pipelines.<job>`): each
option's help ends with its default."""
import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Descriptions as written; every option's help ends with its default unless it names it."""

  def _get_help_string(self, action):
    text = action.help or ""
    if (not action.option_strings or "default" in text or action.default in (None, False)
        or action.default is argparse.SUPPRESS):
      return text
    return f"{text} (default: %(default)s)".lstrip()


def use_formatter(parser, formatter_class=HelpFormatter):
  """Sets `formatter_class` on `parser` and every sub-command parser below it."""
  parser.formatter_class = formatter_class
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      for sub in action.choices.values():
        use_formatter(sub, formatter_class)
