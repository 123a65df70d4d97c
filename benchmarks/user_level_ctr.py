"""`dprec train ctr --privacy-unit user`: user-level sampling (ULS) against example-level sampling
with group privacy (ELS), at user-level ε, beside the row level, non-private and the base rate.

    nice -n 10 python benchmarks/user_level_ctr.py --rows 500000 --users 20000 --draws 1
    python benchmarks/user_level_ctr.py --rows 500000 --users 20000 --report
    python benchmarks/user_level_ctr.py --rows 500000 --users 20000 --timing

The data is `dprec synth criteo --rows R --days 3 --users U` (made once under `--root`; the last
day held out). A cell is one `train ctr` run in memory, the data loaded once for all of them:
(point, ε, algorithm, draw), a point being `uls` (--user-sampling users), `els` (--user-sampling
rows), `row` (the row level) or `non_private`; draws differ only in the run's secret key. Each
finished cell appends a line to `--jsonl` and a rerun skips the cells there, so the grid resumes.
Cells run in the order of `--points` and `--epsilons` (ULS against ELS at every ε first).

`--timing` runs a few steps of ULS and of the row level at the same expected rows per batch
(the ULS batch's mean rows: B users times the mean of min(n_u, k)), alternately, in this
process, and prints steps/s and their ratio with the load average: indicative only on a shared
machine.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import warnings

import numpy as np

import jsonl_records
import machine

from dprec.data import ctr_data
from dprec.data import synthetic
from dprec.workflows import ctr as ctr_workflow
from dprec.workflows.ctr_options import CTRTrainOptions

POINTS = ("uls", "els", "row", "non_private")
FIELDS = ("auc", "eval_log_loss", "base_rate_log_loss", "eval_base_rate", "epsilon", "delta",
          "noise_multiplier", "sampling_rate", "batch_size", "steps", "users", "bounded_rows",
          "train_rows", "steps_per_second", "max_rows_per_user")


def data_dir(root, rows, users, seed):
  """The generated days (made on first use)."""
  directory = os.path.join(root, f"criteo_{rows}_users_{users}_seed_{seed}")
  if not os.path.exists(os.path.join(directory, "day_2")):
    synthetic.generate_criteo(directory, rows=rows, days=3, seed=seed, vocab="scaled:0.05",
                              config=synthetic.CriteoSynthConfig(users=users), progress=False)
  return directory


def options_of(directory, point, epsilon, algorithm, k, steps=None):
  """The `train ctr` options of a cell (the command's defaults otherwise; `steps`: T)."""
  common = dict(data=directory, progress=False, steps=steps)
  if point == "non_private":
    return CTRTrainOptions(algorithm="non_private", **common)
  user = dict(privacy_unit="user", max_rows_per_user=k,
              user_sampling="users" if point == "uls" else "rows") if point != "row" else {}
  return CTRTrainOptions(algorithm=algorithm, epsilon=epsilon, **user, **common)


def cells(args):
  """(point, ε, algorithm, draw) in the order they run."""
  for algorithm in args.algorithms:
    for draw in range(args.draws):
      for epsilon in args.epsilons:
        for point in ("uls", "els"):
          if point in args.points:
            yield (f"{point}_T{args.steps}" if args.steps else point), epsilon, algorithm, draw
      if "row" in args.points:
        yield "row", 1.0, algorithm, draw
  for draw in range(args.draws):
    if "non_private" in args.points:
      yield "non_private", None, "non_private", draw


def key(record):
  return (record["point"], record["epsilon_target"], record["algorithm"], record["draw"])


def run_grid(args):
  directory = data_dir(args.root, args.rows, args.users, args.seed)
  done = {key(r) for r in jsonl_records.read(args.jsonl)
          if r["rows"] == args.rows and r["users_generated"] == args.users}
  data = None
  for point, epsilon, algorithm, draw in cells(args):
    if (point, epsilon, algorithm, draw) in done:
      continue
    if data is None:
      data = ctr_data.load_data(directory, user_ids=True)
      counts = np.unique(data.train["user_id"], return_counts=True)[1]
      print(f"{len(data.train['label']):,} training rows, {len(counts):,} users: rows per user "
            f"median {np.median(counts):g}, max {counts.max():,}; {machine.describe()}",
            flush=True)
    options = options_of(directory, point.split("_T")[0], epsilon, algorithm,
                         args.max_rows_per_user, args.steps)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      summary = ctr_workflow.run(options, data=data)
    record = {"rows": args.rows, "users_generated": args.users, "point": point,
              "epsilon_target": epsilon, "algorithm": algorithm, "draw": draw,
              "load": os.getloadavg()[0], **{f: summary.get(f) for f in FIELDS}}
    with open(args.jsonl, "a", encoding="utf-8") as stream:
      stream.write(json.dumps(record) + "\n")
    print(f"{point} ε={epsilon} {algorithm} draw {draw}: AUC {record['auc']:.4f}, log loss "
          f"{record['eval_log_loss']:.4f}, σ {record['noise_multiplier']}, B "
          f"{record['batch_size']}, T {record['steps']}", flush=True)


def report(args):
  records = [r for r in jsonl_records.read(args.jsonl)
             if r["rows"] == args.rows and r["users_generated"] == args.users]
  groups = {}
  for record in records:
    groups.setdefault((record["point"], record["epsilon_target"], record["algorithm"]),
                      []).append(record)
  print("| point | ε (unit) | algorithm | draws | AUC | log loss | σ | B | T |")
  print("|---|---|---|---|---|---|---|---|---|")
  order = {p: i for i, p in enumerate(POINTS)}
  for (point, epsilon, algorithm), group in sorted(
      groups.items(), key=lambda kv: (kv[0][2], kv[0][1] or 0, order[kv[0][0].split("_T")[0]],
                                      kv[0][0])):
    unit = {"uls": "user", "els": "user", "row": "row"}.get(point.split("_T")[0])
    print(f"| {point} | {'∞' if epsilon is None else f'{epsilon:g} per {unit}'} | {algorithm} | "
          f"{len(group)} | {_spread([g['auc'] for g in group])} | "
          f"{_spread([g['eval_log_loss'] for g in group])} | "
          f"{_first(group, 'noise_multiplier')} | {group[0]['batch_size']} | "
          f"{group[0]['steps']} |")
  if records:
    rate, loss = records[0]["eval_base_rate"], records[0]["base_rate_log_loss"]
    print(f"| base rate ({rate:.4f}) | — | — | — | 0.5 | {loss:.4f} | — | — | — |")


def _spread(values):
  if len(values) == 1:
    return f"{values[0]:.4f}"
  return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _first(group, field):
  value = group[0][field]
  return "—" if value is None else f"{value:.3g}"


def timing(args):
  """Steps/s of ULS and of the row level at the same expected rows per batch, alternately."""
  directory = data_dir(args.root, args.rows, args.users, args.seed)
  data = ctr_data.load_data(directory, user_ids=True)
  counts = np.unique(data.train["user_id"], return_counts=True)[1]
  uls = dataclasses.replace(options_of(directory, "uls", 4.0, args.algorithms[0],
                                       args.max_rows_per_user), steps=args.timing_steps)
  users_per_batch = ctr_workflow.default_batch_size(len(counts))
  rows_per_batch = int(round(users_per_batch * np.minimum(counts, uls.rows_per_user).mean()))
  uls = dataclasses.replace(uls, batch_size=users_per_batch)
  row = dataclasses.replace(options_of(directory, "row", 4.0, args.algorithms[0], None),
                            steps=args.timing_steps, batch_size=rows_per_batch)
  rates = {"uls": [], "row": []}
  for _ in range(args.timing_rounds):
    for name, options in (("uls", uls), ("row", row)):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rates[name].append(ctr_workflow.run(options, data=data)["steps_per_second"])
  uls_rate, row_rate = statistics.median(rates["uls"]), statistics.median(rates["row"])
  print(f"ULS: {users_per_batch} users a batch (~{rows_per_batch} rows), row level: "
        f"{rows_per_batch} rows; steps/s ULS {uls_rate:.2f} {rates['uls']}, row {row_rate:.2f} "
        f"{rates['row']}; step time ULS ÷ row = {row_rate / uls_rate:.2f}; "
        f"{machine.describe()}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=500_000)
  parser.add_argument("--users", type=int, default=20_000)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-rows-per-user", type=int, default=None,
                      help="k (default: train ctr's)")
  parser.add_argument("--epsilons", type=lambda s: [float(x) for x in s.split(",")],
                      default=[1.0, 4.0, 8.0])
  parser.add_argument("--algorithms", type=lambda s: s.split(","),
                      default=["dp_adafest", "dp_sgd"])
  parser.add_argument("--points", type=lambda s: s.split(","), default=list(POINTS))
  parser.add_argument("--draws", type=int, default=1)
  parser.add_argument("--steps", type=int, default=None,
                      help="T of the ULS and ELS cells (the point is then named uls_T<T>; "
                      "default: one epoch, train ctr's)")
  parser.add_argument("--root", default="/tmp/dprec_user_level_ctr")
  parser.add_argument("--jsonl", default="docs/experiments/user_level_ctr.jsonl")
  parser.add_argument("--report", action="store_true")
  parser.add_argument("--timing", action="store_true")
  parser.add_argument("--timing-steps", type=int, default=30)
  parser.add_argument("--timing-rounds", type=int, default=2)
  args = parser.parse_args(argv)
  if args.report:
    return report(args)
  if args.timing:
    return timing(args)
  return run_grid(args)


if __name__ == "__main__":
  sys.exit(main())
