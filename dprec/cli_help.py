"""Help text of every dprec command line (`dprec ...` and `python -m pipelines.<job>`): each
option's help ends with its default; old option names kept for a release as deprecated aliases;
a misspelt option or choice gets the closest one suggested."""
import argparse
import difflib
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
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
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


def closest(word, candidates):
  """The candidate closest to `word` (difflib's ratio of at least 0.6), or None."""
  close = difflib.get_close_matches(word, list(candidates), n=1)
  return close[0] if close else None


class SuggestingParser(argparse.ArgumentParser):
  """An argument parser (its sub-command parsers too: `add_subparsers` makes them of its class)
  whose errors suggest the closest option to a misspelt one and the closest choice to a bad
  value (argparse's own `suggest_on_error` exists from Python 3.14 only)."""

  def _check_value(self, action, value):
    try:
      super()._check_value(action, value)
    except argparse.ArgumentError as error:
      hint = closest(str(value), map(str, action.choices))
      if hint is None:
        raise
      raise argparse.ArgumentError(action, f"{error.message}; did you mean {hint}?") from None

  def parse_args(self, args=None, namespace=None):
    namespace, extras = self.parse_known_args(args, namespace)
    if extras:
      leaf = self._command_parser(namespace)
      options = [option for action in leaf._actions for option in action.option_strings]
      hints = [f"did you mean {hint}?" for word in extras if word.startswith("-")
               for hint in [closest(word.split("=")[0], options)] if hint]
      leaf.error(f"unrecognized arguments: {' '.join(extras)}"
                 + (f" ({'; '.join(hints)})" if hints else ""))
    return namespace

  def _command_parser(self, namespace):
    """The (sub-)command parser `namespace` was parsed by: its usage and options are the ones an
    unknown option is compared with."""
    for action in self._actions:
      if isinstance(action, argparse._SubParsersAction):
        chosen = action.choices.get(getattr(namespace, action.dest, None))
        if isinstance(chosen, SuggestingParser):
          return chosen._command_parser(namespace)
    return self
