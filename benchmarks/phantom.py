"""Phantom Clipping vs brute-force per-example gradients vs non-private training (paper Fig. 3).

    python benchmarks/phantom.py [--items 10000 100000 1000000] [--batch-size 256] [--max-len 50]

For each vocabulary size M and variant, a fresh worker process builds the DPFormer model
(d = 64, 2 blocks, 1 head, tied embedding), runs one warm-up step and `--steps` timed steps, and
reports wall and CPU seconds per step (CPU time, summed over threads, is less sensitive to other
jobs on a shared machine) and its peak resident memory (ru_maxrss). Variants:
  non_private   the ordinary Keras step (`DPModel` with `NonPrivate`);
  phantom       the DP step (`DPModel` + DPSGD): registry ghost norms + Phantom norms of the tied
                embedding, clipped sum book-kept from the norm pass, noise;
  brute_force   per-example gradients by `tf.vectorized_map` over one-example backward
                passes, their norms, clipping, sum and noise.
Next-item loss at every position for M ≤ `--all-positions-max` and at the last position above it
(the B×L×M logits alone would not fit). With the all-positions loss, non_private and phantom run in
two layouts: all L positions scored (fixed shapes, as brute force needs) and, as `*_packed`, only
the positions with a target (the default of `SeqRecConfig` and `dprec train seqrec`). Brute force
is skipped above `--brute-force-max`.
The table gives each variant's time and memory, their ratios to the non-private run of the same M
and layout, and the extra peak memory over it (MB).
"""
import argparse
import json
import resource
import subprocess
import sys
import time

# Variant suffix: score only positions with a target (the default layout, ragged logits)
# instead of all L positions; ratios of these rows are to "non_private_packed".
PACKED = "_packed"


def worker(args):
  import numpy as np
  import tensorflow as tf
  from dprec.models.seqrec import NextItemLoss, SeqRecConfig, SeqRecModel
  from dprec.optimizers.config import DPSGD
  from dprec.optimizers.dp_optimizer import DPOptimizer

  tf.keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  # Zipf-like item ids, left padding of random length.
  items = np.minimum(rng.zipf(1.2, size=(args.batch_size, args.max_len + 1)), args.num_items)
  lengths = rng.integers(2, args.max_len + 1, size=args.batch_size)
  items[np.arange(args.max_len + 1)[None, :] < (args.max_len + 1 - lengths)[:, None]] = 0
  inputs, labels = items[:, :-1].astype(np.int32), items[:, 1:].astype(np.int32)
  config = SeqRecConfig(num_items=args.num_items, max_len=args.max_len, dim=64, num_blocks=2,
                        num_heads=1, ffn_dim=64, dropout=0.0, loss_positions=args.loss_positions,
                        score_padding=not args.variant.endswith(PACKED))
  model = SeqRecModel(config)
  model({"items": inputs[:1]})
  batch = ({"items": tf.constant(inputs)}, tf.constant(labels))
  if args.variant == "brute_force":  # fixed shapes only: tf.vectorized_map needs them
    brute_force = _brute_force_step(model, NextItemLoss(reduction="none"), args.batch_size)
    run = lambda: float(brute_force(*batch))
  else:
    optimizer = tf.keras.optimizers.SGD(1e-3)
    if args.variant.startswith("phantom"):
      optimizer = DPOptimizer(DPSGD(1.0, 1.0), optimizer, expected_batch_size=args.batch_size)
    model.compile(optimizer=optimizer)
    run = lambda: model.train_on_batch(*batch)
  run()
  start, cpu_start = time.perf_counter(), time.process_time()
  for _ in range(args.steps):
    run()
  seconds = (time.perf_counter() - start) / args.steps
  cpu_seconds = (time.process_time() - cpu_start) / args.steps
  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(json.dumps({"seconds_per_step": seconds, "cpu_seconds_per_step": cpu_seconds,
                    "peak_rss_mb": peak_mb}))


def _brute_force_step(model, loss_fn, batch_size):
  """One DP-SGD step from materialised per-example gradients (clip 1, σ = 1, SGD): each
  example's forward and backward pass vectorised over the batch by `tf.vectorized_map`."""
  import tensorflow as tf
  variables = model.trainable_variables

  def example_gradients(example):
    items, labels = example
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(labels[None], model({"items": items[None]}, training=True)))
    return [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

  @tf.function
  def step(x, y):
    grads = tf.vectorized_map(example_gradients, (x["items"], y))
    squared = tf.add_n([tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank)))
                        for g in grads])
    factors = 1.0 / tf.maximum(1.0, tf.sqrt(squared))
    for var, grad in zip(variables, grads):
      clipped = tf.tensordot(factors, grad, axes=1)
      noisy = clipped + tf.random.normal(tf.shape(clipped))
      var.assign_sub(1e-3 * noisy / batch_size)
    return tf.reduce_sum(squared)

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--items", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--max-len", type=int, default=50)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--all-positions-max", type=int, default=100_000)
  parser.add_argument("--brute-force-max", type=int, default=100_000)
  parser.add_argument("--variants", nargs="*", help="run only these variants (default: all)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--num-items", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--loss-positions", default="all", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args)
    return
  rows = []
  for num_items in args.items:
    positions = "all" if num_items <= args.all_positions_max else "last"
    variants = ["non_private", "phantom"]
    if num_items <= args.brute_force_max:
      variants.append("brute_force")
    if positions == "all":
      variants += ["non_private" + PACKED, "phantom" + PACKED]
    variants = [v for v in variants if not args.variants or v in args.variants]
    results = {}
    for variant in variants:
      command = [sys.executable, __file__, "--worker", "--variant", variant,
                 "--num-items", str(num_items), "--loss-positions", positions,
                 "--batch-size", str(args.batch_size), "--max-len", str(args.max_len),
                 "--steps", str(args.steps)]
      done = subprocess.run(command, capture_output=True, text=True, check=False)
      lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
      results[variant] = json.loads(lines[-1]) if lines else {"error": done.stderr[-300:]}
      print(num_items, variant, results[variant], file=sys.stderr, flush=True)
    rows.append((num_items, positions, results))
  print(table(rows, args))


def table(rows, args):
  base = "non_private"
  lines = [f"B={args.batch_size} L={args.max_len} d=64 2 blocks, {args.steps} timed steps", "",
           "| M | loss | variant | s/step | × non-private | CPU s/step | × non-private "
           "| peak RSS MB | × non-private | extra MB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for num_items, positions, results in rows:
    for variant, result in results.items():
      if "error" in result:
        lines.append(f"| {num_items:,} | {positions} | {variant} | failed (OOM?) | | | | | | |")
        continue
      ref = results.get(base + PACKED if variant.endswith(PACKED) else base, {})
      nan = float("nan")
      time_ratio = result["seconds_per_step"] / ref.get("seconds_per_step", nan)
      cpu_ratio = result["cpu_seconds_per_step"] / ref.get("cpu_seconds_per_step", nan)
      mem_ratio = result["peak_rss_mb"] / ref.get("peak_rss_mb", nan)
      extra_mb = result["peak_rss_mb"] - ref.get("peak_rss_mb", nan)
      lines.append(f"| {num_items:,} | {positions} | {variant} | "
                   f"{result['seconds_per_step']:.3f} | "
                   f"{time_ratio:.2f} | {result['cpu_seconds_per_step']:.3f} | {cpu_ratio:.2f} | "
                   f"{result['peak_rss_mb']:.0f} | {mem_ratio:.2f} | "
                   f"{extra_mb:+.0f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
