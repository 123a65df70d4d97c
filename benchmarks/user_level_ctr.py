"""`dprec train ctr --privacy-unit user`: user-level sampling (ULS) against example-level sampling
with group privacy (ELS), at user-level ε, beside the row level, non-private and the base rate.

    python benchmarks/user_level_ctr.py --rows 5000000 --users 60000 --draws 3
    python benchmarks/user_level_ctr.py --rows 5000000 --users 60000 --report
    python benchmarks/user_level_ctr.py --rows 200000 --users 4000 --validation 0.1 \
        --points uls --steps 119 --jsonl docs/experiments/user_level_ctr_validation.jsonl
    python benchmarks/user_level_ctr.py --rows 500000 --users 20000 --timing

The data is `dprec synth criteo --rows R --days 3 --users U` (made once under `--root`; the last
day held out). A cell is one `train ctr` run in memory, the data loaded once for all of them:
(point, ε, algorithm, draw), a point being `uls` (--user-sampling users), `els` (--user-sampling
rows), `row` (the row level) or `non_private`; draws differ only in the run's secret key. Each
finished cell appends a line to `--jsonl` and a rerun skips the cells there, so the grid resumes.
Cells run in the order of `--points` and `--epsilons` (ULS against ELS at every ε first).

`--steps` and `--batch-size` set T and B (users for ULS, rows for ELS) of the ULS and ELS cells,
one lever at a time, for choosing defaults; `--validation SHARE` moves the end of the training
days to a validation split (`ctr_data.hold_out_validation`) and the cells' records carry its AUC
and log loss: defaults are chosen on those, never on the held-out day. A record's point names
its levers (`uls_T119_B128`).

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
FIELDS = ("auc", "eval_log_loss", "validation_auc", "validation_log_loss", "validation_rows",
          "base_rate_log_loss", "eval_base_rate", "epsilon", "delta",
          "noise_multiplier", "sampling_rate", "batch_size", "steps", "users", "bounded_rows",
          "train_rows", "steps_per_second", "max_rows_per_user")


def data_dir(root, rows, users, seed):
  """The generated days (made on first use)."""
  directory = os.path.join(root, f"criteo_{rows}_users_{users}_seed_{seed}")
  if not os.path.exists(os.path.join(directory, "day_2")):
    synthetic.generate_criteo(directory, rows=rows, days=3, seed=seed, vocab="scaled:0.05",
                              config=synthetic.CriteoSynthConfig(users=users), progress=False)
  return directory


def options_of(directory, point, epsilon, algorithm, k, steps=None, batch_size=None):
  """The `train ctr` options of a cell (the command's defaults otherwise; `steps`: T,
  `batch_size`: B)."""
  common = dict(data=directory, progress=False, steps=steps, batch_size=batch_size)
  if point == "non_private":
    return CTRTrainOptions(algorithm="non_private", **common)
  user = dict(privacy_unit="user", max_rows_per_user=k,
              user_sampling="users" if point == "uls" else "rows") if point != "row" else {}
  return CTRTrainOptions(algorithm=algorithm, epsilon=epsilon, **user, **common)


def point_name(point, args):
  """`point` with the levers set (`uls_T119_B128`)."""
  return (point + (f"_T{args.steps}" if args.steps else "")
          + (f"_B{args.batch_size}" if args.batch_size else ""))


def cells(args):
  """(point, ε, algorithm, draw) in the order they run."""
  for algorithm in args.algorithms:
    for draw in range(args.draws):
      for epsilon in args.epsilons:
        for point in ("uls", "els"):
          if point in args.points:
            yield point_name(point, args), epsilon, algorithm, draw
      if "row" in args.points:
        yield "row", 1.0, algorithm, draw
  for draw in range(args.draws):
    if "non_private" in args.points:
      yield "non_private", None, "non_private", draw


def key(record):
  return (record["point"], record["epsilon_target"], record["algorithm"], record["draw"])


def _same_data(record, args):
  return (record["rows"] == args.rows and record["users_generated"] == args.users
          and record.get("validation_share", 0.0) == args.validation)


def run_grid(args):
  directory = data_dir(args.root, args.rows, args.users, args.seed)
  done = {key(r) for r in jsonl_records.read(args.jsonl) if _same_data(r, args)}
  data = None
  for point, epsilon, algorithm, draw in cells(args):
    if (point, epsilon, algorithm, draw) in done:
      continue
    if data is None:
      data = ctr_data.load_data(directory, user_ids=True)
      if args.validation:
        data = ctr_data.hold_out_validation(
            data, round(args.validation * len(data.train["label"])))
      counts = np.unique(data.train["user_id"], return_counts=True)[1]
      print(f"{len(data.train['label']):,} training rows, {len(counts):,} users: rows per user "
            f"median {np.median(counts):g}, max {counts.max():,}; {machine.describe()}",
            flush=True)
    base = _base(point)
    levers = (dict(steps=args.steps, batch_size=args.batch_size) if base in ("uls", "els")
              else {})
    options = options_of(directory, base, epsilon, algorithm, args.max_rows_per_user, **levers)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      summary = ctr_workflow.run(options, data=data)
    record = {"rows": args.rows, "users_generated": args.users, "point": point,
              "epsilon_target": epsilon, "algorithm": algorithm, "draw": draw,
              "validation_share": args.validation, "load": os.getloadavg()[0],
              **{f: summary.get(f) for f in FIELDS}}
    with open(args.jsonl, "a", encoding="utf-8") as stream:
      stream.write(json.dumps(record) + "\n")
    validation = (f"validation AUC {record['validation_auc']:.4f}, log loss "
                  f"{record['validation_log_loss']:.4f}; " if args.validation else "")
    print(f"{point} ε={epsilon} {algorithm} draw {draw}: {validation}AUC {record['auc']:.4f}, "
          f"log loss {record['eval_log_loss']:.4f}, σ {record['noise_multiplier']}, B "
          f"{record['batch_size']}, T {record['steps']}", flush=True)


def report(args):
  records = [r for r in jsonl_records.read(args.jsonl) if _same_data(r, args)]
  auc, loss = (("validation_auc", "validation_log_loss") if args.validation
               else ("auc", "eval_log_loss"))
  groups = {}
  for record in records:
    groups.setdefault((record["point"], record["epsilon_target"], record["algorithm"]),
                      []).append(record)
  print(f"| point | ε (unit) | algorithm | draws | {'validation ' * bool(args.validation)}AUC | "
        "log loss | σ | B | T | load |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  order = {p: i for i, p in enumerate(POINTS)}
  for (point, epsilon, algorithm), group in sorted(
      groups.items(), key=lambda kv: (kv[0][2], kv[0][1] or 0, order[_base(kv[0][0])],
                                      kv[0][0])):
    unit = {"uls": "user", "els": "user", "row": "row"}.get(_base(point))
    print(f"| {point} | {'∞' if epsilon is None else f'{epsilon:g} per {unit}'} | {algorithm} | "
          f"{len(group)} | {_spread([g[auc] for g in group])} | "
          f"{_spread([g[loss] for g in group])} | "
          f"{_first(group, 'noise_multiplier')} | {group[0]['batch_size']} | "
          f"{group[0]['steps']} | {_spread([g['load'] for g in group], 2)} |")
  if records and not args.validation:
    rate, constant = records[0]["eval_base_rate"], records[0]["base_rate_log_loss"]
    print(f"| base rate ({rate:.4f}) | — | — | — | 0.5 | {constant:.4f} | — | — | — | — |")


def _base(point):
  return point if point == "non_private" else point.split("_")[0]


def _spread(values, digits=4):
  """The mean ± the sample standard deviation over draws (one draw: its value)."""
  if len(values) == 1:
    return f"{values[0]:.{digits}f}"
  return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


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
  bounded = np.minimum(counts, uls.rows_per_user)
  users_per_batch = ctr_workflow.sized_for(uls, len(counts), int(bounded.sum())).batch_size
  rows_per_batch = int(round(users_per_batch * bounded.mean()))
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
                      "default: train ctr's)")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="B of the ULS (users) and ELS (rows) cells (the point is then named "
                      "uls_B<B>; default: train ctr's)")
  parser.add_argument("--validation", type=float, default=0.0,
                      help="share of the training rows held out as validation (its AUC and log "
                      "loss recorded; records of other shares are a different grid)")
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
