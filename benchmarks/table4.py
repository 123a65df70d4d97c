"""Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357, Table 4: wall-clock of DP-SGD vs DP-AdaFEST training an embedding table.

Protocol of App. D.2.1: embedding dimension 64, batch size 1,024, 100 steps, vocabulary sizes
1e5, 1e6, 1e7; here through the full `DPModel` step (one DPEmbedding, a logit head, BCE loss,
SparseSGD), with Zipf-distributed ids. Every algorithm runs side by side in this process on the
same batches. Dense DP-SGD may run fewer steps at large vocabularies (`--dense-steps`); the
table reports seconds per 100 steps, extrapolated from the measured per-step time.

    .venv/bin/python benchmarks/table4.py [--vocab 1e5 1e6 1e7] [--steps 100] [--dense-steps 5]
        [--optimizer sgd|adambc]

`--optimizer adambc` applies every algorithm's noisy gradient with DP-AdamBC (row-sparse, with a
per-row noise-variance EMA) instead of SparseSGD: its step must stay flat in the vocabulary too.
"""
import argparse
import gc
import json
import time

import numpy as np
import tensorflow as tf
from tqdm import tqdm

import machine

from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import AdamBC, DPAdaFEST, DPSGD, DPOptimizer, NonPrivate, SparseSGD

DIM, BATCH = 64, 1024


def make_model(vocab):
  ids = tf.keras.Input((), dtype=tf.int64)
  h = DPEmbedding(vocab, DIM, embeddings_initializer="zeros", name="table")(ids)
  return DPModel(ids, tf.keras.layers.Dense(1)(h))


def make_batches(vocab, count, seed=0):
  """Zipf(1.2) ids folded into the vocabulary, random labels; reused by every algorithm."""
  rng = np.random.default_rng(seed)
  ids = (rng.zipf(1.2, (count, BATCH)) - 1) % vocab
  labels = rng.integers(0, 2, (count, BATCH, 1)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((ids, labels))


INNER = {"sgd": lambda: SparseSGD(0.1), "adambc": lambda: AdamBC(1e-3)}


def time_steps(config, vocab, batches, steps, optimizer="sgd"):
  """Seconds per step of `steps` steps after two warm-up steps (tracing excluded)."""
  model = make_model(vocab)
  model.compile(DPOptimizer(config, INNER[optimizer](), expected_batch_size=BATCH),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  model.fit(batches.take(2), epochs=1, verbose=0)
  start = time.perf_counter()
  history = model.fit(batches.take(steps), epochs=1, verbose=0)
  per_step = (time.perf_counter() - start) / steps
  del model
  tf.keras.backend.clear_session()
  gc.collect()  # free the V×d table before the next algorithm builds its own
  return per_step, history.history["gradient_size"][-1]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--vocab", type=float, nargs="+", default=[1e5, 1e6, 1e7])
  parser.add_argument("--steps", type=int, default=100, help="steps for sparse algorithms")
  parser.add_argument("--dense-steps", type=int, default=5,
                      help="steps for DP-SGD at vocabularies >= 1e6 (100 below)")
  parser.add_argument("--optimizer", choices=sorted(INNER), default="sgd",
                      help="inner optimizer applying the noisy gradient")
  parser.add_argument("--json", help="also write the rows to this JSON file")
  parser.add_argument("--skip-dense-above", type=float, default=float("inf"),
                      help="skip DP-SGD above this vocabulary (its V×d noise needs ~3 V×d×4 "
                           "bytes of memory on top of the table)")
  args = parser.parse_args(argv)
  algorithms = {
      "non_private": NonPrivate(),
      # σ1 = 5·σ2, τ = 20 (Ghazi et al. 2023, App. D.1 grids): Ψ(20/5) ≈ 3e-5 false-positive rate.
      "dp_adafest": DPAdaFEST(l2_norm_clip=1.0, noise_multiplier=1.0, contribution_clip=1.0,
                              contribution_noise_multiplier=5.0, threshold=20.0),
      "dp_sgd": DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),  # last: the most memory
  }
  header = ("| Vocabulary | DP-SGD s/100 steps | DP-AdaFEST s/100 steps | Non-private s/100 steps "
            "| Speed-up | AdaFEST vs smallest V | AdaFEST grad. size |\n"
            "|---|---|---|---|---|---|---|")
  tqdm.write(f"# {machine.describe()}")
  tqdm.write(header)
  rows = []
  for vocab in tqdm([int(v) for v in args.vocab], desc="vocabularies"):
    batches = make_batches(vocab, args.steps + 2)
    row = {"vocab": vocab}
    for name, config in algorithms.items():
      if name == "dp_sgd" and vocab > args.skip_dense_above:
        row[name] = {"seconds_per_100_steps": float("nan"), "steps_timed": 0,
                     "gradient_size": vocab * DIM}
        continue
      steps = args.steps if name != "dp_sgd" or vocab < 1e6 else args.dense_steps
      per_step, size = time_steps(config, vocab, batches, steps, args.optimizer)
      row[name] = {"seconds_per_100_steps": 100 * per_step, "steps_timed": steps,
                   "gradient_size": size}
    row["speedup"] = row["dp_sgd"]["seconds_per_100_steps"] / row["dp_adafest"][
        "seconds_per_100_steps"]
    rows.append(row)
    base = rows[0]["dp_adafest"]["seconds_per_100_steps"]
    tqdm.write(f"| {vocab:.0e} | {row['dp_sgd']['seconds_per_100_steps']:.2f} "
               f"({row['dp_sgd']['steps_timed']} steps) "
               f"| {row['dp_adafest']['seconds_per_100_steps']:.3f} "
               f"| {row['non_private']['seconds_per_100_steps']:.3f} | {row['speedup']:.0f}× "
               f"| {row['dp_adafest']['seconds_per_100_steps'] / base:.2f}× "
               f"| {row['dp_adafest']['gradient_size']:.0f} |")
  tqdm.write(f"# {machine.describe()}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
