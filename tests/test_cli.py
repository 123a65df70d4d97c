"""The `dprec` dispatcher: every registered command has --help; errors are one clear line."""
import os
import sys
import types

import pytest

from dprec import cli
from dprec.errors import InputError


def _all_command_paths(parser):
  """Yields argv prefixes for every (sub)command reachable from `parser`."""
  for action in parser._actions:  # pylint: disable=protected-access
    if action.__class__.__name__ == "_SubParsersAction":
      for name, subparser in action.choices.items():
        yield [name]
        for rest in _all_command_paths(subparser):
          yield [name] + rest


def test_every_command_has_help(capsys):
  paths = list(_all_command_paths(cli.build_parser()))
  assert paths, "no commands registered"
  for path in paths:
    with pytest.raises(SystemExit) as exit_info:
      cli.main(path + ["--help"])
    assert exit_info.value.code == 0
    assert "usage: dprec" in capsys.readouterr().out


def _parsers(parser, path=("dprec",)):
  """(argv path, parser) of `parser` and every sub-command parser below it."""
  yield path, parser
  for action in parser._actions:  # pylint: disable=protected-access
    if action.__class__.__name__ == "_SubParsersAction":
      for name, subparser in action.choices.items():
        yield from _parsers(subparser, path + (name,))


def test_every_option_with_a_default_shows_it_in_help(capsys):
  checked = 0
  for path, parser in _parsers(cli.build_parser()):
    formatter = parser._get_formatter()  # pylint: disable=protected-access
    for action in parser._actions:  # pylint: disable=protected-access
      if not action.option_strings or action.default in (None, False, "==SUPPRESS=="):
        continue
      help_text = formatter._get_help_string(action)  # pylint: disable=protected-access
      assert "default" in help_text, (" ".join(path), action.option_strings[-1], help_text)
      checked += 1
  assert checked > 50
  with pytest.raises(SystemExit):
    cli.main(["train", "ctr", "--help"])
  assert "(default: dp_adafest)" in " ".join(capsys.readouterr().out.split())


def test_only_the_command_run_is_imported(monkeypatch):
  monkeypatch.setattr(cli, "COMMANDS", {
      "ok": ("succeeds", ("fake_ok",)), "heavy": ("never imported", ("no_such_module",))})
  monkeypatch.setitem(sys.modules, "fake_ok", types.SimpleNamespace(
      register=lambda sub: sub.add_parser("ok").set_defaults(func=lambda args: 0)))
  assert cli.main(["ok"]) == 0


def _fake_command_module(error):
  def register(subparsers):
    parser = subparsers.add_parser("boom", help="always fails")
    parser.set_defaults(func=lambda args: (_ for _ in ()).throw(error))
  return types.SimpleNamespace(register=register)


@pytest.mark.parametrize("error, code", [
    (InputError("day_0", 7, "C3", "not a hex id"), 2),
    (RuntimeError("internal"), 1),
])
def test_errors_are_one_line_without_traceback(monkeypatch, capsys, error, code):
  monkeypatch.setitem(sys.modules, "fake_boom", _fake_command_module(error))
  monkeypatch.setattr(cli, "COMMANDS", {"boom": ("always fails", ("fake_boom",))})
  assert cli.main(["boom"]) == code
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err
  assert str(error) in err


def test_debug_shows_the_traceback(monkeypatch):
  monkeypatch.setitem(sys.modules, "fake_boom", _fake_command_module(InputError("f", 1, "x", "y")))
  monkeypatch.setattr(cli, "COMMANDS", {"boom": ("always fails", ("fake_boom",))})
  with pytest.raises(InputError):
    cli.main(["--debug", "boom"])


def test_dict_results_print_as_json(monkeypatch, capsys):
  def register(subparsers):
    subparsers.add_parser("ok").set_defaults(func=lambda args: {"epsilon": 1.5})
  monkeypatch.setitem(sys.modules, "fake_ok", types.SimpleNamespace(register=register))
  monkeypatch.setattr(cli, "COMMANDS", {"ok": ("succeeds", ("fake_ok",))})
  assert cli.main(["ok"]) == 0
  assert '"epsilon": 1.5' in capsys.readouterr().out


@pytest.mark.parametrize("argv,preset,expected", [
    (["ok"], None, "3"), (["--debug", "ok"], None, None), (["ok"], "0", "0")])
def test_tensorflow_start_up_log_is_quiet_unless_debugging(monkeypatch, argv, preset, expected):
  monkeypatch.setattr(cli, "COMMANDS", {"ok": ("succeeds", ("fake_ok",))})
  monkeypatch.setitem(sys.modules, "fake_ok", types.SimpleNamespace(
      register=lambda sub: sub.add_parser("ok").set_defaults(func=lambda args: 0)))
  if preset is None:
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
  else:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", preset)
  assert cli.main(argv) == 0
  assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == expected


def test_tensorflow_is_imported_without_its_native_start_up_log():
  """TF >= 2.19 logs through absl before reading TF_CPP_MIN_LOG_LEVEL; the CLI holds that
  output back during the import and gives stderr back afterwards."""
  import subprocess  # pylint: disable=import-outside-toplevel
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  script = ("import os; from dprec import cli; cli.import_tensorflow_quietly(); "
            "os.write(2, b'stderr is back\\n')")
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
  assert done.stderr.decode() == "stderr is back\n"
