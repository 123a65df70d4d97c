"""Each guide's main example (the first shell block of docs/guide/*.md) runs as written, in a fresh
temporary directory, with the `dprec` command of this environment: only sizes shrink (rows,
epochs, the tower), Beam jobs run on one in-process worker (each worker process of the default
runner imports TensorFlow again; the jobs on two worker processes: tests/pipelines/
test_criteo_batch.py, and `dprec preprocess` on them: tests/test_cli.py) and, where a guide starts
from files it does not make (a days directory, a ledger), a setup step makes them first.

A plain `dprec ...` line runs in this process (`dprec.cli.main` on its words, in the example's
directory): a fresh process would only add a TensorFlow import per command (a fresh process's
parsing and help: tests/test_cli.py). Every other line (loops, pipes, files written by the shell)
runs in bash, and an example with a command in the background runs in bash whole."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.commands

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guide"
SYNTH_DAYS = "dprec synth criteo --rows 3000 --days 3 --seed 0 --vocab scaled:3k --output {}"
SYNTH_SEQUENCES = "dprec synth sequences --users 200 --items 60 --seed 0 --output {}"
IN_PROCESS_BEAM = "--direct_running_mode=in_memory --direct_num_workers=1"

# What each guide's example needs beforehand (shell, run in the same directory).
SETUP = {
    "audit": SYNTH_DAYS.format("days"),
    "dp_forward": SYNTH_SEQUENCES.format("seq.txt") + "\n"
                  "dprec preprocess sequences --input seq.txt --format sasrec --output seqs "
                  + IN_PROCESS_BEAM,
    "preprocess": SYNTH_DAYS.format("data/criteo") + "\n"
                  "mkdir -p logs incoming && for f in data/criteo/day_*; do "
                  "gzip -c $f > logs/$(basename $f).gz; cp $f incoming/; done\n"
                  + SYNTH_SEQUENCES.format("Video.txt"),
    "privacy_accounting": "python -c \"from dprec import privacy; "
                          "privacy.PrivacyLedger('run/ctr/ledger.json', 1.0, 1e-6)\"",
    "stream": SYNTH_DAYS.format("days") + "\nmkdir -p incoming && cp days/day_* incoming/",
}
# Smaller sizes: (pattern, replacement) on the example's text.
SIZES = [
    (r"--rows \d+", "--rows 3000 --vocab scaled:3k"),
    (r"--users \d+", "--users 200"), (r"--items \d+", "--items 60"),
    (r"--epochs \d+", "--epochs 1"), (r"--idle-timeout 600", "--idle-timeout 3"),
    (r"--train-days 18", "--train-days 2"),
    (r"--examples-per-period \d+", "--examples-per-period 1000"),
    # 3,000 rows: one bucket a feature (DP top-k refuses a selection that can keep nothing)
    (r"--top-k-per-feature 20 --top-k-epsilon 2", "--top-k-per-feature 1 --top-k-epsilon 2"),
    (r" \[[^\]]*\]", ""),  # optional arguments shown in brackets
]
# Appended to each command of that name: few steps, a small tower, no progress bars, Beam in
# this process.
FAST = {
    "dprec preprocess": IN_PROCESS_BEAM,
    "dprec train ctr": "--steps 3 --batch-size 64 --hidden-units 8 --no-progress",
    "dprec train seqrec": "--epochs 1 --max-len 8 --dim 8 --blocks 1 --batch-size 32 "
                          "--no-progress",
    "dprec audit": "--runs 1 --canaries 8 --steps 3 --batch-size 64 --hidden-units 8",
    "dprec stream": "--batch-size 64 --hidden-units 8 --no-progress",
}


def shell_blocks(path):
  """The file's shell blocks (fenced with no language, bash, sh or shell; not python), in
  order, continuation lines joined."""
  blocks, block, language = [], None, ""
  for line in path.read_text(encoding="utf-8").splitlines():
    if not line.startswith("```"):
      if block is not None:
        block.append(line + "\n")
    elif block is None:
      block, language = [], line[3:].strip()
    else:
      if language in ("", "bash", "sh", "shell"):
        blocks.append("".join(block).replace("\\\n", " "))
      block = None
  return blocks


def main_example(guide):
  """The guide's first shell block, continuation lines joined."""
  return shell_blocks(GUIDES / f"{guide}.md")[0]


