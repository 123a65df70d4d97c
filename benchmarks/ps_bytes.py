"""Bytes on the network per DP step with the embedding table sharded over parameter servers
(`--strategy parameter_server`, `dprec.distribute.parameter_server`): DP-SGD (every row noised
and pushed) vs DP-AdaFEST (kept rows only).

An in-process cluster (2 workers, 2 parameter servers, this process the chief) talks gRPC over
the loopback interface; the script reads its transmit counter (/sys/class/net/lo/statistics/
tx_bytes) around `--steps` scheduled steps of each algorithm (after 2 untimed steps that trace)
and subtracts an idle baseline of the same duration (other processes on the machine use
loopback too). Loopback carries everything the cluster sends: the chief's batches and step
calls to the workers, the workers' row lookups, their noisy updates returned to the chief, and
the chief's apply of each update on the servers (`parameter_server.fit`: workers apply nothing);
the difference between the algorithms is the table update, which crosses loopback twice
(worker → chief → servers). Printed beside each: the
payload of the table update, rows pushed × (4·d + 8) bytes (values and int64 row ids; a dense
push: V·4d), from the step's gradient-size metric.

    .venv/bin/python benchmarks/ps_bytes.py --rows 200000 --dim 16 --steps 10
"""
import argparse
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import tensorflow as tf

from dprec.distribute import parameter_server
from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPAdaFEST, DPSGD, DPOptimizer, SparseSGD
from dprec.privacy.noise_key import NoiseKey
from dprec.training import poisson

LOOPBACK = "/sys/class/net/lo/statistics/tx_bytes"


def loopback_bytes() -> int:
  with open(LOOPBACK, encoding="ascii") as f:
    return int(f.read())


def configs(threshold):
  return {"dp_sgd": DPSGD(1.0, 1.0),
          "dp_adafest": DPAdaFEST(1.0, 1.0, contribution_clip=1.0,
                                  contribution_noise_multiplier=1.0, threshold=threshold)}


def build(config, rows, dim, batch, key):
  ids = tf.keras.Input((), dtype=tf.int64, name="ids")
  hidden = tf.keras.layers.Dense(8, activation="tanh")(DPEmbedding(rows, dim, name="table")(ids))
  model = DPModel(ids, tf.keras.layers.Dense(1)(hidden))
  model.compile(DPOptimizer(config, SparseSGD(0.1), expected_batch_size=batch, noise_key=key),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  model.optimizer.build(model.trainable_variables)
  return model


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--rows", type=int, default=200_000, help="table rows V")
  parser.add_argument("--dim", type=int, default=16, help="embedding dimension d")
  parser.add_argument("--batch", type=int, default=256, help="expected (Poisson) batch size B")
  parser.add_argument("--examples", type=int, default=20_000, help="training examples N")
  parser.add_argument("--steps", type=int, default=10, help="measured steps per algorithm")
  parser.add_argument("--threshold", type=float, default=5.0, help="DP-AdaFEST τ (σ1·C1 = 1)")
  args = parser.parse_args()

  strategy, coordinator = parameter_server.make_strategy(
      parameter_server.in_process_cluster(2, 2), min_rows=1024)
  rng = np.random.default_rng(0)
  features = {"ids": np.minimum(rng.zipf(1.3, args.examples) - 1, args.rows - 1)}
  labels = rng.integers(0, 2, (args.examples, 1)).astype(np.float32)
  key = NoiseKey.fresh()
  print(f"V = {args.rows:,} rows × d = {args.dim} over 2 parameter servers, 2 workers, "
        f"B = {args.batch}, N = {args.examples:,}, {args.steps} steps after 2 untimed")
  print("| algorithm | loopback bytes / step (idle subtracted) | idle bytes / step | "
        "rows pushed / step | table-update payload / step |")
  print("|---|---:|---:|---:|---:|")
  for index, (name, config) in enumerate(configs(args.threshold).items()):
    with strategy.scope():
      model = build(config, args.rows, args.dim, args.batch, key)
    sampling = poisson.BatchSampling(args.batch, entropy=key.entropy("poisson", index))
    batches = list(poisson.sampled_dataset(features, labels, sampling, args.steps + 2))
    states = [key.tf_state("dp step", t) for t in range(args.steps + 2)]
    parameter_server.fit(model, coordinator, batches[:2], states[:2], 2)
    start, began = loopback_bytes(), time.perf_counter()
    logs = parameter_server.fit(model, coordinator, batches[2:], states[2:], args.steps)
    sent, seconds = loopback_bytes() - start, time.perf_counter() - began
    idle_start = loopback_bytes()
    time.sleep(seconds)
    idle = loopback_bytes() - idle_start
    rows = logs["gradient_size"][0] / args.dim
    print(f"| {name} | {(sent - idle) / args.steps:,.0f} | {idle / args.steps:,.0f} | "
          f"{rows:,.0f} | {rows * (4 * args.dim + (8 if name != 'dp_sgd' else 0)):,.0f} |")


if __name__ == "__main__":
  main()
