"""Seed 002's synthetic heavy-tail experiment (note 002 §4.1): DP-GD, DP-GDM, DP-Adam, DP-AdamBC.

    python benchmarks/adambc_heavytail.py [--steps 200] [--patience 10] [--max-minutes 60]
        [--optimizers dp_gd dp_gdm dp_adam dp_adambc] [--json runs.json]

Layout of note 002 §4.1 (the paper's formulas do not give its instance): group j = 0..7 has 2^j
classes of 1024/2^j examples, so n = 8192, c = 255, d = n + 1024 = 9216; inputs Uniform[0, 1]^d
drawn independently of the labels; a linear softmax model W ∈ R^{c×d}. Full batch, C = 1 (every
per-example gradient (p_i − e_{y_i})·x_iᵀ is clipped: ‖x_i‖ ≈ 55), σ = 10, noise N(0, σ²C²)
per coordinate, normalised by n (Algorithm 1/2). Each optimizer runs the dprec optimizer it
names (SparseSGD, Keras SGD with momentum 0.9, LazyAdam's dense Adam, AdamBC told Φ = (σC/n)²)
over a learning-rate grid until the training loss has not improved for `--patience` steps or
`--steps` are done; the run with the lowest final loss is reported, with loss and accuracy per
frequency group. Privacy: full batch, so T steps compose to one Gaussian mechanism with
noise multiplier σ/√T: ε at δ from its exact (analytic) curve, checked against dp_accounting's
PLD of T unsampled Gaussian steps.
"""
import argparse
import json
import math
import sys
import time

import numpy as np
import tensorflow as tf
from scipy import optimize

from dprec import privacy
from dprec.optimizers import AdamBC, LazyAdam, SparseSGD
from dprec.privacy import analytic_gaussian

GROUPS = 8
PAPER = {  # note 002 §4.1 (Figure 2, C = 1, σ = 10)
    "dp_gd": {"rare_loss": 6.7, "top_acc": 100.0},
    "dp_gdm": {"rare_loss": 4.9, "top_acc": 92.3, "mid_acc": 41.0},
    "dp_adam": {"rare_loss": 5.1, "top_acc": 93.0, "mid_acc": 36.0},
    "dp_adambc": {"rare_loss": 4.8, "top_acc": 87.5, "mid_acc": 47.0, "rare_acc": 9.5},
}
GRIDS = {"dp_gd": (0.3, 1.0), "dp_gdm": (0.03, 0.1),
         "dp_adam": (1e-4, 3e-4), "dp_adambc": (1e-5, 3e-5)}


