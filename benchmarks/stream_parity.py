"""`dprec stream` against `dprec train ctr` on the same rows, one lever at a time.

    nice -n 10 python benchmarks/stream_parity.py --setting 8x25k --points issue,ctr --draws 3
    python benchmarks/stream_parity.py --report [--plot docs/experiments/stream_parity.png]

A setting is a synthetic Criteo series (`dprec synth criteo`) through the streaming Beam job
(`dprec preprocess criteo --streaming`), made once under `--root`. A point is the options of one
command on it: `dprec stream` (every day but the last trained as a one-day period, the last day
the hold-out) or `dprec train ctr` on the same day files (the last day held out), at ε = 1. Each
(setting, point, draw) runs the command line a user would, once, and appends its summary to
`--jsonl`; a rerun skips what is there. Draws differ only in the run's secret key.

The stream's points name every hyper-parameter they set, so they keep their meaning when the
defaults move: `issue` is the stream as the issue measured it (App. D.1.1's 598 × 4 at Adam 3e-3,
C2 = 10, r = 5, τ = 1, B = 1024), each `issue+X` moves one lever X to `train ctr`'s value, and
`ctr_step` is the stream with all of `train ctr`'s step hyper-parameters; `defaults` is the
stream with no options (whatever the checkout's defaults are: its record says which).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import jsonl_records

EPSILON = "1"
# name: (synth options, days, rows a day, preprocess options)
SETTINGS = {
    "8x25k": (["--rows", "200000", "--days", "8", "--vocab", "scaled:0.05", "--seed", "4"], 8,
              25_000, []),
    "6x50k": (["--rows", "300000", "--days", "6", "--seed", "0"], 6, 50_000, []),
    # The 8 × 25k rows with a user id (Zipf activity over 200,000 users): same rows, 41st column.
    "8x25k_users": (["--rows", "200000", "--days", "8", "--vocab", "scaled:0.05", "--seed", "4",
                     "--users", "200000"], 8, 25_000, ["--user-column"]),
}
ISSUE = ["--hidden-units", "598,598,598,598", "--learning-rate", "3e-3", "--l2-norm-clip", "10",
         "--ratio", "5", "--threshold", "1", "--batch-size", "1024",
         "--calibration-logit-bound", "1", "--calibration-level-prior-examples", "100000"]
# `train ctr`'s value of each lever (the stream's name for it: its options).
LEVERS = {
    "tower": ["--hidden-units", "256,256", "--learning-rate", "1e-2"],
    "batch": ["--batch-size", "DATA_SIZED"],  # N_period / 150 as a power of two
    "r": ["--ratio", "2"],
    "tau": ["--threshold", "7"],
    "c2": ["--l2-norm-clip", "1"],
    "epochs2": ["--epochs-per-period", "2"],
    "calibration": ["--calibration-logit-bound", "10", "--calibration-level-prior-examples", "0"],
}
CTR_STEP = [arg for lever in ("tower", "batch", "r", "tau", "c2") for arg in LEVERS[lever]]


def _replace(args, extra):
  """`args` with each option of `extra` (option, value pairs) set to its value."""
  args = list(args)
  for option, value in zip(extra[::2], extra[1::2]):
    if option in args:
      args[args.index(option) + 1] = value
    else:
      args += [option, value]
  return args


def points(name):
  """("stream" | "ctr", options) of a point: `issue`, `ctr_step`, `defaults` or `ctr`, then
  `+LEVER` for each lever moved to `train ctr`'s value (`issue+tower+c2`), then
  `@OPTION=VALUE` for each more option (`defaults@privacy-unit=user@max-rows-per-user=2`)."""
  name, *more = name.split("@")
  base, *levers = name.split("+")
  kind, options = {"issue": ("stream", ISSUE), "defaults": ("stream", []), "ctr": ("ctr", []),
                   "ctr_step": ("stream", _replace(ISSUE, CTR_STEP))}[base]
  for lever in levers:
    options = _replace(options, LEVERS[lever])
  for pair in more:
    option, value = pair.split("=")
    options = _replace(options, [f"--{option}", value])
  return kind, options


def data_sized(rows):
  """`train ctr`'s B for N rows (`dprec.training.poisson.data_sized_batch_size`)."""
  from dprec.training import poisson
  return poisson.data_sized_batch_size(rows)


