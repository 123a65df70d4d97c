"""Why DP pCTR models are badly calibrated, one lever at a time.

    dprec synth criteo --rows 800000 --days 2 --seed 0 --out DATA
    python benchmarks/calibration_ctr.py --data DATA [--steps 300] [--seeds 0 1] [--only NAME ...]

Trains on day 0 (400k rows), evaluates on day 1; B = 1024, ε = 1 (δ = 1/N), DP-AdaFEST with
`train ctr`'s defaults except the lever named in the run. Prints held-out log loss next to AUC,
with the base rate's log loss (the summary's `base_rate_log_loss`: predicting the training click
rate, a DP estimate in DP runs), the DP Platt scaling a·z + b and a non-private row.
`--noise-seed N` draws every run's noise from the public seed N (NOT private): runs that differ in
a lever then see the same noise, so their difference is mostly the lever's. Runs marked
`noise_free` train with σ1 = σ2 = 0 (clipping and the AdaFEST threshold only; NOT private, a
diagnostic that separates clipping bias from noise); runs may set their own batch size and steps
(None: `train ctr`'s, from N). The ≥ 5M-row setting: `dprec synth criteo --rows 6000000 --days 6
--seed 0 --out DATA`, then `--steps 1000 --batch-size 2048` (days 0–4 train, day 5 held out).
"""
import argparse
import contextlib
import dataclasses
import json
import sys
from unittest import mock

from dprec.workflows import ctr as ctr_workflow

# The old defaults: Glorot logit layer, C2 = 1, lazy Adam 3e-3, no recalibration.
TODAY = dict(logit_init="default", optimizer="adam", learning_rate=3e-3, l2_norm_clip=1.0,
             calibration_share=0.0)
# The first calibrated defaults (C2 = 10, lazy Adam 3e-4, base-rate init, no recalibration).
PREVIOUS = dict(l2_norm_clip=10.0, learning_rate=3e-4, calibration_share=0.0)
RUNS = {
    "non_private": dict(algorithm="non_private", logit_init="default"),
    "non_private base_rate init": dict(algorithm="non_private", logit_init="base_rate"),
    "dp_adafest (old defaults: adam 3e-3, Glorot logit)": TODAY,
    "old + base_rate init": dict(TODAY, logit_init="base_rate"),
    "old + adambc": dict(TODAY, optimizer="adambc"),
    "old + adambc + base_rate init": dict(TODAY, optimizer="adambc", logit_init="base_rate"),
    "old + sgd lr 1": dict(TODAY, optimizer="sgd", learning_rate=1.0),
    "old + sgd lr 1 + base_rate init": dict(TODAY, optimizer="sgd", learning_rate=1.0,
                                            logit_init="base_rate"),
    "old + lr 1e-3": dict(TODAY, learning_rate=1e-3),
    "old + lr 1e-3 + base_rate init": dict(TODAY, learning_rate=1e-3, logit_init="base_rate"),
    "old + C2 10 + base_rate init": dict(TODAY, l2_norm_clip=10.0, logit_init="base_rate"),
    "old + lr 3e-4 + base_rate init": dict(TODAY, learning_rate=3e-4, logit_init="base_rate"),
    "old + C2 10 + lr 3e-4 + base_rate init": dict(TODAY, l2_norm_clip=10.0, learning_rate=3e-4,
                                                   logit_init="base_rate"),
    "old + C2 10 + sgd lr 0.1 + base_rate init": dict(TODAY, l2_norm_clip=10.0, optimizer="sgd",
                                                      learning_rate=0.1, logit_init="base_rate"),
    "previous defaults (C2 10, adam 3e-4)": PREVIOUS,
    "previous defaults + recalibration": dict(PREVIOUS, calibration_share=0.1),
    "new defaults, no recalibration": dict(calibration_share=0.0),
    "new defaults, recalibration share 0.01": dict(calibration_share=0.01),
    "new defaults": {},
    "train ctr's defaults (B and steps from N: one epoch)": dict(batch_size=None, steps=None),
    # The ≥ 5M-row setting (--steps 1000 --batch-size 2048): clipping bias vs noise, then signal
    # per noise (σ hardly grows with B or T at ε = 1 here, so σ2/B falls almost as 1/B).
    "new defaults, sigma 0 (clipping only, NOT private)": dict(noise_free=True),
    "new defaults, dp_sgd, sigma 0 (clipping only, NOT private)": dict(noise_free=True,
                                                                        algorithm="dp_sgd"),
    "new defaults, C2 10, sigma 0 (clipping only, NOT private)": dict(noise_free=True,
                                                                      l2_norm_clip=10.0),
    "new defaults, B 8192, 250 steps, sigma 0 (NOT private)": dict(noise_free=True,
                                                                   batch_size=8192, steps=250),
    "new defaults, B 8192, 250 steps": dict(batch_size=8192, steps=250),
    "new defaults, B 8192, 250 steps, r 2": dict(batch_size=8192, steps=250, ratio=2.0),
    "new defaults, B 8192, 250 steps, r 2, tau 7": dict(batch_size=8192, steps=250, ratio=2.0,
                                                        threshold=7.0),
    "new defaults, B 8192, 610 steps (1 epoch of 5M)": dict(batch_size=8192, steps=610),
    "new defaults, B 16384, 305 steps (1 epoch of 5M)": dict(batch_size=16384, steps=305),
    "new defaults, dp_sgd, B 8192, 610 steps": dict(algorithm="dp_sgd", batch_size=8192,
                                                   steps=610),
}


