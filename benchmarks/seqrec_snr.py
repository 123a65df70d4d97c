"""Where a DP sequential recommender's signal goes: item-table share of the per-user gradient norm
and per-row signal-to-noise over a run, by item popularity.

    python benchmarks/seqrec_snr.py [--data ../shared/data/amazon-video-games/Video.txt]
        [--epsilon 5] [--epochs 100] [--batch-size 1024] [--dim 64] [--sample 512]
        [--item-rank R] [--checkpoint CKPT]

At a fixed model (the initialisation, or `--checkpoint`, a `train seqrec` checkpoint of the same
architecture), on the real training users:

- f: the tied item table's share ‖g_u,E‖² / ‖g_u‖² of each user's squared gradient norm, from
  brute-force per-user gradients on `--sample` users (also checked against `DPModel`'s
  per-example norms), and how much of ‖g_u,E‖² lies on the rows of the user's own items;
- per-row SNR over a run: the clipped signal of one pass over all N users on row j,
  S_j = Σ_u c_u g_u,j with c_u = min(1, C/‖g_u‖), against the noise the run adds to that row.
  A run of E epochs and T = E·N/B steps accumulates ≈ E·S_j of signal (if the model stood still)
  and noise of norm σC·√(T·d), so SNR_j = E‖S_j‖ / (σC√(Td)). Both are divided by B in the step,
  so B cancels except through T and σ.

Rows are grouped by the number of training users n_j holding the item and by the evaluation's
head/torso/tail buckets (a third of the training occurrences each). These are measurements on a
public benchmark data set, not releases of a DP run: exact counts are used freely here.
Dropout is off by default (`--dropout 0`), so that the norms match the DP step's exactly and S is
the clipped gradient of the expected forward pass.
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.data.sequences import load_sequences
from dprec.models import ranking_metrics
from dprec.models.seqrec import SeqRecModel
from dprec.data.sequences import make_examples
from dprec.workflows.seqrec import SeqRecTrainOptions
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer

USER_BINS = (1, 3, 10, 30, 90, 300, 1000, 10 ** 9)


def build(options, num_items, sigma, checkpoint):
  model = SeqRecModel(options.model_config(num_items))
  model({"items": np.zeros((1, options.max_len), np.int32)})
  model.compile(optimizer=DPOptimizer(config_lib.DPSGD(options.l2_norm_clip, sigma),
                                      tf.keras.optimizers.Adam(),
                                      expected_batch_size=options.batch_size))
  if checkpoint:
    tf.train.Checkpoint(model=model).restore(checkpoint).expect_partial()
  return model


def per_user_norms(model, items, labels, batch):
  """‖g_u‖² for every user, as the DP step computes them (Phantom + registry)."""
  norms = tf.function(lambda x, y: model.per_example_squared_norms({"items": x}, y))
  return np.concatenate([norms(items[i:i + batch], labels[i:i + batch]).numpy()
                         for i in range(0, len(items), batch)])


def brute_force_shares(model, items, labels):
  """Per user: ‖g‖², ‖g_E‖², and ‖g_E restricted to the user's own item rows‖² (by GradientTape)."""
  table = model.item_embedding.trainable_weights
  loss_fn = model.per_example_loss

  @tf.function
  def grads(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(y, model({"items": x}, training=False)))
    return tape.gradient(loss, model.trainable_variables)

  table_ids = {id(v) for v in table}
  rows = []
  for x, y in zip(items, labels):
    g = grads(x[None], y[None])
    total = sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(gi)))) for gi in g)
    table_grads = [tf.convert_to_tensor(gi) for gi, v in zip(g, model.trainable_variables)
                   if id(v) in table_ids]
    item_sq = sum(float(tf.reduce_sum(tf.square(gi))) for gi in table_grads)
    own = np.unique(np.concatenate([x[x > 0], y[y > 0]]))  # tied table: row = item id
    own_sq = float(tf.reduce_sum(tf.square(tf.gather(table_grads[0], own))))
    rows.append((total, item_sq, own_sq))
  return np.array(rows)


def clipped_signal(model, items, labels, clip_factors, batch):
  """S = ∇_E Σ_u c_u·L_u over all users: one pass's clipped signal on the item table [M, d]."""
  table = model.item_embedding.trainable_weights[0]
  loss_fn = model.per_example_loss

  @tf.function
  def grad(x, y, c):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(c * loss_fn(y, model({"items": x}, training=False)))
    return tf.convert_to_tensor(tape.gradient(loss, table))

  total = np.zeros(table.shape, np.float64)
  for i in range(0, len(items), batch):
    total += grad(items[i:i + batch], labels[i:i + batch],
                  clip_factors[i:i + batch].astype(np.float32)).numpy()
  return total


def users_per_item(items, num_items):
  counts = np.zeros(num_items + 1, np.int64)
  for row in items:
    counts[np.unique(row[row > 0])] += 1
  return counts


