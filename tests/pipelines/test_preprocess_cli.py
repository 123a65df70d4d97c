"""`dprec preprocess`: Beam options pass through, help everywhere, one-line errors, JSON result."""
import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipelines
from dprec import cli
from dprec import quiet

pytestmark = pytest.mark.commands


def test_unknown_options_go_to_beam():
  args = cli.build_parser().parse_args([
      "preprocess", "criteo", "--input", "in", "--output", "out", "--runner", "DataflowRunner",
      "--project=p", "--vocab-mode", "top_k", "--top-k-per-feature", "5", "--streaming"])
  assert args.beam_args == ["--runner=DataflowRunner", "--project=p"]
  assert (args.vocab_mode, args.top_k, args.streaming) == ("top_k", "5", True)


@pytest.mark.parametrize("argv", [["preprocess"], ["preprocess", "criteo"],
                                  ["preprocess", "sequences"]])
def test_help(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv + ["--help"])
  assert exit_info.value.code == 0
  assert "usage: dprec preprocess" in capsys.readouterr().out


def test_sequences_command_prints_json_and_errors_are_one_line(tmp_path, capsys, in_process):
  (tmp_path / "good.txt").write_text("1 5\n1 6\n2 5\n")
  out = str(tmp_path / "out")
  assert cli.main(["preprocess", "sequences", "--input", str(tmp_path / "good.txt"), "--format",
                   "sasrec", "--output", out] + in_process) == 0
  captured = capsys.readouterr()
  summary = json.loads(captured.out)
  assert (summary["users"], summary["items"], summary["actions"]) == (2, 2, 3)
  # A line as the Beam job starts and one with the rows done (its workers' logs held back).
  assert captured.err.startswith("preprocess sequences: 1 input files: parsing")
  assert "\npreprocess sequences: 3 lines read, 0 dead letters, 2 users kept, in" in captured.err

  code = cli.main(["preprocess", "criteo", "--input", str(tmp_path / "none_*"), "--output", out]
                  + in_process)
  captured = capsys.readouterr()
  assert code == 2 and captured.err.count("\n") == 1 and "no input files match" in captured.err
  code = cli.main(["preprocess", "criteo", "--input", str(tmp_path), "--output", out,
                   "--streaming", "--vocab-mode", "dp_top_k", "--top-k-per-feature", "3",
                   "--top-k-epsilon", "1"])
  assert code == 2 and "DP top-k selection is a batch job" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["criteo", "criteo_stream", "sequences"])
def test_python_m_entry_points_show_help_with_defaults(module, capsys):
  job = importlib.import_module(f"pipelines.{module}")
  with pytest.raises(SystemExit) as exit_info:
    job.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert f"usage: python -m pipelines.{module}" in out and "(default" in out
  assert ("--idle-timeout" in out) == (module == "criteo_stream")


def test_python_m_sequences_prints_json_and_passes_beam_options(tmp_path, capsys, in_process):
  from pipelines import sequences
  (tmp_path / "good.txt").write_text("1 5\n1 6\n2 5\n")
  assert sequences.main(["--input", str(tmp_path / "good.txt"), "--format", "sasrec",
                         "--output", str(tmp_path / "out")] + in_process) == 0
  assert json.loads(capsys.readouterr().out)["actions"] == 3


def test_the_job_modules_do_not_import_the_command_line_module():
  """`pipelines.cli` imports the jobs; the jobs' own `python -m` entry points import only
  `pipelines.beam_io`, so nothing imports in a circle."""
  for path in sorted(Path(pipelines.__file__).parent.glob("*.py")):
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ImportFrom) and node.module:
        imported.update(f"{node.module}.{alias.name}" for alias in node.names)
      elif isinstance(node, ast.Import):
        imported.update(alias.name for alias in node.names)
    assert "pipelines.cli" not in imported, path


