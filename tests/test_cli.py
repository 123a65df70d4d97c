"""The `dprec` dispatcher: every registered command has --help; errors are one clear line."""
import dataclasses
import json
import os
import re
import sys
import types

import pytest

from dprec import cli
from dprec.errors import InputError

pytestmark = pytest.mark.commands


def _all_command_paths(parser):
  """Yields argv prefixes for every (sub)command reachable from `parser`."""
  for action in parser._actions:
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
  for action in parser._actions:
    if action.__class__.__name__ == "_SubParsersAction":
      for name, subparser in action.choices.items():
        yield from _parsers(subparser, path + (name,))


def test_every_option_with_a_default_shows_it_in_help(capsys):
  checked = 0
  for path, parser in _parsers(cli.build_parser()):
    formatter = parser._get_formatter()
    for action in parser._actions:
      if (not action.option_strings or action.default is None or action.default is False
          or action.default == "==SUPPRESS=="):
        continue
      help_text = formatter._get_help_string(action)
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
  import subprocess
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  script = ("import os; from dprec import cli; cli.import_tensorflow_quietly(); "
            "os.write(2, b'stderr is back\\n')")
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
  assert done.stderr.decode() == "stderr is back\n"


def _leaf_commands():
  """argv of every command that runs something (`train ctr`, not `train`)."""
  paths = [tuple(path) for path in _all_command_paths(cli.build_parser())]
  return [list(path) for path in paths if not any(other[:len(path)] == path and other != path
                                                   for other in paths)]