def report(snr, n_users, buckets, args, sigma, steps):
  width = args.item_rank or args.dim
  lines = [f"σ = {sigma:.3f}, T = {steps} steps, E = {args.epochs:g}, d = {args.dim}, item row "
           f"width {width}, C = 1: noise norm per row σC√(T·width) = "
           f"{sigma * np.sqrt(steps * width):.1f}",
           "", "| users holding the item | items | median SNR | SNR ≥ 1 | SNR ≥ 3 |",
           "|---|---:|---:|---:|---:|"]
  for lo, hi in zip(USER_BINS[:-1], USER_BINS[1:]):
    sel = (n_users >= lo) & (n_users < hi)
    if sel.any():
      label = f"{lo}–{hi - 1}" if hi < 10 ** 9 else f"≥ {lo}"
      lines.append(f"| {label} | {sel.sum()} | {np.median(snr[sel]):.2f} | "
                   f"{(snr[sel] >= 1).sum()} | {(snr[sel] >= 3).sum()} |")
  lines += ["", "| bucket | items | median SNR | SNR ≥ 3 |", "|---|---:|---:|---:|"]
  for b, name in enumerate(ranking_metrics.BUCKETS):
    sel = buckets == b
    lines.append(f"| {name} | {sel.sum()} | {np.median(snr[sel]):.2f} | {(snr[sel] >= 3).sum()} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--data", default=os.path.join(
      os.path.dirname(__file__), "..", "..", "shared", "data", "amazon-video-games", "Video.txt"))
  parser.add_argument("--work-dir", default="/tmp/dprec_amazon")
  parser.add_argument("--epsilon", type=float, default=5.0)
  parser.add_argument("--epochs", type=float, default=100.0)
  parser.add_argument("--batch-size", type=int, default=1024)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--item-rank", type=int, default=None,
                      help="low-rank item table M×R (`train seqrec --item-rank`): rows of width R")
  parser.add_argument("--dropout", type=float, default=0.0,
                      help="model dropout (0: the norms and signal of the expected forward pass)")
  parser.add_argument("--loss-positions", choices=("all", "last"), default="all")
  parser.add_argument("--sample", type=int, default=512, help="users for the brute-force f")
  parser.add_argument("--batch", type=int, default=128, help="users per batch of the passes")
  parser.add_argument("--checkpoint", default=None, help="a train seqrec checkpoint to measure at")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  sys.path.insert(0, os.path.dirname(__file__))
  from dpformer_amazon import preprocess
  tf.keras.utils.set_random_seed(args.seed)
  data = load_sequences(preprocess(args.data, args.work_dir))
  options = SeqRecTrainOptions(model="dpformer", epsilon=args.epsilon, epochs=args.epochs,
                               batch_size=args.batch_size, dim=args.dim, reattention=False,
                               item_rank=args.item_rank,
                               dropout=args.dropout,
                               loss_positions=args.loss_positions, seed=args.seed)
  examples = make_examples(data, options.max_len)
  items, labels = examples.items, examples.labels
  n = len(items)
  steps = int(round(args.epochs * n / args.batch_size))
  sigma = privacy.plan_training(args.epsilon, 1.0 / n, [(args.batch_size / n, steps)]
                                ).noise_multiplier
  model = build(options, examples.num_items, sigma, args.checkpoint)
  start = time.perf_counter()
  squared = per_user_norms(model, items, labels, args.batch)
  sample = np.random.default_rng(args.seed).choice(n, min(args.sample, n), replace=False)
  brute = brute_force_shares(model, items[sample], labels[sample])
  f = brute[:, 1] / brute[:, 0]
  own = brute[:, 2] / brute[:, 1]
  agree = np.max(np.abs(brute[:, 0] - squared[sample]) / brute[:, 0])
  clip = np.minimum(1.0, options.l2_norm_clip / np.sqrt(np.maximum(squared, 1e-30)))
  signal = clipped_signal(model, items, labels, clip, args.batch)
  row_norms = np.linalg.norm(signal, axis=1)[1:]  # row 0: padding
  width = args.item_rank or args.dim  # noise coordinates per item row
  snr = args.epochs * row_norms / (sigma * options.l2_norm_clip * np.sqrt(steps * width))
  n_users = users_per_item(items, examples.num_items)[1:]
  buckets = ranking_metrics.popularity_buckets(examples.item_frequencies)[1:]
  print(f"Amazon Games: N = {n} users, M = {examples.num_items} items, "
        f"{'checkpoint ' + args.checkpoint if args.checkpoint else 'initialisation'}, "
        f"loss positions {args.loss_positions}, {time.perf_counter() - start:.0f} s, "
        f"load average {os.getloadavg()[0]:.1f}")
  print(f"‖g_u‖ over users: median {np.median(np.sqrt(squared)):.3g}, share clipped "
        f"(‖g_u‖ > C) {np.mean(clip < 1):.3f}; brute force vs DP step norms: max rel. diff "
        f"{agree:.1e} on {len(sample)} users")
  print(f"item-table share f = ‖g_E‖²/‖g‖²: mean {f.mean():.3f}, median {np.median(f):.3f}, "
        f"10–90% {np.quantile(f, 0.1):.3f}–{np.quantile(f, 0.9):.3f}; of ‖g_E‖², on the "
        f"user's own item rows: mean {own.mean():.3f}")
  print(report(snr, n_users, buckets, args, sigma, steps))


if __name__ == "__main__":
  main()
