"""Utility vs gradient size of DP-SGD, DP-FEST, DP-AdaFEST, DP-AdaFEST+ on synthetic Criteo
(the shape of Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding
Models", arXiv:2311.08357, Fig. 3): AUC on the held-out day at ε = 1, δ = 1/N, batch 2048.

Every run goes through `dprec train ctr`'s code path (`train_ctr`) on data loaded once. The grid
follows Ghazi et al. 2023, App. D.1: r = σ1/σ2 ∈ {1, 5, 10}, τ ∈ {0.5 … 100}, C1 ∈ {1, 5, 10}, FEST
k from 100 up; `--grid reduced` (default) and `--grid small` are subsets that fit a shared 2-core
machine; `--grid frontier` probes the ≥ 10³× end of the frontier (r = 2, 3 at τ with few false
positives; r = 5 τ = 10 at a larger learning rate and at a smaller C2); `--repeat-best N` reruns
the best DP-AdaFEST with N more seeds to show run-to-run noise.
The second table is the best gradient-size reduction (vs DP-SGD's dense V·d) of each algorithm
among its runs whose AUC is within 0.001 / 0.005 / 0.01 of DP-SGD's. `--signal ALPHA …` instead
prints, for generators with those `--tail-decay` values, how much of the true click logit's AUC
sits in buckets frequent enough to pass a per-batch selection (no training).

    .venv/bin/python benchmarks/utility_ctr.py --rows 6000000 --days 6 --steps 1000 --repeat-best 1
    .venv/bin/python benchmarks/utility_ctr.py --signal 0 0.25 0.5
"""
import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

from dprec.data import synthetic
from dprec.workflows import ctr as ctr_workflow
from synthetic_auc import auc

THRESHOLDS = (0.001, 0.005, 0.01)
SIGNAL_TAUS = (2.0, 5.0, 10.0, 20.0)  # DP-AdaFEST thresholds at C1 = 1 for `--signal`


def grid(kind):
  """(label, option overrides) of every run."""
  if kind == "reduced":
    return _reduced_grid()
  if kind == "frontier":
    return _frontier_grid()
  if kind == "full":
    ratios, taus, clips = (1.0, 5.0, 10.0), (0.5, 1.0, 5.0, 10.0, 20.0, 50.0, 100.0), (1, 5, 10)
    top_ks = (2600, 26000, 100000, 300000)
  else:
    ratios, taus, clips, top_ks = (1.0, 5.0, 10.0), (5.0, 20.0, 50.0), (1.0,), (2600, 26000)
  runs = [("non_private", {"algorithm": "non_private"}), ("dp_sgd", {"algorithm": "dp_sgd"})]
  runs += [(f"dp_fest k={k}", {"algorithm": "dp_fest", "top_k": k}) for k in top_ks]
  runs += [(f"dp_adafest r={r:g} tau={t:g} C1={c:g}",
            {"algorithm": "dp_adafest", "ratio": r, "threshold": t, "contribution_clip": float(c)})
           for r in ratios for t in taus for c in clips]
  plus_ks = top_ks if kind == "full" else top_ks[-1:]
  runs += [(f"dp_adafest_plus k={k} r=5 tau={t:g}",
            {"algorithm": "dp_adafest_plus", "top_k": k, "ratio": 5.0, "threshold": t})
           for k in plus_ks for t in taus[:2]]
  return runs


def _reduced_grid():
  """The grid that fits ~1 hour of a shared 2-core machine at ≥ 5M rows: DP-FEST at two k,
  DP-AdaFEST at r = 5 with three τ and at r = 1 with one, one DP-AdaFEST+."""
  adafest = [(5.0, 5.0), (5.0, 10.0), (5.0, 20.0), (1.0, 5.0)]
  return ([("non_private", {"algorithm": "non_private"}), ("dp_sgd", {"algorithm": "dp_sgd"})]
          + [(f"dp_fest k={k}", {"algorithm": "dp_fest", "top_k": k}) for k in (2600, 26000)]
          + [(f"dp_adafest r={r:g} tau={t:g} C1=1",
              {"algorithm": "dp_adafest", "ratio": r, "threshold": t, "contribution_clip": 1.0})
             for r, t in adafest]
          + [("dp_adafest_plus k=26000 r=5 tau=10",
              {"algorithm": "dp_adafest_plus", "top_k": 26000, "ratio": 5.0, "threshold": 10.0})])