@pytest.mark.slow
def test_every_help_prints_nothing_before_usage():
  """`dprec ... --help` in a fresh process (TensorFlow and Beam imported for the first time):
  nothing on stdout or stderr before the usage line. One leaf per command: `dprec` imports a
  command's modules whole (`cli.build_parser`), so its other leaves import nothing more (their
  help is checked in this process by `test_every_command_has_help`)."""
  import subprocess
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  first_of_command = {}
  for path in _leaf_commands():
    first_of_command.setdefault(path[0], path)
  for path in first_of_command.values():
    done = subprocess.run([sys.executable, "-m", "dprec.cli", *path, "--help"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=True, text=True)
    assert done.stdout.startswith("usage: dprec " + " ".join(path)), (path, done.stdout[:500])


def test_help_speaks_to_users():
  """No reference to documents the package does not ship, nor to internal names."""
  internal = re.compile(r"seed 00\d|note 00\d|DESIGN|sized_for|STEPS_PER_EPOCH|"
                        r"STREAM_BATCH_SIZE|BATCH_ONLY_RUNNERS")
  for path, parser in _parsers(cli.build_parser()):
    found = internal.findall(parser.format_help())
    assert not found, (" ".join(path), found)


def test_options_that_default_to_zero_show_it(capsys):
  for argv, flag in ((["demo"], "--seed"), (["synth", "criteo"], "--seed"),
                     (["train", "seqrec"], "--pair-popularity-exponent")):
    with pytest.raises(SystemExit):
      cli.main(argv + ["--help-all"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(flag + r" \S+ [^-]*\(default: 0(\.0)?\)", text), (argv, flag)


def test_audit_lists_and_accepts_only_the_options_it_uses(capsys):
  with pytest.raises(SystemExit):
    cli.main(["audit", "--help"])
  out = capsys.readouterr().out
  for flag in ("--ledger", "--log-dir", "--charge-every", "--eval-batch-size", "--run-dir",
               "--keep-checkpoints", "--checkpoint-every"):
    assert not re.search(rf"^ +{flag}\b", out, re.M), flag
  for flag in ("--ledger", "--charge-every"):
    with pytest.raises(SystemExit):
      cli.main(["audit", "--data", "d", flag, "x"])
    assert f"unrecognized arguments: {flag} x" in capsys.readouterr().err


def test_audit_prints_only_json_on_stdout(monkeypatch, capsys):
  from dprec.audit import ctr as audit_ctr
  summary = {"epsilon_lower_bound": 0.5, "confidence": 0.95, "ceiling": 3.0,
             "epsilon_lower_bound_steinke": 0.4, "ceiling_steinke": 2.0, "claimed_epsilon": 1.0}
  monkeypatch.setattr(audit_ctr, "audit_ctr", lambda options: summary)
  assert cli.main(["audit", "--data", "d", "--epsilon", "1"]) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out) == summary and "ε lower bound 0.500" in captured.err


@pytest.mark.parametrize("argv, old, new, dest, value", [
    (["train", "ctr", "--data", "d"], "--top-k", "--top-k-total", "top_k", 26),
    (["stream", "--data", "d"], "--top-k", "--top-k-per-feature", "top_k", 5),
    (["stream", "--data", "d"], "--epsilon-total", "--epsilon", "epsilon_total", 2.0),
    (["stream", "--data", "d"], "--poll-interval", "--poll-seconds", "poll_interval", 0.5),
])
def test_one_name_for_one_thing_and_old_names_warn(capsys, argv, old, new, dest, value):
  parser = cli.build_parser()
  assert getattr(parser.parse_args(argv + [new, str(value)]), dest) == value
  assert capsys.readouterr().err == ""
  assert getattr(parser.parse_args(argv + [old, str(value)]), dest) == value
  assert f"{old} is deprecated and goes in the next release; use {new}" in capsys.readouterr().err


def test_epsilon_is_required_everywhere_it_is_a_budget(capsys):
  with pytest.raises(SystemExit):
    cli.build_parser().parse_args(["train", "seqrec", "--data", "d"])
  assert "--epsilon" in capsys.readouterr().err


@pytest.mark.slow
def test_beam_jobs_are_quiet_unless_verbose(tmp_path):
  """A preprocessing run prints its JSON summary and on stderr only its own phase lines;
  --verbose shows Beam's logs (its workers' start-up)."""
  import subprocess
  (tmp_path / "seq.txt").write_text("".join(f"{u} {i}\n" for u in range(1, 30)
                                            for i in range(1, 6)))
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  runs = {}
  for flags in ((), ("--verbose",)):
    runs[flags] = subprocess.run(
        [sys.executable, "-m", "dprec.cli", *flags, "preprocess", "sequences", "--input",
         str(tmp_path / "seq.txt"), "--format", "sasrec", "--output",
         str(tmp_path / f"out{len(flags)}")], env=env, capture_output=True, text=True, check=True)
  quiet = runs[()].stderr.splitlines()
  assert quiet and all(line.startswith("preprocess sequences: ") for line in quiet), quiet
  assert json.loads(runs[()].stdout)["users"] == 29
  assert "INFO" in runs[("--verbose",)].stderr


# Each command and the options classes it builds.
COMMAND_OPTIONS = [
    (["train", "seqrec", "--data", "d", "--epsilon", "5"],
     "dprec.workflows.seqrec:SeqRecTrainOptions dprec.workflows.seqrec_options:DPForwardOptions"),
    (["train", "ctr", "--data", "d"], "dprec.workflows.ctr:CTRTrainOptions"),
    (["stream", "--data", "d"], "dprec.workflows.stream_options:StreamOptions"),
    (["audit", "--data", "d"],
     "dprec.workflows.ctr:CTRTrainOptions dprec.audit.ctr:CTRAuditOptions"),
    (["synth", "criteo", "--rows", "9", "--output", "o"], "dprec.data.synthetic:CriteoSynthConfig"),
    (["synth", "sequences", "--users", "9", "--items", "9", "--output", "o"],
     "dprec.data.synthetic:SequenceSynthConfig"),
    (["preprocess", "criteo", "--input", "i", "--output", "o"],
     "pipelines.criteo:CriteoJob pipelines.criteo_vocabulary:VocabConfig "
     "pipelines.criteo_stream:StreamJob"),
    (["preprocess", "sequences", "--input", "i", "--format", "csv", "--output", "o"],
     "pipelines.sequences:SequencesJob"),
]


def _fields(options):
  """{name: field} of the options classes `options` ("module:Class module:Class")."""
  import importlib
  fields = {}
  for spec in options.split():
    module, name = spec.split(":")
    fields.update({f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module),
                                                                  name))})
  return fields


@pytest.mark.parametrize("argv, options", COMMAND_OPTIONS)
def test_command_line_defaults_are_the_python_apis(argv, options):
  """One source for each default: the options classes the command builds (an argument whose
  destination names a field of one of them has that field's default)."""
  parsed = vars(cli.build_parser().parse_args(argv))
  fields = _fields(options)
  compared = {key for key in parsed if key in fields
              and fields[key].default is not dataclasses.MISSING
              and key not in ("data", "epsilon", "dp_forward", "algorithm")}  # `algorithm`: None
  # until `run_cli.algorithm_and_epsilon` resolves it with --epsilon (to the default)
  differ = {key: (parsed[key], fields[key].default) for key in compared
            if json.dumps(parsed[key]) != json.dumps(fields[key].default)}  # a tuple as a list
  assert compared and not differ, (compared, differ)


