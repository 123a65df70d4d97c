"""Synthetic Criteo generation speed and memory, and Criteo TSV parsing against pandas.

Table 1: rows/s and peak memory of `generate_criteo` for a small run and for `--rows` (peak
traced allocations stay flat as rows grow: generation streams fixed blocks). Table 2: parsing a
`--parse-rows` batch of the generated lines with `parse_bytes` (a file block) and `parse_lines`
(a Beam batch of str lines), against `pandas.read_csv` on the same bytes, side by side.

  .venv/bin/python benchmarks/generate_criteo.py --rows 5000000 --parse-rows 2000000
"""
import argparse
import io
import os
import resource
import tempfile
import time
import tracemalloc

import pandas as pd

from dprec.data import criteo_parse, synthetic


def _generate(directory, rows, vocab):
  tracemalloc.start()
  start = time.perf_counter()
  summary = synthetic.generate_criteo(directory, rows, 1, 0, vocab, progress=False)
  seconds = time.perf_counter() - start
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  size = sum(os.path.getsize(f) for f in summary["files"])
  return seconds, peak, size


def _timed(function):
  start = time.perf_counter()
  function()
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=5_000_000)
  parser.add_argument("--parse-rows", type=int, default=2_000_000)
  parser.add_argument("--vocab", default="table3")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as directory:
    print(f"generate_criteo (vocab={args.vocab}, one day file)")
    print("| rows | seconds | rows/s | peak traced MiB | output MiB |")
    print("|---:|---:|---:|---:|---:|")
    for rows in (args.rows // 10, args.rows):
      seconds, peak, size = _generate(os.path.join(directory, str(rows)), rows, args.vocab)
      print(f"| {rows:,} | {seconds:.1f} | {rows / seconds:,.0f} | {peak / 2**20:.0f} | "
            f"{size / 2**20:.0f} |")
    with open(os.path.join(directory, str(args.rows), "day_0"), "rb") as stream:
      data = b"".join(stream.readline() for _ in range(args.parse_rows))
  lines = data.decode().splitlines()
  rows = len(lines)
  times = {
      "pandas.read_csv (yardstick)": _timed(lambda: pd.read_csv(
          io.BytesIO(data), sep="\t", header=None, dtype={i: str for i in range(14, 40)})),
      "criteo.parse_bytes": _timed(lambda: criteo_parse.parse_bytes(data, "day_0")),
      "criteo.parse_lines (Beam batch)": _timed(lambda: criteo_parse.parse_lines(lines, "day_0")),
  }
  baseline = times["pandas.read_csv (yardstick)"]
  print(f"\nparsing {rows:,} generated lines ({len(data) / 2**20:.0f} MiB)")
  print("| parser | seconds | rows/s | time / pandas |")
  print("|---|---:|---:|---:|")
  for name, seconds in times.items():
    print(f"| {name} | {seconds:.2f} | {rows / seconds:,.0f} | {seconds / baseline:.2f} |")
  print(f"\nprocess max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")


if __name__ == "__main__":
  main()