def _frontier_grid():
  """Runs meant to move the frontier at ≥ 10³×. A smaller r lowers σ1 = σ·√(1 + r²), so a lower
  τ keeps the false positives Ψ(τ/(σ1·C1)) rare while rows with fewer occurrences in the batch
  pass; σ2 grows by √(1 + 1/r²). Kept rows get few updates, hence the larger learning rate; a
  smaller C2 trades clipping bias for less noise."""
  adafest = {"algorithm": "dp_adafest", "contribution_clip": 1.0}
  return [("dp_adafest r=2 tau=5 C1=1", dict(adafest, ratio=2.0, threshold=5.0)),
          ("dp_adafest r=3 tau=7 C1=1", dict(adafest, ratio=3.0, threshold=7.0)),
          ("dp_adafest r=5 tau=10 C1=1 lr=0.01",
           dict(adafest, ratio=5.0, threshold=10.0, learning_rate=0.01)),
          ("dp_adafest r=5 tau=10 C1=1 C2=0.5",
           dict(adafest, ratio=5.0, threshold=10.0, l2_norm_clip=0.5))]


def best_reductions(results):
  """{algorithm: {threshold: best reduction among runs within threshold of DP-SGD's AUC}}."""
  baseline = next(r["auc"] for r in results if r["algorithm"] == "dp_sgd")
  table = {}
  for algorithm in ("dp_fest", "dp_adafest", "dp_adafest_plus"):
    runs = [r for r in results if r["algorithm"] == algorithm]
    table[algorithm] = {
        t: max([r["gradient_size_reduction"] for r in runs if baseline - r["auc"] <= t],
               default=None) for t in THRESHOLDS}
  return baseline, table


def signal_by_frequency(tail_decay, rows, batch_size, taus=SIGNAL_TAUS, seed=0):
  """AUC of the generator's true click logit on `rows` day-0 rows: in full, and with the click
  weights of buckets expected fewer than τ·√26 times per batch zeroed, for τ in `taus`.
  τ·√26 is about what a bucket needs to pass DP-AdaFEST's selection at C1 = 1 (26 features, so
  each example adds 1/√26 to each of its buckets). The gap is the AUC only rarer rows carry."""
  config = synthetic.CriteoSynthConfig(tail_decay=tail_decay)
  blocks = [block for _, block in synthetic.criteo_blocks(rows, 1, seed, config)]
  ids, weights, logit, label = (np.concatenate([b[key] for b in blocks])
                                for key in ("ids", "weights", "logit", "label"))
  per_batch = np.zeros(ids.shape)
  for j, column in enumerate(ids.T):
    present = column >= 0
    counts = np.bincount(column[present])
    per_batch[present, j] = counts[column[present]] * batch_size / rows
  rest = logit - weights.sum(axis=1)
  return [auc(label, logit)] + [auc(label, rest + np.where(per_batch >= tau * math.sqrt(26),
                                                              weights, 0.0).sum(axis=1))
                                for tau in taus]


def _print_signal(tail_decays, rows, batch_size, taus):
  print(f"AUC of the true click logit, {rows:,} day-0 rows; 'n ≥ k': only buckets expected ≥ k "
        f"times per batch of {batch_size} keep their click weight\n")
  print("| --tail-decay | all buckets | " + " | ".join(
      f"n ≥ {tau * math.sqrt(26):.0f} (τ = {tau:g})" for tau in taus) + " |")
  print("|---:|---:|" + "---:|" * len(taus))
  for tail_decay in tail_decays:
    aucs = signal_by_frequency(tail_decay, rows, batch_size, taus)
    print(f"| {tail_decay:g} | " + " | ".join(f"{a:.4f}" for a in aucs) + " |", flush=True)


def _row(summary):
  epsilon = "∞" if summary["epsilon"] is None else f"{summary['epsilon']:.3f}"
  return (f"| {summary['label']} | {summary['auc']:.4f} | {epsilon} | "
          f"{summary['gradient_size_reduction']:.1f} | {summary['steps_per_second']:.2f} |")


