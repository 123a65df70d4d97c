"""`dprec synth criteo|sequences`: files in the contracted places and a JSON-ready summary.

The parser is built from `dprec.data.cli.register` alone (the `dprec` dispatcher, tested in
tests/test_cli.py, imports every command's module, Beam and TensorFlow included).
"""
import argparse
import json
import os

import pytest

from dprec.data import cli, criteo
from dprec.errors import DprecError


def _run(argv):
  parser = argparse.ArgumentParser(prog="dprec")
  cli.register(parser.add_subparsers(dest="command", required=True))
  args = parser.parse_args(argv)
  return json.loads(json.dumps(args.func(args)))


def test_synth_criteo_writes_day_files_and_summary(tmp_path):
  out = str(tmp_path / "criteo")
  summary = _run(["synth", "criteo", "--rows", "1001", "--days", "3", "--seed", "2", "--out", out,
                  "--vocab", "scaled:5000", "--no-progress"])
  assert summary["rows"] == 1001 and summary["days"] == 3
  assert summary["files"] == [os.path.join(out, f"day_{d}") for d in range(3)]
  assert 0 < summary["top1pct_bucket_share"] <= 1
  rows = [len(criteo.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(f))))
          for f in summary["files"]]
  assert rows == [334, 334, 333]


def test_synth_criteo_tail_decay_changes_only_the_clicks(tmp_path):
  """--tail-decay 0 writes the default bytes; a positive value keeps every feature column and
  redraws only the labels from the rarity-scaled click model."""
  out = {}
  for name, extra in (("plain", []), ("zero", ["--tail-decay", "0"]),
                      ("decayed", ["--tail-decay", "0.5"])):
    out[name] = str(tmp_path / name)
    _run(["synth", "criteo", "--rows", "3000", "--days", "2", "--out", out[name],
          "--vocab", "scaled:5000", "--no-progress"] + extra)
  for day in ("day_0", "day_1"):
    plain, zero, decayed = (open(os.path.join(out[n], day), "rb").read().splitlines()
                            for n in ("plain", "zero", "decayed"))
    assert plain == zero
    assert [l.split(b"\t", 1)[1] for l in plain] == [l.split(b"\t", 1)[1] for l in decayed]
    assert [l[:1] for l in plain] != [l[:1] for l in decayed]


def test_synth_sequences_writes_user_item_lines(tmp_path):
  out = str(tmp_path / "seq.txt")
  summary = _run(["synth", "sequences", "--users", "50", "--items", "30", "--seed", "1",
                  "--out", out, "--no-progress"])
  lines = open(out).read().splitlines()
  assert len(lines) == summary["actions"] >= 150
  assert lines[0].split(" ")[0] == "1" and lines[-1].split(" ")[0] == "50"


def test_synth_sequences_order_taste_reaches_the_generator(tmp_path):
  """--order taste with its two settings writes what the library writes for that config; the
  default order is the library's default (chain)."""
  from dprec.data import synthetic
  argv = ["synth", "sequences", "--users", "60", "--items", "40", "--seed", "2", "--no-progress"]
  _run(argv + ["--output", str(tmp_path / "cli.txt"), "--order", "taste", "--taste-clusters",
               "2", "--taste-share", "0.8"])
  synthetic.generate_sequences(str(tmp_path / "lib.txt"), 60, 40, 2, synthetic.SequenceSynthConfig(
      order="taste", taste_clusters=2, taste_share=0.8), progress=False)
  _run(argv + ["--output", str(tmp_path / "default.txt")])
  synthetic.generate_sequences(str(tmp_path / "chain.txt"), 60, 40, 2, progress=False)
  read = lambda name: (tmp_path / name).read_bytes()
  assert read("cli.txt") == read("lib.txt") != read("chain.txt") == read("default.txt")


def test_bad_arguments(tmp_path, capsys):
  with pytest.raises(DprecError, match="scaled:M"):
    _run(["synth", "criteo", "--rows", "10", "--out", str(tmp_path), "--vocab", "big"])
  with pytest.raises(DprecError, match="tail_decay"):
    _run(["synth", "criteo", "--rows", "10", "--out", str(tmp_path), "--tail-decay", "-1"])
  with pytest.raises(DprecError, match="mean_length"):
    _run(["synth", "sequences", "--users", "5", "--items", "9", "--out", str(tmp_path / "s"),
          "--mean-length", "2"])
  with pytest.raises(DprecError, match="share in"):
    _run(["synth", "sequences", "--users", "5", "--items", "9", "--out", str(tmp_path / "s"),
          "--order", "taste", "--taste-share", "1"])
  with pytest.raises(SystemExit):
    _run(["synth", "criteo", "--rows", "0", "--out", str(tmp_path)])
  assert "--rows: must be a positive integer, got 0" in capsys.readouterr().err
