"""`dprec synth criteo|sequences`: files in the contracted places and a JSON summary."""
import json
import os

from dprec import cli
from dprec.data import criteo


def test_synth_criteo_writes_day_files_and_summary(tmp_path, capsys):
  out = str(tmp_path / "criteo")
  code = cli.main(["synth", "criteo", "--rows", "1001", "--days", "3", "--seed", "2", "--out", out,
                   "--vocab", "scaled:5000", "--no-progress"])
  assert code == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["rows"] == 1001 and summary["days"] == 3
  assert summary["files"] == [os.path.join(out, f"day_{d}") for d in range(3)]
  assert 0 < summary["top1pct_bucket_share"] <= 1
  rows = [len(criteo.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(f))))
          for f in summary["files"]]
  assert rows == [334, 334, 333]


def test_synth_sequences_writes_user_item_lines(tmp_path, capsys):
  out = str(tmp_path / "seq.txt")
  assert cli.main(["synth", "sequences", "--users", "50", "--items", "30", "--seed", "1",
                   "--out", out, "--no-progress"]) == 0
  summary = json.loads(capsys.readouterr().out)
  lines = open(out).read().splitlines()
  assert len(lines) == summary["actions"] >= 150
  assert lines[0].split(" ")[0] == "1" and lines[-1].split(" ")[0] == "50"


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
  code = cli.main(["synth", "criteo", "--rows", "10", "--out", str(tmp_path), "--vocab", "big"])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1 and "scaled:M" in err
  code = cli.main(["synth", "sequences", "--users", "5", "--items", "9", "--out", str(tmp_path / "s"),
                   "--mean-length", "2"])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1 and "mean_length" in err
