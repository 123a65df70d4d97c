"""Held-out AUC of `dprec train ctr` in memory and `--out-of-core`, the same data and defaults,
over draws ("AUC of both at 4M rows with three draws each (same within noise)"; the
batch job is Chua et al.'s, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS 2024).

One invocation is one run of the CLI, end to end, with its defaults (one epoch, DP base rate, DP
Platt scaling; each run draws its own secret key: a draw; --seed, the public initialisation,
default 0 as `train ctr`'s); its summary's test AUC, log loss and DP base rate are appended to
--jsonl with the wall time, the load averages before and after and the peak RSS of the run
(`getrusage` of the waited-for children: the largest process, not a sum).
A (path, draw, seed) already in --jsonl is skipped; --report prints mean ± SE per path (of the
runs at --seeds), the difference (out of core − in memory) with its SE, and the base rate:

    /tmp/heavy nice -n 10 .venv/bin/python benchmarks/out_of_core_auc.py --data DIR \\
        --jsonl F.jsonl --path memory --draw 0        # then --path out_of_core, draws 1, 2
                                   # (and --path non_private: the non-private reference)
    .venv/bin/python benchmarks/out_of_core_auc.py --jsonl F.jsonl --report
"""
import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import jsonl_records

DPREC = os.path.join(os.path.dirname(sys.executable), "dprec")
KEPT = ("auc", "eval_log_loss", "base_rate", "base_rate_log_loss", "epsilon", "delta", "steps",
        "batch_size", "noise_multiplier", "train_rows", "eval_rows", "calibration_scale",
        "calibration_shift", "out_of_core", "peak_batch_size", "run_id")


def run_once(args):
  """Trains once on `args.path`'s way and appends the run's line to `args.jsonl`."""
  if any((r["path"], r["draw"], r.get("seed", 0)) == (args.path, args.draw, args.seed)
         for r in jsonl_records.read(args.jsonl)):
    print(f"# {args.path} draw {args.draw} seed {args.seed}: already in {args.jsonl}",
          file=sys.stderr)
    return
  scratch = tempfile.mkdtemp(prefix="ooc_auc_", dir=args.scratch)
  summary_path = os.path.join(scratch, "summary.json")
  algorithm = (["--algorithm", "non_private"] if args.path == "non_private"
               else ["--algorithm", "dp_adafest", "--epsilon", "1"])
  command = [DPREC, "train", "ctr", "--data", args.data, *algorithm, "--no-progress",
             "--run-dir", os.path.join(scratch, "run"), "--summary-json", summary_path,
             "--seed", str(args.seed)]
  command += ["--out-of-core"] if args.path == "out_of_core" else []
  load_before = os.getloadavg()
  start = time.time()
  subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
  wall = time.time() - start
  with open(summary_path, encoding="utf-8") as stream:
    summary = json.load(stream)
  shutil.rmtree(scratch)
  line = dict(path=args.path, draw=args.draw, seed=args.seed, data=args.data,
              command=" ".join(command[1:]),
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
              wall_seconds=round(wall, 1), load_before=load_before, load_after=os.getloadavg(),
              peak_rss_kb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
              **{key: summary.get(key) for key in KEPT})
  with open(args.jsonl, "a", encoding="utf-8") as stream:
    stream.write(json.dumps(line) + "\n")
  print(json.dumps(line))


def mean_se(values):
  values = [v for v in values if v is not None]
  if not values:
    return float("nan"), float("nan")
  mean = sum(values) / len(values)
  if len(values) < 2:
    return mean, float("nan")
  var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
  return mean, math.sqrt(var / len(values))


def report(runs):
  """Mean ± SE per path of test AUC, log loss and the DP base rate; the difference of the means
  with the SE of a difference of independent means."""
  stats = {}
  print("| path | draws | test AUC | log loss | DP base rate | base-rate log loss | wall s |")
  print("|---|---:|---|---|---|---|---:|")
  for path in ("memory", "out_of_core", "non_private"):
    mine = [r for r in runs if r["path"] == path]
    if not mine:
      continue
    stats[path] = {key: mean_se([r.get(key) for r in mine])
                   for key in ("auc", "eval_log_loss", "base_rate", "base_rate_log_loss",
                               "wall_seconds")}
    cells = [f"{m:.4f} ± {se:.4f}" for m, se in (stats[path][key] for key in
             ("auc", "eval_log_loss", "base_rate", "base_rate_log_loss"))]
    print(f"| {path} | {len(mine)} | " + " | ".join(cells)
          + f" | {stats[path]['wall_seconds'][0]:.0f} |")
  if "memory" in stats and "out_of_core" in stats:
    for key in ("auc", "eval_log_loss"):
      (m0, se0), (m1, se1) = stats["memory"][key], stats["out_of_core"][key]
      print(f"{key}: out of core − in memory = {m1 - m0:+.4f} ± {math.hypot(se0, se1):.4f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--jsonl", required=True, help="one line a finished run")
  parser.add_argument("--data", help="TSV day_N files (the last is held out)")
  parser.add_argument("--path", choices=("memory", "out_of_core", "non_private"),
                      help="non_private: the non-private reference, in memory")
  parser.add_argument("--draw", type=int)
  parser.add_argument("--seed", type=int, default=0, help="train ctr's --seed (initialisation)")
  parser.add_argument("--seeds", type=int, nargs="*", help="--report: only runs at these seeds")
  parser.add_argument("--scratch", default=None, help="where run directories go (then removed)")
  parser.add_argument("--report", action="store_true", help="only print the table")
  args = parser.parse_args(argv)
  if args.report:
    report([r for r in jsonl_records.read(args.jsonl)
            if args.seeds is None or r.get("seed", 0) in args.seeds])
  elif args.data and args.path and args.draw is not None:
    run_once(args)
  else:
    parser.error("--data, --path and --draw (one run), or --report")


if __name__ == "__main__":
  main()
