"""Help text of every dprec command line (`dprec ...` and `python -m pipelines.<job>`): options
in groups by concern (`OptionGroups`); `--help` lists the options most runs set and `--help-all`
every one (an option added with `advanced=True` parses as any other, listed by `--help-all`
only); each option's help ends with its default; old option names kept for a release as
deprecated aliases; a misspelt option or choice gets the closest one suggested. An options
dataclass holds its options in its fields (`option`), from which `add_fields` builds them: the
flag, default, type, help, group, choices, advanced-ness and old names of each come from one
place."""
import argparse
import dataclasses
import difflib
import functools
import sys
import textwrap
import typing

ADVANCED = "advanced"  # an action with this attribute true: listed by --help-all only
HELP_ALL = "--help-all"
# A command's groups by concern, in the order its help lists them: (name, title).
CONCERNS = (("data", "data"), ("privacy", "privacy"), ("model", "model"),
            ("training", "training"), ("run", "run: directory, ledger, output, progress"))


def mark_advanced(parser, dests):
  """Marks the options of `parser` whose destinations are in `dests` as listed by `--help-all`
  only (for a command that reuses another's options but uses some of them less)."""
  for action in parser._actions:
    if action.dest in dests:
      setattr(action, ADVANCED, True)


def is_advanced(action):
  return getattr(action, ADVANCED, False)


class OptionGroup:
  """One argparse group of a command's options; `add` takes `add_argument`'s arguments and
  `advanced` (True: listed by `--help-all` only)."""

  def __init__(self, group):
    self.group = group

  def add(self, *names, advanced=False, **kwargs):
    action = self.group.add_argument(*names, **kwargs)
    if advanced:
      setattr(action, ADVANCED, True)
    return action

  def add_advanced(self, *names, **kwargs):
    """`add(..., advanced=True)`, as a function (for `add_deprecated_alias` and the like)."""
    return self.add(*names, advanced=True, **kwargs)


class OptionGroups:
  """A command's options in argparse groups by concern: `groups.data`, `.privacy`, `.model`,
  `.training`, `.run` (`OptionGroup`s, listed in that order; a group without options is not
  listed), then `extra` groups ((name, title, description), e.g. one method's settings)."""

  def __init__(self, parser, extra=()):
    for name, title in CONCERNS:
      setattr(self, name, OptionGroup(parser.add_argument_group(title)))
    for name, title, description in extra:
      setattr(self, name, OptionGroup(parser.add_argument_group(title, description)))


OPTION = "dprec.option"  # a field's metadata key: its command-line option's help and settings


def option(default=dataclasses.MISSING, *, help, group, **settings):
  """A dataclass field that is also a command-line option (`add_fields`): its `default`, its
  `help` (a text, or a function of `add_fields`' `context` returning one), the `group` it is
  listed in (the name of one of the command's `OptionGroups`: "data", "privacy", ...) and
  `settings`: `advanced`, `flag` (default `--field-name`), `deprecated` (old flags, each kept as
  a deprecated alias), `parsed_default` (what the option parses to when not given, where that is
  not `default`: e.g. None for the command to resolve) and `add_argument`'s `action`, `choices`,
  `const`, `metavar`, `nargs`, `required`, `type`."""
  return dataclasses.field(default=default,
                           metadata={OPTION: dict(settings, help=help, group=group)})


def same_option(options_class, name, default=dataclasses.MISSING, **changes):
  """The field `name` of the dataclass `options_class`, as a field of another: the same option
  (help, group, settings, but for `changes`), with the same default unless `default` says."""
  field = {field.name: field for field in dataclasses.fields(options_class)}[name]
  settings = dict(field.metadata[OPTION], **changes)
  return dataclasses.field(default=field.default if default is dataclasses.MISSING else default,
                           metadata={OPTION: settings})


def _option_type(annotation):
  """The argparse `type` of a field's annotation: int or float, also inside `Optional`."""
  kinds = [kind for kind in typing.get_args(annotation) or (annotation,) if kind is not type(None)]
  return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else None