@contextlib.contextmanager
def noise_free(enabled):
  """σ1 = σ2 = 0 in the DP step when `enabled` (the plan, and so the summary's ε, unchanged)."""
  if not enabled:
    yield
    return
  with mock.patch.object(ctr_workflow, "noise_multipliers", lambda options, sigma: (0.0, 0.0)):
    yield


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", required=True)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=1024)
  parser.add_argument("--epsilon", type=float, default=1.0)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--only", nargs="+", help="run names (or prefixes of names) to run")
  parser.add_argument("--json", help="append each summary here (JSON lines)")
  parser.add_argument("--noise-seed", type=int,
                      help="public noise seed of every run (NOT private)")
  parser.add_argument("--progress", action="store_true", help="progress bar of each run")
  args = parser.parse_args(argv)
  data = ctr_workflow.load_data(args.data)
  rows = []
  for name, change in RUNS.items():
    if args.only and not any(name == p or (p not in RUNS and name.startswith(p))
                             for p in args.only):
      continue
    for seed in args.seeds:
      options = ctr_workflow.CTRTrainOptions(data=args.data, algorithm="dp_adafest",
                                             epsilon=args.epsilon, batch_size=args.batch_size,
                                             steps=args.steps, seed=seed, progress=args.progress,
                                             insecure_noise_seed=args.noise_seed)
      change = dict(change)
      without_noise = change.pop("noise_free", False)
      options = dataclasses.replace(options, **change)
      if options.algorithm == "non_private":
        options = dataclasses.replace(options, epsilon=None)
      with noise_free(without_noise):
        summary = ctr_workflow.run(options, data)
      row = {"run": name, "seed": seed, **{k: summary[k] for k in (
          "auc", "eval_log_loss", "base_rate", "base_rate_log_loss", "calibration_scale",
          "calibration_shift", "epsilon", "batch_size", "steps", "sigma2",
          "train_seconds")}}
      rows.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
      if args.json:
        with open(args.json, "a", encoding="utf-8") as out:
          out.write(json.dumps({"run": name, **summary}) + "\n")
  print("| run | seed | AUC | held-out log loss | base-rate log loss | Platt a, b | ε |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    eps = "∞" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
    platt = ("—" if r["calibration_shift"] is None
             else f"{r['calibration_scale']:.3f}, {r['calibration_shift']:+.3f}")
    print(f"| {r['run']} | {r['seed']} | {r['auc']:.4f} | {r['eval_log_loss']:.4f} | "
          f"{r['base_rate_log_loss']:.4f} | {platt} | {eps} |")


if __name__ == "__main__":
  main()