def runnable(example):
  """The example with smaller sizes and the fast options added to each dprec command."""
  for pattern, replacement in SIZES:
    example = re.sub(pattern, replacement, example)
  lines = []
  for line in example.splitlines():
    command, _, comment = line.partition("#")
    for name, options in FAST.items():
      if command.strip().startswith(name):
        background = command.rstrip().endswith("&")
        command = command.rstrip().rstrip("&") + f" {options}" + (" &" if background else "")
    lines.append(command + (f"  #{comment}" if comment and command.strip() else ""))
  return "\n".join(lines) + "\nwait\n"


# A line `dprec` can run in this process: one command, no shell syntax around it.
IN_PROCESS = re.compile(r"^dprec [^|<>;&$`()*]*$")


def _bash(script, cwd):
  env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
  done = subprocess.run(["bash", "-c", f"set -e\n{script}"], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=1500)
  assert done.returncode == 0, f"{script}\n--- stderr:\n{done.stderr[-4000:]}"
  assert "Traceback" not in done.stderr, done.stderr[-4000:]


def steps(script):
  """The script as (in_process, text) steps: each plain `dprec` line alone (its words), the
  lines between them as one bash step; the whole script one bash step if anything runs in the
  background."""
  lines = [line.partition("  #")[0].strip() for line in script.splitlines()]
  lines = [line for line in lines if line and line != "wait"]
  if any(line.endswith("&") for line in lines):
    return [(False, script)]
  result = []
  for line in lines:
    if IN_PROCESS.match(line):
      result.append((True, shlex.split(line)[1:]))
    elif result and not result[-1][0]:
      result[-1] = (False, result[-1][1] + "\n" + line)
    else:
      result.append((False, line))
  return result


@pytest.mark.slow
@pytest.mark.parametrize("guide", sorted(path.stem for path in GUIDES.glob("*.md")))
def test_main_example_runs_in_a_fresh_directory(guide, tmp_path, monkeypatch, capsys):
  from dprec import cli
  monkeypatch.chdir(tmp_path)
  for in_process, step in steps(f"{SETUP.get(guide, '')}\n{runnable(main_example(guide))}"):
    if not in_process:
      _bash(step, tmp_path)
      continue
    code = cli.main(step)
    err = capsys.readouterr().err
    assert code == 0, f"dprec {shlex.join(step)}\n--- stderr:\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]


def test_plain_dprec_lines_run_in_process_and_the_rest_in_bash():
  script = ("dprec synth criteo --rows 10 --output d  # a comment\nmkdir -p x\ncp d/* x/\n"
            "dprec train ctr --data x\nfor f in x/*; do gzip $f; done\nwait\n")
  assert steps(script) == [
      (True, ["synth", "criteo", "--rows", "10", "--output", "d"]),
      (False, "mkdir -p x\ncp d/* x/"), (True, ["train", "ctr", "--data", "x"]),
      (False, "for f in x/*; do gzip $f; done")]
  background = "dprec preprocess criteo --streaming --input i --output o &\ndprec stream --data o\n"
  assert steps(background) == [(False, background)]


def _command_lines(path):
  """Every `dprec ...` line of the file's shell blocks, continuation lines joined, without its
  comment, its trailing `&` and its optional arguments in brackets."""
  for block in shell_blocks(path):
    for line in block.splitlines():
      line = re.sub(r" \[[^\]]*\]", "", line.partition(" #")[0]).strip().rstrip("&").strip()
      if line.startswith("dprec "):
        yield line


def test_every_command_line_of_the_guides_and_readme_parses():
  """Beyond the main examples that run: every `dprec` line of every shell block names a command
  and options that exist, with values they accept (lines with a `...` placeholder excepted)."""
  from dprec import cli
  parser, checked = cli.build_parser(), 0
  for path in [*sorted(GUIDES.glob("*.md")), ROOT / "README.md"]:
    for line in _command_lines(path):
      if " ... " in line:
        continue
      try:
        parser.parse_args(shlex.split(line)[1:])
      except SystemExit:
        pytest.fail(f"{path.name}: {line}")
      checked += 1
  assert checked > 30


def test_every_guide_has_a_main_example():
  for path in GUIDES.glob("*.md"):
    assert "dprec " in main_example(path.stem), path.name