def main(argv=None):
  defaults = ctr_workflow.CTRTrainOptions(data="")
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", help="existing Criteo TSV day_N directory (else generated)")
  parser.add_argument("--out", default="utility_ctr_data", help="where generated data goes")
  parser.add_argument("--rows", type=int, default=6_000_000, help="rows to generate, all days")
  parser.add_argument("--days", type=int, default=6, help="days to generate (last held out)")
  parser.add_argument("--steps", type=int, default=2441, help="training steps per run")
  parser.add_argument("--batch-size", type=int, default=2048)
  parser.add_argument("--epsilon", type=float, default=1.0)
  parser.add_argument("--optimizer", choices=sorted(ctr_workflow.OPTIMIZERS),
                      default=defaults.optimizer, help="every run")
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                      help="every run (default: train ctr's, private or not)")
  parser.add_argument("--l2-norm-clip", type=float, default=defaults.l2_norm_clip,
                      help="C2, every DP run")
  parser.add_argument("--top-k-epsilon", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=defaults.seed,
                      help="every run's seed (initialisation, batches, noise)")
  parser.add_argument("--grid", choices=("reduced", "small", "full", "frontier"),
                      default="reduced")
  parser.add_argument("--only", nargs="*", metavar="LABEL",
                      help="run only the grid's runs whose label is exactly one of these, e.g. "
                           "'dp_adafest r=5 tau=5 C1=1' (not its C1=10 sibling)")
  parser.add_argument("--repeat-best", type=int, default=0,
                      help="rerun the best-AUC DP-AdaFEST run with this many other seeds (its "
                           "run-to-run noise; not used in the reduction table)")
  parser.add_argument("--json", help="also write every run's summary here")
  parser.add_argument("--tail-decay", type=float, default=0.0,
                      help="generator's --tail-decay when the data is generated here")
  parser.add_argument("--signal", type=float, nargs="+", metavar="ALPHA",
                      help="only print where the click signal sits for these --tail-decay "
                           "values (on --signal-rows generated rows) and exit")
  parser.add_argument("--signal-rows", type=int, default=400_000)
  parser.add_argument("--signal-taus", type=float, nargs="+", default=SIGNAL_TAUS,
                      help="τ (at C1 = 1) of the --signal columns")
  args = parser.parse_args(argv)
  if args.signal:
    _print_signal(args.signal, args.signal_rows, args.batch_size, args.signal_taus)
    return
  runs = grid(args.grid)
  if args.only:
    unknown = sorted(set(args.only) - {label for label, _ in runs})
    if unknown:
      parser.error(f"--only: no run labelled {', '.join(map(repr, unknown))} in --grid "
                   f"{args.grid}; its labels: {', '.join(label for label, _ in runs)}")
    runs = [(label, overrides) for label, overrides in runs if label in args.only]
  data_dir = args.data
  if data_dir is None:
    data_dir = os.path.join(args.out, f"criteo_{args.rows}_{args.days}" + (
        f"_tail{args.tail_decay:g}" if args.tail_decay else ""))
    if not os.path.exists(os.path.join(data_dir, f"day_{args.days - 1}")):
      synthetic.generate_criteo(data_dir, args.rows, days=args.days, seed=0,
                                config=synthetic.CriteoSynthConfig(tail_decay=args.tail_decay))
  data = ctr_workflow.load_data(data_dir)
  base = ctr_workflow.CTRTrainOptions(
      data=data_dir, epsilon=args.epsilon, batch_size=args.batch_size, steps=args.steps,
      top_k_epsilon=args.top_k_epsilon, optimizer=args.optimizer,
      learning_rate=args.learning_rate, l2_norm_clip=args.l2_norm_clip, seed=args.seed,
      progress=False)
  print(f"# {len(data.train['label']):,} training rows, {len(data.eval['label']):,} held out, "
        f"{sum(data.vocab_sizes):,} embedding rows", file=sys.stderr)
  print("| run | AUC | ε | gradient size reduction | steps/s |")
  print("|---|---:|---:|---:|---:|")
  results = []
  for label, overrides in runs:
    summary = ctr_workflow.run(dataclasses.replace(base, **overrides), data)
    summary.update(label=label, overrides=overrides)
    results.append(summary)
    print(_row(summary), flush=True)
  adafest = [r for r in results if r["algorithm"] == "dp_adafest"]
  repeats = []
  if adafest and args.repeat_best:
    best = max(adafest, key=lambda r: r["auc"])
    for seed in range(args.seed + 1, args.seed + args.repeat_best + 1):
      summary = ctr_workflow.run(dataclasses.replace(base, seed=seed, **best["overrides"]), data)
      summary.update(label=f"{best['label']} seed={seed}", overrides=best["overrides"])
      repeats.append(summary)
      print(_row(summary), flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as out:
      json.dump({"runs": results, "repeats": repeats}, out, indent=2)
  if any(r["algorithm"] == "dp_sgd" for r in results):
    baseline, table = best_reductions(results)
    print(f"\nBest gradient-size reduction at AUC loss ≤ t vs DP-SGD (AUC {baseline:.4f}):\n")
    print("| algorithm | " + " | ".join(f"≤ {t}" for t in THRESHOLDS) + " |")
    print("|---|" + "---:|" * len(THRESHOLDS))
    for algorithm, row in table.items():
      cells = ["—" if v is None else f"{v:.1f}×" for v in row.values()]
      print(f"| {algorithm} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
