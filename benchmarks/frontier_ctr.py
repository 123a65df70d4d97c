"""Ghazi et al.'s "Sparsity-Preserving Differentially Private Training of Large Embedding Models"
(arXiv:2311.08357) headline as a frontier with error bars: held-out AUC against embedding-gradient
size reduction for DP-SGD (the line), DP-FEST, DP-AdaFEST and DP-AdaFEST+ at ε = 1 (Ghazi et al.
2023: "AUC loss < 0.005 at > 5×10⁵").

Every run goes through `train ctr`'s code path (`ctr.run`) on data loaded once, with `train ctr`'s
defaults (one epoch; DP Platt scaling) except what the point names and B, which is N/500's power
of two (`FRONTIER_STEPS_PER_EPOCH`) unless the point or `--batch-size` names one. The last
`--validation-rows` training rows are held out of training (`ctr_data.hold_out_validation`):
each run reports AUC on them and on the held-out last day (test). Per point (algorithm and its
selection parameters τ, r, C1, k), lr, C2 and the dense tower (`hidden_units`) are chosen among
the evaluated variants with ≥ `--draws` draws by mean VALIDATION AUC, never test; that variant's
test AUC (mean ± SE over the draws: different secret noise keys and initialisation seeds) is the
point on the frontier.

C1 needs no axis of its own here: every example touches one row of each of the 26 tables (a
missing value is row 0), so its contribution map has norm √26 ≥ C1 and the noisy count
C1·(n/√26 + σ1·Z) ≥ τ is the event n/√26 + σ1·Z ≥ τ/C1: (τ, C1) selects exactly as (τ/C1, 1).

Resumable: each finished run is appended to `--jsonl` (one JSON object a line) and skipped when
the same data, point, variant and draw is there; `--report` only prints the tables and draws the
plot from that file. Phases run in `--phases` order (most informative first):

    dprec synth criteo --rows 6000000 --days 6 --seed 0 --out DATA
    PYTHONPATH=. .venv/bin/python benchmarks/frontier_ctr.py --data DATA --jsonl F.jsonl \\
        --phases headline small tune fest wide
    PYTHONPATH=. .venv/bin/python benchmarks/frontier_ctr.py --data DATA --jsonl F.jsonl --report \\
        --plot docs/experiments/ctr_frontier.png
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from dprec.data import ctr_data
from dprec.training import poisson
from dprec.workflows import ctr as ctr_workflow
from utility_ctr import THRESHOLDS

import jsonl_records

DEFAULTS = ctr_workflow.CTRTrainOptions(data="")
TARGET = 0.005  # Ghazi et al.'s (2023) AUC loss against DP-SGD
# A point without its own B runs at `train ctr`'s batch rule of sessions 7-10 (N/500: 8,192 at
# 5M, 16,384 at 20M), so the runs recorded since stay comparable; `train ctr` now sizes N/150.
FRONTIER_STEPS_PER_EPOCH = 500
SELECTION_KEYS = ("algorithm", "ratio", "threshold", "contribution_clip", "top_k", "epsilon",
                  "optimizer", "momentum")
VARIANT_KEYS = ("learning_rate", "l2_norm_clip", "hidden_units")
# ε at which DP-SGD's σ is DP-AdaFEST r = 2's σ2 = σ·√(1 + 1/r²) at 5M (4.75M rows, B = 8,192,
# 580 steps: σ 0.785 → 0.878): DP-SGD with the noise split's cost and no selection.
EPSILON_AT_ADAFEST_SIGMA2 = 0.576


def adafest(ratio, threshold, **variant):
  return dict(algorithm="dp_adafest", ratio=float(ratio), threshold=float(threshold),
              contribution_clip=1.0, **variant)


# Points (selection parameters, and lr / C2 when not `train ctr`'s) of each phase, in run order.
PHASES = {
    # The claim's two ends at `train ctr`'s defaults: DP-SGD and DP-AdaFEST r = 2, τ = 7, C1 = 1
    # (r = 5, τ = 15 until session 2026-11-26 (8)).
    "headline": [dict(algorithm="non_private"), dict(algorithm="dp_sgd"),
                 adafest(DEFAULTS.ratio, DEFAULTS.threshold), adafest(5, 15)],
    # More rows kept at ≥ 10²×: smaller τ, and smaller r where its σ1 keeps false positives rare.
    "small": [adafest(2, 7), adafest(5, 10), adafest(1, 5), adafest(2, 5)],
    # lr and C2 of DP-SGD and of the default DP-AdaFEST point, one lever at a time.
    "tune": [dict(point, **variant)
             for point in (dict(algorithm="dp_sgd"), adafest(DEFAULTS.ratio, DEFAULTS.threshold))
             for variant in (dict(learning_rate=1e-3), dict(learning_rate=1e-2),
                             dict(l2_norm_clip=0.5), dict(l2_norm_clip=2.0),
                             dict(l2_norm_clip=4.0))],
    "fest": [dict(algorithm="dp_fest", top_k=2600), dict(algorithm="dp_fest", top_k=26000),
             dict(adafest(2, 7), algorithm="dp_adafest_plus", top_k=26000)],
    "wide": [adafest(5, 20), adafest(3, 10), adafest(5, 12), adafest(1, 3), adafest(10, 20)],
    # What limits the gap (session 11), one lever at a time: DP-SGD at DP-AdaFEST's σ2 (the cost
    # of splitting σ, no selection); both ends at twice the batch (half the steps, a larger σ
    # where ε is less steep in σ), DP-AdaFEST's τ also doubled (the same count per row).
    "limits": [dict(algorithm="dp_sgd", epsilon=EPSILON_AT_ADAFEST_SIGMA2),
               dict(algorithm="dp_sgd", batch_size=16384), dict(adafest(2, 7), batch_size=16384),
               dict(adafest(2, 14), batch_size=16384),
               dict(algorithm="non_private", batch_size=16384)],
    # Twice the batch with the clip that won in `tune` (C2 = 2), and τ between 7 and 14 there.
    "batch": [dict(point, batch_size=16384, l2_norm_clip=2.0)
              for point in (dict(algorithm="dp_sgd"), adafest(2, 7), adafest(2, 14))]
             + [dict(adafest(2, 10), batch_size=16384)]
             # Two epochs at the default B (σ grows with the steps at a fixed ε).
             + [dict(point, steps=1160, l2_norm_clip=2.0)
                for point in (dict(algorithm="dp_sgd"), adafest(2, 7))],
    # The dense tower (noised on every weight each step): both ends at Dense 256-256 (session 9),
    # then more rows kept at the lr that won there.
    # DP-SGD with SGD or momentum on the tables (Adam 1e-2 on the dense tower), over the
    # tables' learning rate, beside the same DP-SGD with Adam everywhere at C2 = 2 (run with
    # --batch-size: 16,384 at 5M, the tuned line of session 11).
    "sgd_tables": [dict(algorithm="dp_sgd", l2_norm_clip=2.0)]
                  + [dict(algorithm="dp_sgd", optimizer="table_sgd", momentum=0.0,
                          table_learning_rate=lr, l2_norm_clip=2.0) for lr in (1, 10, 100, 1000)]
                  + [dict(algorithm="dp_sgd", optimizer="table_sgd", momentum=0.9,
                          table_learning_rate=lr, l2_norm_clip=2.0) for lr in (0.1, 1, 10, 100)],
    # The lr the 400k look chose (SGD 10; momentum 0.9 at 1, the same effective lr) and steps
    # up, at 5M (B = 16,384: less noise per step, a larger lr); lazy noise at 400k's choice.
    "sgd_tables_5m": [dict(algorithm="dp_sgd", l2_norm_clip=2.0)]
                     + [dict(algorithm="dp_sgd", optimizer="table_sgd", momentum=momentum,
                             table_learning_rate=lr, l2_norm_clip=2.0)
                        for momentum, lr in ((0.0, 10), (0.9, 1), (0.0, 30), (0.9, 3),
                                             (0.0, 100), (0.9, 10))],
    # Three draws of the 5M choice on validation (momentum 0.9 at 10), eager and lazy, beside Adam.
    "confirm_5m": [dict(algorithm=algorithm, optimizer="table_sgd", momentum=0.9,
                        table_learning_rate=10, l2_norm_clip=2.0)
                   for algorithm in ("dp_sgd", "dp_sgd_lazy")]
                  + [dict(algorithm="dp_sgd", l2_norm_clip=2.0)],
    # Plain SGD on the tables (the only lazy variant within 1.2x DP-AdaFEST's step at 10M), lazy,
    # above the eager grid's top (lr 100): 300, then 1,000 if 300 wins on validation.
    "sgd_lazy_5m": [dict(algorithm="dp_sgd_lazy", optimizer="table_sgd", momentum=0.0,
                         table_learning_rate=lr, l2_norm_clip=2.0) for lr in (300, 1000)],
    # Three draws of plain SGD's choice on validation (lr 100: eager 0.7930, lazy 300 0.7838).
    "sgd_lazy_confirm_5m": [dict(algorithm="dp_sgd_lazy", optimizer="table_sgd", momentum=0.0,
                                 table_learning_rate=100, l2_norm_clip=2.0)],
    # What `train ctr` would run by default with lazy noise: the rule's lr (B/160) at its C2 = 1,
    # then twice it (the same step per clipped example: lr·C2/B = 1/80).
    "sgd_lazy_default_5m": [dict(algorithm="dp_sgd_lazy", optimizer="table_sgd", momentum=0.0,
                                 table_learning_rate=lr) for lr in (16384 / 160, 16384 / 80)],
    # A table lr for any data: the two sizes' best plain SGD lr (400k, B = 2,048: 10; 5M,
    # B = 16,384: 100) grow about as B; at 400k the rule lr = B/160 against lr 10 (--draws 3).
    "sgd_lazy_rule": [dict(algorithm="dp_sgd_lazy", optimizer="table_sgd", momentum=0.0,
                           table_learning_rate=lr, l2_norm_clip=2.0) for lr in (10, 2048 / 160)],
    "lazy": [dict(algorithm="dp_sgd_lazy", optimizer="table_sgd", momentum=momentum,
                  table_learning_rate=lr, l2_norm_clip=2.0)
             for momentum, lr in ((0.0, 10), (0.9, 1))],
    "tower": [dict(point, hidden_units=(256, 256), learning_rate=lr)
              for point in (dict(algorithm="dp_sgd"), adafest(2, 7), dict(algorithm="non_private"))
              for lr in (3e-3, 1e-2, 3e-2)]
             + [dict(adafest(r, tau), hidden_units=(256, 256), learning_rate=1e-2)
                for r, tau in ((1, 5), (1, 3))]
             # App. D.1.1's tower at the lr it won at (the line until session 10).
             + [dict(point, hidden_units=(598,) * 4, learning_rate=3e-3)
                for point in (dict(algorithm="dp_sgd"), adafest(2, 7))],
}


def full(point):
  """`point` with every selection and variant key filled in (`train ctr`'s defaults)."""
  filled = {key: getattr(DEFAULTS, key) for key in VARIANT_KEYS}
  filled.update(point)
  if filled["learning_rate"] is None:
    filled["learning_rate"] = ctr_workflow.learning_rate(
        dataclasses.replace(DEFAULTS, algorithm=filled["algorithm"]))
  if filled["algorithm"] == "non_private":
    filled.pop("l2_norm_clip")
  return filled


def family(point):
  """The frontier point a run belongs to: its algorithm and selection parameters."""
  return tuple((key, point[key]) for key in SELECTION_KEYS if key in point)


def label(point):
  names = {"ratio": "r", "threshold": "tau", "contribution_clip": "C1", "top_k": "k",
           "epsilon": "eps", "learning_rate": "lr", "l2_norm_clip": "C2", "hidden_units": "h",
           "batch_size": "B", "steps": "T", "optimizer": "opt", "momentum": "mom",
           "table_learning_rate": "tlr"}  # B, T, opt, tlr: in a point only when not the default
  def text(value):
    if isinstance(value, str):
      return value
    return "x".join(map(str, value)) if isinstance(value, (list, tuple)) else f"{value:g}"
  return " ".join([point["algorithm"]] + [f"{names[k]}={text(point[k])}" for k in names
                                          if k in point])


def data_tag(data_dir, validation_rows):
  return f"{os.path.basename(os.path.normpath(data_dir))} val={validation_rows}"


def read_runs(path, tag=None):
  return [r for r in jsonl_records.read(path) if tag is None or r["data"] == tag]


def pending(phases, draws, runs, only=None):
  """[(phase, point, draw)] of `phases` not among `runs`, in run order: within a phase every DP
  point's draw 0, then draw 1, ...; the non-private reference (one draw) last. A point in two
  phases runs once, in the first; `only`: these labels alone."""
  done = {(r["label"], r["draw"]) for r in runs}
  unique = {}
  for phase in phases:
    for private in (True, False):
      for draw in range(draws if private else 1):
        for point in map(full, PHASES[phase]):
          key = (label(point), draw)
          if ((point["algorithm"] != "non_private") == private and key not in done
              and (not only or key[0] in only)):
            unique.setdefault(key, (phase, point, draw))
  return list(unique.values())


def train(args, runs):
  """Runs every (point, draw) of `args.phases` not yet in `args.jsonl`, appending each."""
  tag = data_tag(args.data, args.validation_rows)
  todo = pending(args.phases, args.draws, runs, args.only)
  print(f"# {tag}: {len(todo)} runs to do", file=sys.stderr, flush=True)
  if not todo:
    return
  start = time.time()
  data = ctr_data.hold_out_validation(ctr_workflow.load_data(args.data), args.validation_rows)
  print(f"# loaded in {time.time() - start:.0f} s: {len(data.train['label']):,} training rows, "
        f"{args.validation_rows:,} validation, {len(data.eval['label']):,} test, "
        f"{sum(data.vocab_sizes):,} embedding rows", file=sys.stderr, flush=True)
  batch_size = args.batch_size or poisson.data_sized_batch_size(
      len(data.train["label"]), FRONTIER_STEPS_PER_EPOCH)
  for phase, point, draw in todo:
    run_options = dict(data=args.data, epsilon=None if point["algorithm"] == "non_private" else
                       args.epsilon, batch_size=batch_size, steps=args.steps, seed=draw,
                       progress=False, top_k_epsilon=args.top_k_epsilon)
    run_options.update(point)  # a point's own ε, B or T (phases "limits", "batch") wins
    if "batch_size" in point and "steps" not in point:
      run_options["steps"] = None  # one epoch at the point's B
    options = dataclasses.replace(DEFAULTS, **run_options)
    start = time.time()
    summary = ctr_workflow.run(options, data)
    record = dict(data=tag, phase=phase, label=label(point), point=point, draw=draw,
                  wall_seconds=time.time() - start, **summary)
    with open(args.jsonl, "a", encoding="utf-8") as out:
      out.write(json.dumps(record) + "\n")
    print(f"{record['label']} draw {draw}: test AUC {summary['auc']:.4f}, validation "
          f"{summary['validation_auc']:.4f}, {summary['gradient_size_reduction']:.1f}×, "
          f"{record['wall_seconds']:.0f} s", file=sys.stderr, flush=True)


def _mean_se(values):
  values = np.asarray(values, dtype=float)
  se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
  return float(values.mean()), float(se)


def frontier(runs, draws):
  """{family: the chosen variant's statistics}, and every variant's statistics (a list)."""
  groups = {}
  for r in runs:
    groups.setdefault((family(r["point"]), label(r["point"])), []).append(r)
  variants = []
  for (fam, name), members in groups.items():
    stats = dict(family=fam, label=name, point=members[0]["point"], n=len(members),
                 algorithm=members[0]["algorithm"])
    for key in ("auc", "validation_auc", "eval_log_loss", "gradient_size_reduction",
                "wall_seconds", "base_rate_log_loss"):
      stats[key], stats[key + "_se"] = _mean_se([m[key] for m in members])
    variants.append(stats)
  chosen = {}
  for stats in variants:
    enough = stats["n"] >= draws or stats["algorithm"] == "non_private"
    best = chosen.get(stats["family"])
    if enough and (best is None or stats["validation_auc"] > best["validation_auc"]):
      chosen[stats["family"]] = stats
  return chosen, sorted(variants, key=lambda s: (s["algorithm"], -s["gradient_size_reduction"]))


def _difference(stats, line):
  diff = stats["auc"] - line["auc"]
  return diff, math.hypot(stats["auc_se"], line["auc_se"])


def at_frontier_batch(runs):
  """A run at the frontier's B and T (none named by its point), for the report's header."""
  return next((r for r in runs if not {"batch_size", "steps"} & set(r["point"])), runs[0])


def the_line(chosen):
  """DP-SGD's chosen variant at the run's ε with Adam (not a diagnostic at another ε, nor SGD on
  the tables), or None."""
  return next((s for s in chosen.values() if s["algorithm"] == "dp_sgd"
               and not {"epsilon", "optimizer"} & set(s["point"])), None)


def print_report(runs, draws):
  chosen, variants = frontier(runs, draws)
  line = the_line(chosen)
  print("| run | draws | validation AUC | test AUC (mean ± SE) | Δ vs DP-SGD (± SE) | "
        "log loss (mean ± SE) | reduction | wall s/run | chosen |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
  for s in variants:
    diff = "—"
    if line is not None and s["family"] != line["family"] and s["algorithm"] != "non_private":
      d, se = _difference(s, line)
      diff = f"{d:+.4f} ± {se:.4f}"
    picked = "✓" if chosen.get(s["family"]) is s else ""
    print(f"| {s['label']} | {s['n']} | {s['validation_auc']:.4f} | {s['auc']:.4f} ± "
          f"{s['auc_se']:.4f} | {diff} | {s['eval_log_loss']:.4f} ± {s['eval_log_loss_se']:.4f} "
          f"| {s['gradient_size_reduction']:.1f}× | {s['wall_seconds']:.0f} | {picked} |")
  if line is None:
    return
  base = variants[0]["base_rate_log_loss"]
  print(f"\nDP-SGD (the line, lr and C2 chosen on validation: {line['label']}): test AUC "
        f"{line['auc']:.4f} ± {line['auc_se']:.4f} over {line['n']} draws; base rate: AUC 0.5, "
        f"log loss {base:.4f}")
  print("\nLargest reduction at AUC loss ≤ t vs DP-SGD (points chosen on validation, ≥ "
        f"{draws} draws; Δ ± SE of the difference of means; 'sure' if Δ + t > 1.645·SE):\n")
  print("| algorithm | " + " | ".join(f"≤ {t}" for t in THRESHOLDS) + " |")
  print("|---|" + "---:|" * len(THRESHOLDS))
  for algorithm in ("dp_fest", "dp_adafest", "dp_adafest_plus"):
    cells = []
    for t in THRESHOLDS:
      within = [s for s in chosen.values() if s["algorithm"] == algorithm
                and _difference(s, line)[0] >= -t]
      if not within:
        cells.append("—")
        continue
      best = max(within, key=lambda s: s["gradient_size_reduction"])
      d, se = _difference(best, line)
      sure = ", sure" if d + t > 1.645 * se else ""
      cells.append(f"{best['gradient_size_reduction']:.0f}× ({best['label']}; "
                   f"Δ {d:+.4f} ± {se:.4f}{sure})")
    print(f"| {algorithm} | " + " | ".join(cells) + " |")


def plot(runs, draws, path, title):
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot
  chosen, _ = frontier(runs, draws)
  line = the_line(chosen)
  if line is None:
    print(f"\nNo plot: DP-SGD has no variant with {draws} draws yet", file=sys.stderr)
    return
  figure, (ax_auc, ax_loss) = pyplot.subplots(1, 2, figsize=(12, 4.8))
  default = full(adafest(DEFAULTS.ratio, DEFAULTS.threshold))
  for ax, key in ((ax_auc, "auc"), (ax_loss, "eval_log_loss")):
    ax.axhspan(line[key] - line[key + "_se"], line[key] + line[key + "_se"], color="grey",
               alpha=0.3, label=f"DP-SGD mean ± SE ({line['n']} draws)")
    ax.axhline(line[key], color="grey", lw=1)
    for s in chosen.values():
      if s["algorithm"] == "non_private":
        ax.axhline(s[key], color="green", ls="--", label="non-private")
    markers = {"dp_sgd": "s", "dp_fest": "^", "dp_adafest": "o", "dp_adafest_plus": "D"}
    for algorithm, marker in markers.items():
      points = [s for s in chosen.values()
                if s["algorithm"] == algorithm and "epsilon" not in s["point"]]
      if points:
        ax.errorbar([math.log10(s["gradient_size_reduction"]) for s in points],
                    [s[key] for s in points], yerr=[s[key + "_se"] for s in points],
                    fmt=marker, capsize=3, label=algorithm)
    for s in chosen.values():
      if s["point"].get("algorithm") == "dp_adafest" and family(s["point"]) == family(default):
        ax.annotate("train ctr's r = 2, τ = 7", (math.log10(s["gradient_size_reduction"]), s[key]),
                    textcoords="offset points", xytext=(-90, 25), fontsize=8,
                    arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.set_xlabel("log10 embedding-gradient size reduction vs DP-SGD")
  ax_auc.axhline(line["auc"] - TARGET, color="red", ls=":", label=f"DP-SGD − {TARGET}")
  ax_auc.set_ylabel("test AUC (base rate: 0.5, off scale)")
  ax_loss.axhline(runs[0]["base_rate_log_loss"], color="black", ls="-.", label="base rate")
  ax_loss.set_ylabel("test log loss")
  ax_auc.legend(fontsize=7, loc="lower left")
  ax_loss.legend(fontsize=7)
  figure.suptitle(title, fontsize=10)
  figure.tight_layout()
  figure.savefig(path, dpi=110)


def estimate(runs, args):
  """Measured wall time per run and what the remaining phases would take."""
  walls = [r["wall_seconds"] for r in runs if r["algorithm"] != "non_private"]
  if not walls:
    return
  per_run = float(np.median(walls))
  left = {phase: len(pending([phase], args.draws, runs)) for phase in PHASES}
  print(f"\nMedian wall time per DP run: {per_run:.0f} s (loaded shared machine); runs left per "
        "phase (hours at that rate): " + ", ".join(
            f"{phase} {n} ({n * per_run / 3600:.1f} h)" for phase, n in left.items()))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", required=True, help="Criteo TSV day_N directory (last day: test)")
  parser.add_argument("--jsonl", required=True, help="finished runs, appended one a line")
  parser.add_argument("--phases", nargs="+", choices=list(PHASES), default=["headline"])
  parser.add_argument("--draws", type=int, default=3, help="noise draws (secret keys) per point")
  parser.add_argument("--validation-rows", type=int, default=250_000,
                      help="last training rows held out for choosing lr and C2")
  parser.add_argument("--epsilon", type=float, default=1.0)
  parser.add_argument("--batch-size", type=int,
                      help=f"default: the power of two nearest N/{FRONTIER_STEPS_PER_EPOCH}")
  parser.add_argument("--steps", type=int, help="default: train ctr's, one epoch")
  parser.add_argument("--top-k-epsilon", type=float, default=DEFAULTS.top_k_epsilon)
  parser.add_argument("--report", action="store_true", help="no training: tables (and plot)")
  parser.add_argument("--plot", help="save the frontier plot (PNG) here")
  parser.add_argument("--only", nargs="+", metavar="LABEL",
                      help="of the phases' points, run only these (labels as the report "
                           "prints them)")
  args = parser.parse_args(argv)
  if args.only:
    known = {label(full(p)) for phase in args.phases for p in PHASES[phase]}
    unknown = sorted(set(args.only) - known)
    if unknown:
      parser.error(f"--only: {unknown} not among the phases' points: {sorted(known)}")
  tag = data_tag(args.data, args.validation_rows)
  if not args.report:
    train(args, read_runs(args.jsonl, tag))
  runs = read_runs(args.jsonl, tag)
  if not runs:
    return
  first = at_frontier_batch(runs)
  print(f"## {tag}: {first['train_rows']:,} training rows, B = {first['batch_size']}, "
        f"{first['steps']} steps, ε = {args.epsilon}\n")
  print_report(runs, args.draws)
  estimate(runs, args)
  if args.plot:
    plot(runs, args.draws, args.plot, f"{tag}: {first['train_rows']:,} training rows, "
         f"B = {first['batch_size']}, {first['steps']} steps unless a point names its own "
         f"B or T; each point at its variant chosen on validation, ε = {args.epsilon}")


if __name__ == "__main__":
  main()