SHOWN_DEFAULT = re.compile(r"\(default:? ([^;:)\s]+)")


def _same_default(text, value):
  """Whether `text`, a default as a help text shows it, is `value`: a number of equal value, a
  sequence comma-separated (`int_list`'s form), else the same string."""
  if isinstance(value, (tuple, list)):
    return text == (",".join(map(str, value)) if value else "[]")
  if isinstance(value, (int, float)):
    try:
      return float(text) == value
    except ValueError:
      return False
  return text == str(value)


@pytest.mark.parametrize("argv, options", COMMAND_OPTIONS)
def test_every_default_the_help_shows_is_the_python_apis(argv, options, capsys):
  """What a user reads: each "(default X" of an option's `--help-all` text is the default of its
  field in the options classes (an option whose field defaults to None describes what None does
  in words instead)."""
  command = [word for word in argv if not word.startswith("-")][:len(argv)]
  command = command[:2] if command[0] in ("train", "synth", "preprocess") else command[:1]
  with pytest.raises(SystemExit):
    cli.main([*command, "--help-all"])
  text = capsys.readouterr().out.split("\noptions:\n", 1)[1]
  shown = {}
  for block in re.split(r"\n(?=  -)", text):
    name, found = re.match(r"  (-[\w-]+)", block), SHOWN_DEFAULT.search(
        " ".join(block.split("\n\n")[0].split()))
    if name and found:
      shown[name.group(1)] = found.group(1).rstrip(",")
  parser = cli.build_parser()._subparsers._group_actions[0].choices[command[0]]
  if len(command) == 2:
    parser = parser._subparsers._group_actions[0].choices[command[1]]
  fields = _fields(options)
  compared = {action.option_strings[0]: fields[action.dest].default
              for action in parser._actions if action.option_strings
              and action.option_strings[0] in shown and action.dest in fields
              and fields[action.dest].default not in (None, dataclasses.MISSING)
              and not isinstance(fields[action.dest].default, bool)}  # a flag says what off is
  differ = {option: (shown[option], default) for option, default in compared.items()
            if not _same_default(shown[option], default)}
  assert compared and not differ, (sorted(compared), differ)


@pytest.mark.parametrize("argv, hint", [
    (["train", "ctr", "--data", "d", "--algoritm", "dp_sgd"],
     "unrecognized arguments: --algoritm dp_sgd (did you mean --algorithm?)"),
    (["train", "ctr", "--data", "d", "--algorithm", "dp_adafst"], "; did you mean dp_adafest?"),
    (["trian", "ctr"], "; did you mean train?"),
])
def test_misspelt_options_and_choices_get_the_closest_suggested(capsys, argv, hint):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and hint in err, err
  assert "--algoritm" not in argv or err.startswith("usage: dprec train ctr")


@pytest.mark.parametrize("argv, refusal", [
    (["train", "ctr", "--data", "d", "--algorithm", "non_private", "--epsilon", "1"],
     "drop --epsilon 1"),
    (["stream", "--data", "d", "--algorithm", "non_private", "--epsilon", "2"],
     "drop --epsilon 2"),
    (["train", "ctr", "--data", "d", "--algorithm", "dp_sgd", "--epsilon", "inf"],
     "finite --epsilon for --algorithm dp_sgd"),
])
def test_non_private_and_a_finite_epsilon_contradict_each_other(capsys, argv, refusal):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and refusal in err, err


@pytest.mark.parametrize("argv", [["--epsilon", "inf"], ["--algorithm", "non_private"],
                                  ["--algorithm", "non_private", "--epsilon", "inf"]])
def test_epsilon_inf_is_algorithm_non_private(monkeypatch, capsys, argv):
  from dprec.workflows import ctr
  from dprec.workflows import result
  from dprec.workflows import run_summary
  seen = {}
  monkeypatch.setattr(ctr, "run", lambda options: seen.update(
      algorithm=options.algorithm, epsilon=options.epsilon) or {})
  monkeypatch.setattr(result, "train_ctr", lambda summary: "")
  monkeypatch.setattr(run_summary, "report", lambda summary, options, line: 0)
  assert cli.main(["train", "ctr", "--data", "d", *argv]) == 0
  assert seen == {"algorithm": "non_private", "epsilon": None}