def prepare(root, setting, dprec):
  """The day files and the streaming job's output of `setting` under `root` (made once)."""
  synth, _, _, preprocess = SETTINGS[setting]
  days, output = os.path.join(root, setting, "days"), os.path.join(root, setting, "stream")
  if not os.path.exists(os.path.join(output, "manifest.json")):
    subprocess.run([dprec, "synth", "criteo", *synth, "--out", days, "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([dprec, "preprocess", "criteo", "--streaming", "--input", days, "--output",
                    output, "--idle-timeout", "5", *preprocess], check=True,
                   stdout=subprocess.DEVNULL)
  return days, output


def command(setting, point, days, output, run_dir, summary):
  """The argv of `point` on `setting` (without the program)."""
  kind, options = points(point)
  _, num_days, rows, _ = SETTINGS[setting]
  options = [str(data_sized(rows)) if value == "DATA_SIZED" else value for value in options]
  common = ["--summary-json", summary, "--run-dir", run_dir, "--no-progress"]
  if kind == "ctr":
    return ["train", "ctr", "--data", days, "--algorithm", "dp_adafest",
            "--epsilon", EPSILON, *common, *options]
  # A user-level q counts the first period's users (`stream.users_per_period`), not N.
  size = [] if "user" in options else ["--examples-per-period", str(rows)]
  return ["stream", "--data", output, "--algorithm", "dp_adafest", "--epsilon", EPSILON,
          "--period-days", "1", "--train-days", str(num_days - 1), *size, *common, *options]


def record(setting, point, draw, argv, summary, commit):
  """The JSONL row of one run."""
  row = {"setting": setting, "point": point, "draw": draw, "argv": argv, "commit": commit}
  if "periods" not in summary:  # train ctr
    return dict(row, holdout_auc=summary["auc"], holdout_log_loss=summary["eval_log_loss"],
                base_rate_log_loss=summary["base_rate_log_loss"], epsilon=summary["epsilon"],
                sigma=summary["noise_multiplier"], batch_size=summary["batch_size"],
                steps=summary["steps"])
  keep = ("auc", "log_loss", "base_rate_log_loss", "steps", "gradient_size_reduction")
  plan = summary["plan"]
  return dict(row, holdout_auc=summary["holdout"]["auc"],
              holdout_log_loss=summary["holdout"]["log_loss"],
              base_rate_log_loss=summary["holdout"]["base_rate_log_loss"],
              epsilon=summary["epsilon"], sigma=plan["noise_multiplier"],
              batch_size=plan["batch_size"], steps=plan["steps_per_period"],
              privacy_unit=summary["privacy_unit"],
              periods=[{k: p.get(k) for k in keep} for p in summary["periods"]])


