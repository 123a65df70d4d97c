"""Tang et al.'s "On the Performance of Differentially Private Optimization with Heavy-Tail Class
Imbalance" (arXiv:2411.04205) synthetic heavy-tail experiment (Tang et al. 2024, §3, Figure 2):
DP-GD, DP-GDM, DP-Adam and DP-AdamBC run until the training loss stops improving.

    python benchmarks/adambc_heavytail.py [--top-class 1024] [--optimizers ...]
        [--learning-rates ...] [--floor-ratios ...] [--draws 2] [--json runs.json]
        [--plot curves.png]
    python benchmarks/adambc_heavytail.py --from-json runs*.json --plot curves.png

Layout of Tang et al. 2024, §3 (the paper's formulas do not give its instance): group j = 0..G−1 has
2^j classes of S/2^j examples (S = `--top-class`, the most frequent class; the rarest classes have
8), so S = 1024 is the paper's n = 8192, c = 255, d = n + S = 9216; inputs Uniform[0, 1]^d drawn
independently of the labels (public seed); a linear softmax model (kernel W ∈ R^{d×c}) from zero.

The step is full batch, C = 1, σ = 10 (Algorithm 1/2): noise N(0, σ²C²) per coordinate, the sum
normalised by n. The model is linear, so example i's gradient is the outer product
(p_i − e_{y_i})·x_iᵀ: its norm is ‖p_i − e_{y_i}‖·‖x_i‖ (no per-example gradient is formed) and
the clipped sum is one GEMM, Xᵀ((P − Y)·f) with f_i = min(1, C/‖g_i‖) (`clipped_gradient_sum`,
dprec's ghost norms, clip factors and Dense clipped sum).
The update under test is dprec's optimizer named by the run: `SparseSGD` (DP-GD), Keras SGD with
momentum 0.9 (DP-GDM), `LazyAdam` with ε = γ (DP-Adam), `AdamBC` with floor γ' and Φ = (σC/n)²
(DP-AdamBC).

A run stops when its training loss has not improved by `--tolerance` for `--patience` steps
(the paper's "until the overall training loss stops decreasing"), or at `--max-epsilon`; the
stopping rule reads the non-private training loss, as the paper does (a study of training
behaviour, not a private model selection). Per (optimizer, learning rate, γ) the best of the
grid is the lowest final training loss, as in the paper.

Noise: from the secret per-run key of a `dprec.workflows.run.Run` (OS CSPRNG), one stream per
noise draw shared by every optimizer of that draw; `--insecure-noise-seed` makes the curves
reproducible and the run not private (flagged in the output). Privacy: full batch (q = 1), so T
steps compose to one Gaussian mechanism with noise multiplier σ/√T; ε at δ is dprec's accountant
(`privacy.compute_epsilon`, dp_accounting's PLD), checked against the exact analytic curve.
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
from dprec.clipping import layer_norms
from dprec.optimizers import DPSGD, AdamBC, LazyAdam, SparseSGD
from dprec.privacy import analytic_gaussian
from dprec.workflows.run import Run

RAREST_CLASS = 8
# Tang et al. 2024, §3 (Figure 2, C = 1, σ = 10): training loss / accuracy % per group, S = 1024;
# the others' rarest-group accuracy is derived from "DP-AdamBC 9.5%, approximately 9%, 7% and 8%
# better".
PAPER = {
    "dp_gd": {"rare_loss": 6.7, "top_acc": 100.0, "mid_acc": 0.0, "rare_acc": 0.5},
    "dp_gdm": {"rare_loss": 4.9, "top_acc": 92.3, "mid_acc": 41.0, "rare_acc": 2.5},
    "dp_adam": {"rare_loss": 5.1, "top_acc": 93.0, "mid_acc": 36.0, "rare_acc": 1.5},
    "dp_adambc": {"rare_loss": 4.8, "top_acc": 87.5, "mid_acc": 47.0, "rare_acc": 9.5},
}
# The paper's grid "(1e−2, 5e−2, 1e−3, …)", read as {1, 5}·10^k (Tang et al. 2024), around each
# optimizer's stable range on this problem.
GRIDS = {"dp_gd": (1.0, 0.5, 0.1), "dp_gdm": (0.1, 0.05, 0.01),
         "dp_adam": (1e-2, 5e-3, 1e-3, 5e-4, 1e-4), "dp_adambc": (5e-3, 1e-3, 5e-4, 1e-4, 5e-5)}
# DP-Adam's γ; DP-AdamBC's γ' as a fraction of the noise variance Φ = (σC/n)² (`--floor-ratios`):
# a noise-only coordinate steps ≈ 0.23·η/sqrt(γ'/Φ), so γ' scales with Φ across problem sizes.
FLOORS = {"dp_gd": (0.0,), "dp_gdm": (0.0,), "dp_adam": (1e-8,)}
FLOOR_RATIOS = (0.01, 0.1, 1.0)


def make_data(top_class=1024, seed=0):
  """X [n, d] float32 (public seed), labels [n], group of each class [c]."""
  groups = int(round(math.log2(top_class / RAREST_CLASS))) + 1
  if top_class != RAREST_CLASS * 2 ** (groups - 1):
    raise ValueError(f"--top-class must be 8·2^k, got {top_class}")
  sizes, group_of_class = [], []
  for j in range(groups):
    sizes += [top_class // 2 ** j] * 2 ** j
    group_of_class += [j] * 2 ** j
  labels = np.repeat(np.arange(len(sizes)), sizes)
  n = labels.size
  x = np.random.default_rng(seed).random((n, n + top_class), dtype=np.float32)
  return x, labels, np.array(group_of_class)


def clipped_gradient_sum(layer, config, x, residual):
  """Σ_i clip(g_i, C) for the linear model's kernel [d, c], with dprec's clipping: example i's
  gradient is the outer product x_i·(p_i − e_{y_i})ᵀ, so its squared norm is
  ‖x_i‖²·‖p_i − e_{y_i}‖² (`gram_squared_norms` with one position: no per-example gradient),
  the factors are `DPSGD.clip_factors`, min(1, C/‖g_i‖), and the sum Xᵀ((P − Y)·f) is one GEMM
  (`dense_clipped_gradients`)."""
  squared_norms = layer_norms.gram_squared_norms(x[:, None], residual[:, None])
  factors = config.clip_factors(squared_norms)
  return layer_norms.dense_clipped_gradients(layer, [x], residual, factors)[0]


def linear_model(c, d):
  """The model W (a bias-free Dense layer, kernel [d, c]) from zero."""
  layer = tf.keras.layers.Dense(c, use_bias=False, kernel_initializer="zeros")
  layer.build((None, d))
  return layer


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
  """(dprec's accountant: dp_accounting PLD of T unsampled Gaussian steps, exact ε of one
  Gaussian mechanism with σ/√T)."""
  pld = privacy.compute_epsilon(sigma, 1.0, steps, delta).epsilon
  exact = optimize.brentq(
      lambda e: analytic_gaussian.exact_delta(sigma / math.sqrt(steps), e) - delta,
      1e-9, 1e4, xtol=1e-12)
  return pld, exact


def steps_for_epsilon(sigma, epsilon, delta):
  """The most full-batch steps whose exact ε stays ≤ `epsilon` (σ_eff = σ/√T)."""
  effective = optimize.brentq(lambda s: analytic_gaussian.exact_delta(s, epsilon) - delta,
                              1e-3, 1e3, xtol=1e-12)
  return int((sigma / effective) ** 2)


class Problem:
  """The data on the device and the per-group bookkeeping shared by every run."""

  def __init__(self, top_class, seed):
    x, labels, group_of_class = make_data(top_class, seed)
    self.n, self.d = x.shape
    self.c = group_of_class.size
    self.groups = int(group_of_class.max()) + 1
    self.labels = labels
    self.x = tf.constant(x)
    self.y = tf.one_hot(labels, self.c)
    self.group_of_class = group_of_class
    self.example_group = tf.constant(group_of_class[labels], tf.int32)


def train(problem, name, lr, gamma, generator, args, max_steps, progress=lambda partial: None):
  """One run from W = 0; per-step curves of loss and accuracy, overall and per group;
  `progress` sees the curves so far every 100 steps."""
  n, groups = problem.n, problem.groups
  layer = linear_model(problem.c, problem.d)
  config = DPSGD(l2_norm_clip=args.clip, noise_multiplier=args.sigma)
  noise_std = args.sigma * args.clip
  optimizer = make_optimizer(name, lr, (noise_std / n) ** 2, gamma)

  @tf.function
  def step():
    logits = tf.matmul(problem.x, layer.kernel)
    residual = tf.nn.softmax(logits) - problem.y  # ∂ℓ_i/∂logits_i
    clipped = clipped_gradient_sum(layer, config, problem.x, residual)
    noisy = (clipped + noise_std * generator.normal(tf.shape(clipped))) / n
    optimizer.apply_gradients([(noisy, layer.kernel)])
    return measure(logits)

  @tf.function
  def evaluate():
    return measure(tf.matmul(problem.x, layer.kernel))

  @tf.function
  def signal():  # the noiseless clipped gradient at the current model
    residual = tf.nn.softmax(tf.matmul(problem.x, layer.kernel)) - problem.y
    return clipped_gradient_sum(layer, config, problem.x, residual) / n

  def measure(logits):
    losses = tf.nn.softmax_cross_entropy_with_logits(problem.y, logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32),
                               tf.constant(problem.labels, tf.int32)), tf.float32)
    group = lambda v: tf.math.unsorted_segment_mean(v, problem.example_group, groups)
    return (tf.concat([[tf.reduce_mean(losses)], group(losses)], 0),
            tf.concat([[tf.reduce_mean(correct)], group(correct)], 0))

  best, since, losses, accuracies = math.inf, 0, [], []
  start = time.time()
  for t in range(1, max_steps + 1):
    loss, accuracy = step()  # the model before update t
    if t == 1:
      traced = time.time()  # step time: the steps after the traced first one
    losses.append(loss.numpy().tolist())
    accuracies.append(accuracy.numpy().tolist())
    if not math.isfinite(losses[-1][0]):
      break
    if losses[-1][0] < best - args.tolerance:
      best, since = losses[-1][0], 0
    else:
      since += 1
    if since >= args.patience:
      break
    if t % 100 == 0:
      progress({"optimizer": name, "learning_rate": lr, "gamma": gamma, "steps": t,
                "stopped": "running", "loss_curve": losses, "accuracy_curve": accuracies})
  loss, accuracy = evaluate()  # the model after the last update: the one reported
  losses.append(loss.numpy().tolist())
  accuracies.append(accuracy.numpy().tolist())
  stopped = ("diverged" if not math.isfinite(losses[-1][0]) else
             "patience" if since >= args.patience else "max_epsilon")
  noise_variance = (noise_std / n) ** 2
  signal_to_noise = signal().numpy() ** 2 / noise_variance
  groups = problem.groups
  return {"optimizer": name, "learning_rate": lr, "gamma": gamma, "steps": t,
          "preconditioner": preconditioner_by_group(optimizer, name, problem.group_of_class,
                                                    noise_variance),
          # g²/Φ per coordinate at the end, median per group: below v̂'s own noise,
          # std(v̂)/Φ ≈ sqrt(2(1 − β2)/(1 + β2)) ≈ 0.032 (more before 1/(1 − β2) steps),
          # v̂ − Φ̂ cannot tell the signal from the noise (Tang et al. 2024).
          "signal_to_noise": [float(np.median(signal_to_noise[:, problem.group_of_class == j]))
                              for j in range(groups)],
          "stopped": stopped, "seconds": time.time() - start,
          "seconds_per_step": (time.time() - traced) / max(t - 1, 1),
          "loss_curve": losses, "accuracy_curve": accuracies}


def preconditioner_by_group(optimizer, name, group_of_class, noise_variance):
  """Per frequency group, the median over its coordinates of the denominator of the update
  relative to the noise's std sqrt(Φ) (DP-Adam: sqrt(v̂); DP-AdamBC: sqrt(max(v̂ − Φ̂, γ'))),
  and DP-AdamBC's share of coordinates at the floor γ': how the two precondition rare against
  frequent classes (Tang et al. 2024)."""
  if name not in ("dp_adam", "dp_adambc"):
    return None
  t = float(optimizer.iterations.numpy())
  if name == "dp_adam":
    v, phi = optimizer._velocities[0].numpy(), 0.0
  else:
    _, v, phi, _ = (s.numpy() for s in optimizer._slots[0])
    phi = phi[:, None]  # one Φ̂ per row of the kernel [d, c]: every row is noised each step
  correction = 1 - optimizer.beta_2 ** t
  corrected = v / correction - phi / correction
  floor = optimizer.floor if name == "dp_adambc" else 0.0
  denominator = np.sqrt(np.maximum(corrected, floor)) / math.sqrt(noise_variance)
  groups = int(group_of_class.max()) + 1
  return {"median_denominator": [float(np.median(denominator[:, group_of_class == j]))
                                 for j in range(groups)],
          "at_floor": [float(np.mean(corrected[:, group_of_class == j] <= floor))
                       for j in range(groups)]}


def report(run):
  """The final iterate's overall and per-group numbers (accuracy in %)."""
  loss, accuracy = run["loss_curve"][-1], run["accuracy_curve"][-1]
  return {"loss": loss[0], "accuracy": 100 * accuracy[0], "group_loss": loss[1:],
          "group_accuracy": [100 * a for a in accuracy[1:]]}