@pytest.fixture
def other_commands_data(tmp_path):
  """{kind: path} of data each training command refuses: interaction lines, a sequences output
  (its manifest), Criteo day files and one of them."""
  (tmp_path / "seq.txt").write_text("1 17\n1 14\n2 3\n")
  (tmp_path / "sequences").mkdir()
  (tmp_path / "sequences" / "manifest.json").write_text('{"format": "dprec-sequences-v1"}')
  (tmp_path / "days").mkdir()
  for day in range(2):
    (tmp_path / "days" / f"day_{day}").write_text("\t".join(["1"] + ["3"] * 13 + ["a1"] * 26))
  return {name: str(tmp_path / name) for name in ("seq.txt", "sequences", "days")}


@pytest.mark.parametrize("command, data, suggested", [
    (["train", "ctr"], "seq.txt", "`dprec preprocess sequences --input {} --format sasrec"),
    (["train", "ctr"], "sequences", "`dprec train seqrec --data {} --epsilon E`"),
    (["train", "ctr"], "days/day_0", "give --data its directory"),
    (["stream"], "seq.txt", "`dprec train seqrec --data DIR`"),
    (["stream"], "days", "`dprec preprocess criteo --streaming --input {} --output OUT`"),
    (["train", "seqrec", "--epsilon", "1"], "days", "`dprec train ctr --data {}`"),
    (["train", "seqrec", "--epsilon", "1"], "seq.txt",
     "run `dprec preprocess sequences --input {} --format sasrec --output DIR`, then"),
])
def test_another_commands_data_is_refused_naming_the_command_that_takes_it(
    capsys, other_commands_data, command, data, suggested):
  root, _, rest = data.partition("/")
  path = os.path.join(other_commands_data[root], rest) if rest else other_commands_data[root]
  assert cli.main([*command, "--data", path]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and suggested.format(path) in err, err


PARSED_WITHOUT_TENSORFLOW = [
    (["train", "ctr", "--data", "d", "--algoritm", "dp_sgd"], 2), (["train", "ctr", "--help"], 0),
    (["train", "seqrec", "--data", "d", "--modle", "x"], 2), (["train", "--help"], 0),
    (["stream", "--help"], 0), (["stream", "--data", "d", "--period-dayz", "1"], 2),
    (["demo", "--help"], 0), (["--help"], 0)]


@pytest.fixture
def parsed_in_a_fresh_process(once_per_session):
  """[(exit code, whether TensorFlow is loaded)] after each argv of `PARSED_WITHOUT_TENSORFLOW`,
  run in that order in one fresh process, once a session (modules only accumulate there:
  TensorFlow loaded by one argv would show at every later one too)."""
  import subprocess
  script = ("import json, sys; from dprec import cli\nfor argv in json.loads(sys.argv[1]):\n"
            "  try:\n    cli.main(argv)\n  except SystemExit as exit:\n"
            "    print('exit', exit.code, 'tensorflow' in sys.modules)")

  def run(unused_directory):
    done = subprocess.run([sys.executable, "-c", script,
                           json.dumps([argv for argv, _ in PARSED_WITHOUT_TENSORFLOW])],
                          capture_output=True, text=True, check=True)
    return [line.split(" ", 1)[1] for line in done.stdout.splitlines()
            if line.startswith("exit ")]

  return once_per_session("parsed_without_tensorflow", run)[1]


@pytest.mark.parametrize("index", range(len(PARSED_WITHOUT_TENSORFLOW)))
def test_arguments_are_parsed_and_refused_without_tensorflow(parsed_in_a_fresh_process, index):
  """A fresh process: the parsers of `train`, `stream` and `demo` (their options, names and
  defaults) load no TensorFlow, so a mistake is refused at once."""
  argv, code = PARSED_WITHOUT_TENSORFLOW[index]
  assert len(parsed_in_a_fresh_process) == len(PARSED_WITHOUT_TENSORFLOW)
  assert parsed_in_a_fresh_process[index] == f"{code} False", argv


def test_the_command_lines_algorithm_names_are_the_dp_steps():
  from dprec.optimizers import config as config_lib
  from dprec.optimizers import defaults
  assert tuple(config_lib.ALGORITHMS) == defaults.ALGORITHMS
  assert defaults.PRESELECTED == tuple(name for name, algorithm in config_lib.ALGORITHMS.items()
                                       if algorithm.preselected)
