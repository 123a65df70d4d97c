"""Steps/s of `train ctr`'s model trained from the out-of-core shards against the in-memory Poisson
sampler, side by side in one process on the same rows, model and plan (the batch job
has the shape of Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS 2024).

The TSV `day_N` files of --data (`dprec synth criteo --rows 4000000 --days 2`: day_0 trains) are
preprocessed and the run's Poisson batches written as `train ctr --out-of-core` does
(`dprec.workflows.out_of_core`, embedded runner); the in-memory path holds the same training rows
as arrays and draws its batches with the in-memory sampler at the same q = B/N. One model trains
in rounds of --round-steps steps from each source, the order swapped every round, each timed as
`model.fit`'s wall time; the first round of each is warm-up (tracing, first reads). Prints steps/s
of both, their ratio per round and the median ratio, and the load average. The shards were just
written, so they are read from the page cache: this times parsing and checking them, not a disk.
Nothing trained here is released (no ledger).

    nice -n 10 .venv/bin/python benchmarks/out_of_core_steps.py --data DIR
"""
import argparse
import statistics
import time

import numpy as np

import dprec  # noqa: F401  (Keras 2 before TensorFlow binds tf.keras)
from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
from dprec.training import batch_shards
from dprec.training import poisson
from dprec.workflows import ctr
from dprec.workflows import out_of_core
from dprec.workflows import run as run_lib

import machine


def in_memory_rows(data):
  """(features, labels): the training rows as arrays, with the shards' dtypes
  (`batch_shards.parse_rows`), read in one pass."""
  cats, ints, labels = [], [], []
  for batch in data.train_dataset().as_numpy_iterator():
    cats.append(batch["cat_features"].astype(np.int32))
    ints.append(batch["int_features"])
    labels.append(batch["label"][:, 0].astype(np.int32))
  return ({"cat_features": np.concatenate(cats), "int_features": np.concatenate(ints)},
          np.concatenate(labels))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", required=True, help="TSV day_N files (the last is held out)")
  parser.add_argument("--batch-size", type=int, default=16384,
                      help="B (train ctr's data-sized default at 4M rows)")
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
  parser.add_argument("--round-steps", type=int, default=10)
  args = parser.parse_args(argv)
  steps = (args.rounds + 1) * args.round_steps
  print(machine.describe())
  with out_of_core.workspace(None) as base, run_lib.Run(ctr.COMMAND) as run:
    start = time.perf_counter()
    data = out_of_core.prepare(args.data, base, 1, [])
    options = ctr.CTRTrainOptions(data=args.data, epsilon=1.0, batch_size=args.batch_size,
                                  steps=steps, progress=False, out_of_core=True)
    plan = ctr.plan_privacy(options, data.train_rows)
    directory, manifest, _ = out_of_core.write_batches(data, base, run, args.batch_size, steps, [])
    print(f"{data.train_rows:,} training rows, B = {args.batch_size:,}, {steps} steps of shards "
          f"written in {time.perf_counter() - start:.0f} s")
    features, labels = in_memory_rows(data)
    sampling = poisson.BatchSampling(args.batch_size, True, run.key.entropy("poisson"))
    sources = {
        "streamed": lambda first, stop: batch_shards.batch_dataset(directory, manifest, first,
                                                                    stop),
        "in memory": lambda first, stop: poisson.sampled_dataset(features, labels, sampling,
                                                                 stop, first)}
    model, _ = ctr.build_model(options, data, plan, run)
    _, callbacks = run.trainer.callbacks({NOISE_PURPOSE: model.dp_optimizer.generator},
                                       run.checkpoints.resume(model, options))
    rates = {name: [] for name in sources}
    for round_index in range(args.rounds + 1):
      first = round_index * args.round_steps
      order = list(sources)[::1 if round_index % 2 else -1]
      for name in order:
        dataset = sources[name](first, first + args.round_steps)
        began = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=args.round_steps, callbacks=callbacks,
                  verbose=0)
        rates[name].append(args.round_steps / (time.perf_counter() - began))
      print(f"round {round_index}{' (warm-up)' if not round_index else ''}: " + ", ".join(
          f"{name} {rates[name][-1]:.3f} steps/s" for name in order) + f"; {machine.describe()}")
  ratios = [s / m for s, m in zip(rates["streamed"][1:], rates["in memory"][1:])]
  print("\n| source | steps/s (median of rounds) |\n|---|---:|")
  for name, values in rates.items():
    print(f"| {name} | {statistics.median(values[1:]):.3f} |")
  print(f"\nstreamed ÷ in memory per round: {', '.join(f'{r:.3f}' for r in ratios)}; median "
        f"{statistics.median(ratios):.3f}\n{machine.describe()}")


if __name__ == "__main__":
  main()