def best_runs(runs, name):
  """Per noise draw, the run of `name` with the lowest final training loss (the paper's rule)."""
  by_draw = {}
  for run in runs:
    if run["optimizer"] == name and math.isfinite(run["loss_curve"][-1][0]):
      current = by_draw.get(run["draw"])
      if current is None or run["loss_curve"][-1][0] < current["loss_curve"][-1][0]:
        by_draw[run["draw"]] = run
  return [by_draw[k] for k in sorted(by_draw)]


def print_table(runs, args, groups):
  mid = min(3, groups - 1)  # the group of 8 classes (8 × 128 at S = 1024)
  print(f"S = {args.top_class}: n = {runs[0]['n']}, d = {runs[0]['d']}, c = {runs[0]['c']}, "
        f"C = {args.clip}, σ = {args.sigma}, δ = {args.delta}; best run (lowest final training "
        f"loss) per optimizer and noise draw; {runs[0]['noise']}\n")
  print("| optimizer | lr | γ | steps (stop) | ε PLD (exact) | loss | acc % "
        "| rarest group loss (paper) | rarest acc % (paper) | 8-class group acc % (paper) "
        "| top class acc % (paper) |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in args.optimizers:
    paper = PAPER[name]
    for run in best_runs(runs, name):
      r = report(run)
      print(f"| {name} (draw {run['draw']}) | {run['learning_rate']:g} | {run['gamma']:g} | "
            f"{run['steps']} ({run['stopped']}) | {run['epsilon']:.2f} "
            f"({run['epsilon_exact']:.2f}) | {r['loss']:.3f} | {r['accuracy']:.1f} | "
            f"{r['group_loss'][-1]:.2f} ({paper['rare_loss']:g}) | "
            f"{r['group_accuracy'][-1]:.1f} ({paper['rare_acc']:g}) | "
            f"{r['group_accuracy'][mid]:.1f} ({paper['mid_acc']:g}) | "
            f"{r['group_accuracy'][0]:.1f} ({paper['top_acc']:g}) |")
  print("\nfinal loss / accuracy % per group (gj: 2^j classes × S/2^j examples):")
  for name in args.optimizers:
    for run in best_runs(runs, name):
      r = report(run)
      print(f"{name} draw {run['draw']}: " + "  ".join(
          f"g{j} {r['group_loss'][j]:.2f}/{r['group_accuracy'][j]:.1f}" for j in range(groups)))


def plot(runs, args, path):
  """Training loss and accuracy against ε, overall and per group, best run per optimizer."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = len(runs[0]["loss_curve"][0]) - 1
  shown = [("all", 0), ("top class (g0)", 1), ("8 classes (g3)", min(4, groups)),
           (f"rarest (g{groups - 1})", groups)]
  fig, axes = plt.subplots(2, len(shown), figsize=(4 * len(shown), 6.5), squeeze=False)
  colors = {"dp_gd": "tab:blue", "dp_gdm": "tab:orange", "dp_adam": "tab:green",
            "dp_adambc": "tab:red"}
  for name in args.optimizers:
    for k, run in enumerate(best_runs(runs, name)):
      steps = np.arange(len(run["loss_curve"]))
      grid = np.unique(np.linspace(1, steps[-1], 40).astype(int))  # PLD per step is slow
      eps = np.interp(steps, np.r_[0, grid], np.r_[0, [
          privacy.compute_epsilon(args.sigma, 1.0, s, args.delta).epsilon for s in grid]])
      loss, acc = np.array(run["loss_curve"]), 100 * np.array(run["accuracy_curve"])
      for col, (_, index) in enumerate(shown):
        label = f"{name} lr {run['learning_rate']:g}" if k == 0 and col == 0 else None
        axes[0][col].plot(eps, loss[:, index], color=colors[name], alpha=1 - 0.4 * k,
                          label=label, lw=1)
        axes[1][col].plot(eps, acc[:, index], color=colors[name], alpha=1 - 0.4 * k, lw=1)
  for col, (title, _) in enumerate(shown):
    axes[0][col].set_title(f"{title}: training loss")
    axes[1][col].set_title(f"{title}: training accuracy %")
    axes[1][col].set_xlabel(f"ε (δ = {args.delta:g})")
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"Tang et al. 2024 Figure 2 protocol, S = {args.top_class}, C = {args.clip}, "
               f"σ = {args.sigma}; {runs[0]['noise']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def floors(name, args, n):
  """The γ grid of `name`: DP-AdamBC's γ' = ratio·(σC/n)², DP-Adam's γ, 0 for the others."""
  if name == "dp_adambc":
    return [ratio * (args.sigma * args.clip / n) ** 2 for ratio in args.floor_ratios]
  return args.adam_gamma if name == "dp_adam" else FLOORS[name]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--top-class", type=int, default=1024,
                      help="examples of the most frequent class, S = 8·2^k (1024: the paper)")
  parser.add_argument("--optimizers", nargs="+", default=list(GRIDS), choices=list(GRIDS))
  parser.add_argument("--learning-rates", type=float, nargs="+",
                      help="one grid for every optimizer instead of the built-in grids")
  parser.add_argument("--adam-gamma", type=float, nargs="+", default=list(FLOORS["dp_adam"]),
                      help="DP-Adam's γ grid (added to sqrt(v̂))")
  parser.add_argument("--floor-ratios", type=float, nargs="+", default=list(FLOOR_RATIOS),
                      help="DP-AdamBC's γ' grid as fractions of Φ = (σC/n)²")
  parser.add_argument("--draws", type=int, default=1, help="noise draws per configuration")
  parser.add_argument("--first-draw", type=int, default=0,
                      help="label of the first draw (a process run alongside another takes "
                           "other labels; its secret key is its own either way)")
  parser.add_argument("--patience", type=int, default=100,
                      help="stop when the loss has not improved for this many steps")
  parser.add_argument("--tolerance", type=float, default=1e-3,
                      help="an improvement smaller than this does not count")
  parser.add_argument("--max-epsilon", type=float, default=28.0,
                      help="stop at this ε (Appendix C's endpoint) if the loss still improves")
  parser.add_argument("--max-steps", type=int, help="cap on steps (default: from --max-epsilon)")
  parser.add_argument("--sigma", type=float, default=10.0)
  parser.add_argument("--clip", type=float, default=1.0)
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--data-seed", type=int, default=0, help="public seed of the inputs")
  parser.add_argument("--insecure-noise-seed", type=int,
                      help="reproducible noise from a public seed: the run is NOT private")
  parser.add_argument("--threads", type=int, help="TF intra-op threads (default: TF's)")
  parser.add_argument("--json", help="write every run (with its curves) here")
  parser.add_argument("--plot", help="write the best runs' learning curves (PNG) here")
  parser.add_argument("--signal-at-start", action="store_true",
                      help="no training: print g²/Φ per group at W = 0 (the noiseless clipped "
                           "gradient's squared coordinates over the noise variance)")
  parser.add_argument("--from-json", nargs="+",
                      help="no training: the table and plot of these --json files' runs (the "
                           "parts of a grid run as separate processes)")
  args = parser.parse_args(argv)
  if args.from_json:
    runs = []
    for path in args.from_json:
      with open(path, encoding="utf-8") as f:
        runs += [r for r in json.load(f) if r["top_class"] == args.top_class]
    args.optimizers = [name for name in args.optimizers if any(r["optimizer"] == name
                                                               for r in runs)]
    print_table(runs, args, len(runs[0]["loss_curve"][0]) - 1)
    if args.plot:
      plot(runs, args, args.plot)
    return
  if args.threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
  problem = Problem(args.top_class, args.data_seed)
  if args.signal_at_start:
    layer = linear_model(problem.c, problem.d)
    residual = tf.nn.softmax(tf.matmul(problem.x, layer.kernel)) - problem.y
    gradient = clipped_gradient_sum(layer, DPSGD(l2_norm_clip=args.clip,
                                                 noise_multiplier=args.sigma),
                                    problem.x, residual).numpy() / problem.n
    ratio = gradient ** 2 / (args.sigma * args.clip / problem.n) ** 2
    print(f"S = {args.top_class}: median g²/Φ per group at W = 0: " + "  ".join(
        f"g{j} {np.median(ratio[:, problem.group_of_class == j]):.2e}"
        for j in range(problem.groups)))
    return
  max_steps = args.max_steps or steps_for_epsilon(args.sigma, args.max_epsilon, args.delta)
  runs = []
  with Run("benchmarks/adambc_heavytail.py", insecure_noise_seed=args.insecure_noise_seed) as run:
    noise = ("noise from the run's secret key" if run.key.private else
             f"INSECURE noise seed {args.insecure_noise_seed}: reproducible, not private")
    jobs = [(draw, name, lr, gamma)
            for draw in range(args.first_draw, args.first_draw + args.draws)
            for name in args.optimizers
            for lr in (args.learning_rates or GRIDS[name])
            for gamma in floors(name, args, problem.n)]
    def save(partial=None):  # after every run and during one: a long grid keeps what it did
      if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
          json.dump(runs + ([partial] if partial else []), out)

    def describe(result, draw):
      result.update(draw=draw, n=problem.n, d=problem.d, c=problem.c, noise=noise,
                    top_class=args.top_class, sigma=args.sigma, clip=args.clip,
                    delta=args.delta)
      result["epsilon"], result["epsilon_exact"] = epsilon_full_batch(
          args.sigma, result["steps"], args.delta)
      return result

    for draw, name, lr, gamma in jobs:
      generator = run.key.tf_generator("adambc_heavytail", draw)
      result = train(problem, name, lr, gamma, generator, args, max_steps,
                     lambda partial, draw=draw: save(describe(partial, draw)))
      runs.append(describe(result, draw))
      summary = {k: v for k, v in result.items() if not k.endswith("_curve") and k != "noise"}
      summary.update({k: v for k, v in report(result).items() if not k.startswith("group")})
      summary["rare_accuracy"] = report(result)["group_accuracy"][-1]
      print(json.dumps(summary), file=sys.stderr, flush=True)
      save()
  print_table(runs, args, problem.groups)
  if args.plot:
    plot(runs, args, args.plot)


if __name__ == "__main__":
  main()