def add_fields(groups, options_class, omit=(), names=None, **context):
  """Adds the option of every field of the dataclass `options_class` made by `option` but those
  named in `omit`, in field order (or those `names` names, in its order), each to its group of
  `groups` (`OptionGroups`, or any object with the groups as attributes): its flag
  (`--field-name` unless `flag` says), destination the field, the field's default (or
  `parsed_default`), the type of its annotation (int, float) unless `settings` name one or an
  `action`, its help (a function's called with `context`) and its `deprecated` aliases."""
  annotations = typing.get_type_hints(options_class)
  fields = {field.name: field for field in dataclasses.fields(options_class)}
  for field in fields.values() if names is None else map(fields.__getitem__, names):
    if (OPTION not in field.metadata and names is None) or field.name in omit:
      continue
    settings = dict(field.metadata[OPTION])
    group = getattr(groups, settings.pop("group"))
    flag = settings.pop("flag", "--" + field.name.replace("_", "-"))
    deprecated = settings.pop("deprecated", ())
    if callable(settings["help"]):
      settings["help"] = settings["help"](**context)
    if "action" not in settings:
      settings.setdefault("type", _option_type(annotations[field.name]))
    default = settings.pop("parsed_default", field.default)
    if default is not dataclasses.MISSING:  # `append` adds to a list: a copy of the field's
      settings["default"] = list(default) if settings.get("action") == "append" else default
    group.add(flag, dest=field.name, **settings)
    for old in deprecated:
      add_deprecated_alias(group.add, old, flag, field.name, type=settings.get("type"))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Descriptions as written; every option's help ends with its default unless it names it; the
  advanced options (and a group's description when none of its options is listed) only with
  `everything` (`--help-all`)."""

  def __init__(self, prog, everything=False, **kwargs):
    super().__init__(prog, **kwargs)
    self.everything = everything
    self._held_description = None  # a group's, written before its first listed option

  def _listed(self, action):
    return action.help is not argparse.SUPPRESS and (self.everything or not is_advanced(action))

  def add_usage(self, usage, actions, groups, prefix=None):
    super().add_usage(usage, [action for action in actions
                              if self.everything or not is_advanced(action)], groups, prefix)

  def add_text(self, text):
    if self._current_section is self._root_section:  # the description and the epilog
      super().add_text(text)
    else:
      self._held_description = text

  def add_arguments(self, actions):
    listed = [action for action in actions if self._listed(action)]
    if listed and self._held_description:
      super().add_text(self._held_description)
    self._held_description = None
    super().add_arguments(listed)

  def _get_help_string(self, action):
    text = action.help or ""
    if (not action.option_strings or "default" in text or action.default is None
        or action.default is False or action.default is argparse.SUPPRESS):
      return text
    return f"{text} (default: %(default)s)".lstrip()


class _HelpAll(argparse.Action):
  """`--help-all`: the help with every option, the advanced ones too; then exits."""

  def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
               help=None):  # argparse passes `help`
    super().__init__(option_strings, dest, nargs=0, default=default, help=help)

  def __call__(self, parser, namespace, values, option_string=None):
    formatter_class = parser.formatter_class
    parser.formatter_class = functools.partial(formatter_class, everything=True)
    try:
      parser.print_help()
    finally:
      parser.formatter_class = formatter_class
    parser.exit()


def use_formatter(parser, formatter_class=HelpFormatter):
  """Sets `formatter_class` on `parser` and every sub-command parser below it, and gives each
  command (a parser without sub-commands) `--help-all`, named in its epilog when its `--help`
  leaves options out."""
  parser.formatter_class = formatter_class
  commands = [action for action in parser._actions
              if isinstance(action, argparse._SubParsersAction)]
  for action in commands:
    for sub in action.choices.values():
      use_formatter(sub, formatter_class)
  if commands or "-h" not in parser._option_string_actions or (
      HELP_ALL in parser._option_string_actions):
    return
  parser.add_argument(HELP_ALL, action=_HelpAll,
                      help="show the help with every option, the advanced ones too, and exit")
  hidden = sum(is_advanced(action) and action.help is not argparse.SUPPRESS
               for action in parser._actions)
  if hidden:
    note = (f"--help lists the options most runs set; --help-all also the {hidden} others "
            "(tuning, research methods, distribution, diagnostics). Every option works whether "
            "listed or not.")
    note = textwrap.fill(note, 79)
    parser.epilog = f"{parser.epilog.rstrip()}\n\n{note}" if parser.epilog else note


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