def make_data(seed=0):
  """X [n, d] float32, labels [n], group of each class [c]."""
  sizes, group_of_class = [], []
  for j in range(GROUPS):
    sizes += [1024 // 2 ** j] * 2 ** j
    group_of_class += [j] * 2 ** j
  labels = np.repeat(np.arange(len(sizes)), sizes)
  n = labels.size
  rng = np.random.default_rng(seed)
  x = rng.random((n, n + 1024), dtype=np.float32)
  return x, labels, np.array(group_of_class)


def make_optimizer(name, lr, noise_variance, gamma):
  if name == "dp_gd":
    return SparseSGD(lr)
  if name == "dp_gdm":  # Keras: b ← μb − η·g, θ ← θ + b, Algorithm 1's DP-GDM with η folded in
    return tf.keras.optimizers.SGD(lr, momentum=0.9, jit_compile=False)
  if name == "dp_adam":
    return LazyAdam(lr, epsilon=gamma)
  optimizer = AdamBC(lr, floor=gamma)
  optimizer.noise_variance.assign(noise_variance)
  return optimizer


def epsilon_full_batch(sigma, steps, delta):
  """(exact ε of one Gaussian mechanism with σ/√T, dp_accounting PLD ε of T steps)."""
  effective = sigma / math.sqrt(steps)
  exact = optimize.brentq(lambda e: analytic_gaussian.exact_delta(effective, e) - delta,
                          1e-9, 1e4, xtol=1e-12)
  pld = privacy.compute_epsilon(sigma, 1.0, steps, delta).epsilon
  return exact, pld


def train(name, lr, gamma, data, args, deadline):
  x, labels, group_of_class = data
  n, d = x.shape
  c = group_of_class.size
  xt = tf.constant(x)
  y = tf.one_hot(labels, c)
  weights = tf.Variable(tf.zeros([c, d]))
  noise_std = args.sigma * args.clip
  optimizer = make_optimizer(name, lr, (noise_std / n) ** 2, gamma)
  generator = tf.random.Generator.from_seed(args.seed)
  row_norms = tf.norm(xt, axis=1)

  @tf.function
  def step():
    logits = tf.matmul(xt, weights, transpose_b=True)
    residual = tf.nn.softmax(logits) - y  # per-example gradient (p_i − e_y)·x_iᵀ
    norms = tf.norm(residual, axis=1) * row_norms
    factors = args.clip / tf.maximum(args.clip, norms)
    clipped = tf.matmul(residual * factors[:, None], xt, transpose_a=True)
    noisy = (clipped + noise_std * generator.normal(tf.shape(clipped))) / n
    optimizer.apply_gradients([(noisy, weights)])
    return tf.nn.softmax_cross_entropy_with_logits(y, logits), tf.argmax(logits, axis=1)

  best, since, history = math.inf, 0, []
  for t in range(1, args.steps + 1):
    losses, predicted = step()
    loss = float(tf.reduce_mean(losses))
    history.append(loss)
    if loss < best - 1e-4:
      best, since = loss, 0
    else:
      since += 1
    if since >= args.patience or time.time() > deadline:
      break
  logits = tf.matmul(xt, weights, transpose_b=True)
  losses = tf.nn.softmax_cross_entropy_with_logits(y, logits).numpy()
  correct = (tf.argmax(logits, axis=1).numpy() == labels)
  groups = group_of_class[labels]
  per_group = [{"group": j, "classes": 2 ** j, "examples_per_class": 1024 // 2 ** j,
                "loss": float(losses[groups == j].mean()),
                "accuracy": float(100 * correct[groups == j].mean())} for j in range(GROUPS)]
  return {"optimizer": name, "learning_rate": lr, "gamma": gamma, "steps": t,
          "loss": float(losses.mean()), "accuracy": float(100 * correct.mean()),
          "groups": per_group, "loss_curve": history[::10]}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--optimizers", nargs="+", default=list(GRIDS), choices=list(GRIDS))
  parser.add_argument("--steps", type=int, default=200, help="most steps per run")
  parser.add_argument("--patience", type=int, default=10,
                      help="stop when the loss has not improved for this many steps")
  parser.add_argument("--max-minutes", type=float, default=60.0,
                      help="wall-clock cap on the whole benchmark (runs are cut short)")
  parser.add_argument("--sigma", type=float, default=10.0)
  parser.add_argument("--clip", type=float, default=1.0)
  parser.add_argument("--gamma", type=float, default=1e-8,
                      help="DP-Adam's γ and DP-AdamBC's γ' (Algorithm 2)")
  parser.add_argument("--learning-rates", type=float, nargs="+",
                      help="one grid for every optimizer instead of the built-in per-optimizer grids")
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", help="write all runs here")
  args = parser.parse_args(argv)
  data = make_data(args.seed)
  start = time.time()
  runs = []
  jobs = [(name, lr) for name in args.optimizers for lr in (args.learning_rates or GRIDS[name])]
  for i, (name, lr) in enumerate(jobs):
    # An equal share of the remaining time for each remaining run.
    remaining = args.max_minutes * 60 - (time.time() - start)
    deadline = time.time() + remaining / (len(jobs) - i)
    run = train(name, lr, args.gamma, data, args, deadline)
    run["seconds"] = time.time() - deadline + remaining / (len(jobs) - i)
    run["epsilon_exact"], run["epsilon_pld"] = epsilon_full_batch(args.sigma, run["steps"],
                                                                  args.delta)
    runs.append(run)
    print(json.dumps({k: v for k, v in run.items() if k not in ("groups", "loss_curve")}),
          file=sys.stderr, flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as out:
      json.dump(runs, out, indent=1)
  print(f"n = 8192, d = 9216, c = 255, C = {args.clip}, σ = {args.sigma}, δ = {args.delta}, "
        f"γ = γ' = {args.gamma}; best run (lowest training loss) per optimizer\n")
  print("| optimizer | lr | steps | ε exact (PLD) | loss | acc % | rarest group loss (paper) "
        "| rarest acc % (paper) | 8×128 group acc % (paper) | top class acc % (paper) |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in args.optimizers:
    best = min((r for r in runs if r["optimizer"] == name), key=lambda r: r["loss"])
    groups, paper = best["groups"], PAPER[name]
    cell = lambda value, key: f"{value:.1f} ({paper[key]:g})" if key in paper else f"{value:.1f}"
    print(f"| {name} | {best['learning_rate']:g} | {best['steps']} | "
          f"{best['epsilon_exact']:.2f} ({best['epsilon_pld']:.2f}) | {best['loss']:.3f} | "
          f"{best['accuracy']:.1f} | {cell(groups[-1]['loss'], 'rare_loss')} | "
          f"{cell(groups[-1]['accuracy'], 'rare_acc')} | {cell(groups[3]['accuracy'], 'mid_acc')} | "
          f"{cell(groups[0]['accuracy'], 'top_acc')} |")
  print("\nloss / accuracy % per group (j: 2^j classes × 1024/2^j examples):")
  for name in args.optimizers:
    best = min((r for r in runs if r["optimizer"] == name), key=lambda r: r["loss"])
    print(f"{name}: " + "  ".join(f"g{g['group']} {g['loss']:.2f}/{g['accuracy']:.0f}"
                                  for g in best["groups"]))


if __name__ == "__main__":
  main()
