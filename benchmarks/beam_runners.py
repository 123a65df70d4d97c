"""The Criteo batch job on the embedded runner and on a 2-process local Dask cluster, same input.

    .venv/bin/python benchmarks/beam_runners.py --rows 2000000 [--data DIR] [--days 2]

Runs `dprec preprocess criteo` twice as a user would (a fresh process each: the embedded runner's
default 2 worker processes; `--runner DaskRunner --dask-workers 2`, a `distributed.LocalCluster`
the command starts and stops) and prints wall time, rows/s and peak memory: the largest sum of
resident memory over the command's whole process tree (sampled every 0.2 s: driver, runner
workers, Dask scheduler, nannies and workers) and its largest single process. Checks that both
wrote the same bytes (every file but the JSON files, whose run-specific path and dataset id
differ). Prints the load average before and after: on a shared machine both times are inflated.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time

import criteo_input
import machine
import psutil  # installed with distributed (apache-beam[dask])


RUNNERS = {"embedded (FnApiRunner, 2 processes)": [],
           "Dask (LocalCluster, 2 processes)": ["--runner", "DaskRunner", "--dask-workers", "2"]}


def run_measured(command):
  """(seconds, peak MiB of the process tree's summed RSS, peak MiB of its largest process)."""
  start = time.perf_counter()
  process = psutil.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  tree_peak = single_peak = 0
  while process.poll() is None:
    rss = []
    for member in [process] + process.children(recursive=True):
      try:
        rss.append(member.memory_info().rss)
      except psutil.Error:
        pass
    tree_peak, single_peak = max(tree_peak, sum(rss)), max(single_peak, max(rss, default=0))
    time.sleep(0.2)
  seconds = time.perf_counter() - start
  if process.returncode:
    raise SystemExit(f"{' '.join(command)} failed with exit code {process.returncode}")
  return seconds, tree_peak / 2**20, single_peak / 2**20


def digests(directory):
  """{relative path: sha256} of every non-JSON file under `directory`."""
  found = {}
  for root, _, names in os.walk(directory):
    for name in names:
      if not name.endswith(".json"):
        path = os.path.join(root, name)
        with open(path, "rb") as stream:
          found[os.path.relpath(path, directory)] = hashlib.sha256(stream.read()).hexdigest()
  return found


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  criteo_input.add_arguments(parser)
  args = parser.parse_args(argv)
  work = tempfile.mkdtemp(prefix="beam_runners_")
  data, _, size = criteo_input.day_files(args, work)
  dprec = [sys.executable, "-m", "dprec.cli", "preprocess", "criteo", "--input", data]
  rows, outputs = [], []
  print(f"before: {machine.describe()}", flush=True)
  for name, extra in RUNNERS.items():
    output = os.path.join(work, f"out{len(outputs)}")
    rows.append((name, *run_measured(dprec + ["--output", output] + extra)))
    outputs.append(digests(output))
  print(f"after: {machine.describe()}")
  same = all(found == outputs[0] for found in outputs[1:])
  print(f"\n{args.rows:,} rows, {args.days} day files, {size:.0f} MiB of TSV; the same bytes in "
        f"all {len(outputs[0])} non-JSON output files: {same}\n")
  print("| runner | wall s | rows/s | peak RSS of the process tree MiB | largest process MiB |")
  print("|---|---:|---:|---:|---:|")
  for name, seconds, tree, single in rows:
    print(f"| {name} | {seconds:.1f} | {args.rows / seconds:,.0f} | {tree:,.0f} | {single:,.0f} |")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