def run(options):
  done = {(r["setting"], r["point"], r["draw"]) for r in jsonl_records.read(options.jsonl)}
  dprec = os.path.join(os.path.dirname(sys.executable), "dprec")
  commit = options.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           check=False).stdout.strip()
  days, output = prepare(options.root, options.setting, dprec)
  for point in options.points.split(","):
    for draw in range(options.draws):
      if (options.setting, point, draw) in done:
        continue
      with tempfile.TemporaryDirectory(dir=options.root) as scratch:
        summary_path = os.path.join(scratch, "summary.json")
        argv = command(options.setting, point, days, output, os.path.join(scratch, "run"),
                       summary_path)
        subprocess.run([dprec, *argv], check=True, stdout=subprocess.DEVNULL)
        with open(summary_path, encoding="utf-8") as f:
          row = record(options.setting, point, draw, argv, json.load(f), commit)
      with open(options.jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
      print(point, draw, f"{row['holdout_auc']:.4f}", flush=True)


def _mean_sd(values):
  return (f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1
          else f"{values[0]:.3f}")


def report(rows):
  """A markdown table per setting: hold-out AUC and log loss (mean ± sd over draws), AUC after
  each period (mean), the lowest AUC after any period and the periods whose log loss was not
  below the base rate's in any draw."""
  lines = []
  for setting in dict.fromkeys(r["setting"] for r in rows):
    lines += [f"\n{setting}\n", "| point | draws | B | T | σ | ε | hold-out AUC | hold-out "
              "log loss (base rate's) | AUC after each period (mean) | lowest AUC | periods "
              "with log loss ≥ base rate's |", "|---" * 11 + "|"]
    for point in dict.fromkeys(r["point"] for r in rows if r["setting"] == setting):
      runs = [r for r in rows if (r["setting"], r["point"]) == (setting, point)]
      periods = [r["periods"] for r in runs if r.get("periods")]
      curve = lowest = misses = "–"
      if periods:
        curve = " ".join(f"{statistics.mean(p[i]['auc'] for p in periods):.3f}"
                         for i in range(min(map(len, periods))))
        lowest = f"{min(x['auc'] for p in periods for x in p):.3f}"
        misses = str(sum(x["log_loss"] >= x["base_rate_log_loss"] for p in periods for x in p))
      lines.append(
          f"| {point} | {len(runs)} | {runs[0]['batch_size']} | {runs[0]['steps']} | "
          f"{runs[0]['sigma']:.3f} | {max(r['epsilon'] for r in runs):.4f} | "
          f"{_mean_sd([r['holdout_auc'] for r in runs])} | "
          f"{_mean_sd([r['holdout_log_loss'] for r in runs])} "
          f"({statistics.mean(r['base_rate_log_loss'] for r in runs):.3f}) | {curve} | "
          f"{lowest} | {misses} |")
  return "\n".join(lines)


def plot(rows, path, selected):
  """AUC and log loss − base rate's after each period, one line per (setting, point) of
  `selected` (mean over draws, the draws' range shaded), `train ctr`'s hold-out AUC dashed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  settings = list(dict.fromkeys(r["setting"] for r in rows))
  figure, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 7), squeeze=False)
  for column, setting in enumerate(settings):
    auc, loss = axes[0][column], axes[1][column]
    for point in selected:
      runs = [r for r in rows if (r["setting"], r["point"]) == (setting, point)]
      if not runs:
        continue
      if not runs[0].get("periods"):  # train ctr: one model, evaluated on the hold-out day
        auc.axhline(statistics.mean(r["holdout_auc"] for r in runs), ls="--", color="k",
                    label=f"train {point}, hold-out ({len(runs)} draws)")
        continue
      size = min(len(r["periods"]) for r in runs)
      x = list(range(1, size + 1))
      for axis, value in ((auc, lambda p: p["auc"]),
                          (loss, lambda p: p["log_loss"] - p["base_rate_log_loss"])):
        series = [[value(r["periods"][i]) for r in runs] for i in range(size)]
        line, = axis.plot(x, [statistics.mean(s) for s in series], marker="o",
                          label=f"{point} ({len(runs)} draws)")
        axis.fill_between(x, [min(s) for s in series], [max(s) for s in series], alpha=0.2,
                          color=line.get_color())
        axis.set_xticks(x)
    auc.axhline(0.5, color="grey", lw=0.8)
    loss.axhline(0.0, color="grey", lw=0.8)
    auc.set_title(f"{setting}, ε = {EPSILON}: AUC on the next day")
    loss.set_title("log loss − the base rate's, on the next day")
    loss.set_xlabel("periods trained")
    auc.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=110)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--setting", choices=sorted(SETTINGS), default="8x25k")
  parser.add_argument("--points", default="issue,ctr",
                      help="comma-separated (`points`): issue, ctr_step, defaults or ctr, "
                      f"+LEVER ({', '.join(LEVERS)}) each, @OPTION=VALUE each (more options)")
  parser.add_argument("--draws", type=int, default=3)
  parser.add_argument("--root", default="/tmp/stream_parity", help="data and scratch runs")
  parser.add_argument("--jsonl", default="docs/experiments/stream_parity.jsonl")
  parser.add_argument("--commit", default=None,
                      help="the commit the runs' code is from (default: this checkout's HEAD; "
                      "give it when PYTHONPATH points at an exported snapshot)")
  parser.add_argument("--report", action="store_true", help="print the tables and stop")
  parser.add_argument("--plot", default=None, help="with --report: write the per-period plot")
  parser.add_argument("--plot-points", default="issue,defaults,ctr")
  options = parser.parse_args(argv)
  if options.report:
    rows = jsonl_records.read(options.jsonl)
    print(report(rows))
    if options.plot:
      plot(rows, options.plot, options.plot_points.split(","))
    return
  os.makedirs(options.root, exist_ok=True)
  run(options)


if __name__ == "__main__":
  main()