def test_an_option_neither_the_job_nor_beam_knows_is_an_error(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.build_parser().parse_args(["preprocess", "criteo", "--input", "in", "--output", "out",
                                   "--min_count", "5"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "unrecognized arguments: --min_count 5" in err and "--vocab-min-count instead of" in err
  args = cli.build_parser().parse_args(["preprocess", "sequences", "--input", "in", "--format",
                                        "sasrec", "--output", "out", "--direct_num_workers=1",
                                        "--dask-workers", "3"])
  assert args.beam_args == ["--dask-workers=3", "--direct_num_workers=1"]


def test_dask_options_are_known_with_runner_dask():
  """Beam's Dask options exist once `--runner DaskRunner` is given (an option of the job's own
  parser: it was not seen, and `--dask_client_address` was refused)."""
  args = cli.build_parser().parse_args(["preprocess", "criteo", "--input", "in", "--output",
                                        "out", "--runner", "DaskRunner", "--dask_client_address",
                                        "sched:8786"])
  assert args.beam_args == ["--runner=DaskRunner", "--dask_client_address", "sched:8786"]


def test_old_option_names_still_work_and_say_they_are_deprecated(capsys):
  args = cli.build_parser().parse_args([
      "preprocess", "criteo", "--input", "in", "--output", "out", "--vocab-mode", "dp_top_k",
      "--top-k", "7", "--epsilon", "0.5"])
  assert (args.top_k, args.epsilon) == ("7", 0.5)
  err = capsys.readouterr().err
  assert "--top-k is deprecated" in err and "use --top-k-per-feature" in err
  assert "--epsilon is deprecated" in err and "use --top-k-epsilon" in err
  # One name a concept across commands: --output (synth's --out), --vocab-min-count (train
  # ctr's), --beam-option NAME=VALUE (train ctr --out-of-core's); short lines refused by default.
  args = cli.build_parser().parse_args([
      "preprocess", "criteo", "--input", "in", "--output", "out", "--min-count", "3",
      "--strict-columns", "--runner", "DaskRunner", "--beam-option", "dask_client_address=h:1"])
  assert (args.min_count, args.pad_short_lines) == (3, [])
  assert args.beam_args == ["--runner=DaskRunner", "--dask_client_address=h:1"]
  args = cli.build_parser().parse_args(["synth", "criteo", "--rows", "5", "--out", "d"])
  assert args.output == "d"
  err = capsys.readouterr().err
  assert "--min-count is deprecated" in err and "use --vocab-min-count" in err
  assert "--strict-columns is deprecated" in err and "--out is deprecated" in err
  assert "use --output" in err and err.count("\n") == 3


@pytest.mark.parametrize("streaming, said", [
    (False, "output is incomplete; run it again, replacing that output"),
    (True, "the periods written so far are complete; the same command continues")])
def test_ctrl_c_is_one_line(tmp_path, capfd, monkeypatch, streaming, said):
  """Ctrl-C: one line saying what the output is, and none of the libraries' logs held back."""
  def interrupted(*_):
    with quiet.held_stderr():
      os.write(2, b"INFO:root:a Beam worker's log\n")
      raise KeyboardInterrupt
  from pipelines import criteo, criteo_stream
  monkeypatch.setattr(criteo_stream if streaming else criteo, "run", interrupted)
  try:
    code = cli.main(["preprocess", "criteo", "--input", str(tmp_path), "--output", "out"]
                    + ["--streaming"] * streaming)
  except KeyboardInterrupt:
    pytest.fail("Ctrl-C escaped as a traceback")
  err = capfd.readouterr().err
  assert code == 2 and err.count("\n") == 1 and err.startswith("dprec: error: interrupted")
  assert said in err


def test_python_m_help_shows_no_beam_import_notice():
  """Beam logs "apitools not found" through the root logger as it is imported: not shown."""
  done = subprocess.run([sys.executable, "-m", "pipelines.criteo", "--help"], text=True,
                        capture_output=True, check=True,
                        cwd=Path(pipelines.__file__).parent.parent,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert "usage: python -m pipelines.criteo" in done.stdout and "--verbose" in done.stdout
  assert done.stderr == ""
