"""Step time on parameter servers with each step's update applied once by the chief
(`dprec.distribute.parameter_server.fit`), against workers applying their own updates (the
Hogwild step dprec ran before, which a worker lost mid-update could apply twice).

An in-process cluster (2 workers, 2 parameter servers, this process the chief; gRPC over
loopback) trains the Criteo model at Table 3 vocabularies (26 tables, 338,782 rows, d = 16,
SGD) with DP-AdaFEST and DP-SGD. Each variant runs `--steps` steps per round after one untimed
round that traces, the variants alternating over `--rounds` rounds so a shared machine's load
hits both alike; printed: median ms per step and the ratio chief-applies ÷ workers-apply.

    .venv/bin/python benchmarks/ps_step.py --steps 20 --rounds 5
"""
import argparse
import collections
import statistics
import time

import dprec  # noqa: F401  (Keras 2 before TensorFlow binds tf.keras)
import tensorflow as tf

from dprec.data.criteo import TABLE3_VOCAB_SIZES
from dprec.distribute import parameter_server
from dprec.models import ctr
from dprec.optimizers import DPAdaFEST, DPSGD, DPOptimizer, SparseSGD
from dprec.privacy.noise_key import NoiseKey

import ctr_step
import machine

CONFIGS = {"dp_adafest": DPAdaFEST(1.0, 1.0, contribution_clip=1.0,
                                   contribution_noise_multiplier=2.0, threshold=7.0),
           "dp_sgd": DPSGD(1.0, 1.0)}


def build(config, batch, key):
  model = ctr.build_ctr_model(TABLE3_VOCAB_SIZES)
  model.compile(optimizer=DPOptimizer(config, SparseSGD(0.1), expected_batch_size=batch,
                                      noise_key=key))
  model.optimizer.build(model.trainable_variables)
  return model


def workers_apply(model, coordinator, batches, states):
  """The earlier scheduling: each worker runs the whole step, its update included, with as
  many steps in flight as workers."""
  generator = model.dp_optimizer.generator

  @tf.function(reduce_retracing=True)
  def step(x, y, state):
    generator.reset(state)
    return model.distribute_strategy.run(model.train_step, args=((x, y),))

  window, in_flight = parameter_server.num_workers(coordinator.strategy), collections.deque()
  for (x, y), state in zip(batches, states):
    in_flight.append(coordinator.schedule(step, args=(x, y, tf.constant(state))))
    while len(in_flight) > window:
      in_flight.popleft().fetch()
  coordinator.join()


def chief_applies(model, coordinator, batches, states):
  parameter_server.fit(model, coordinator, batches, states, len(batches))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--batch", type=int, default=1024, help="batch size B")
  parser.add_argument("--steps", type=int, default=20, help="steps per round and variant")
  parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
  args = parser.parse_args()
  strategy, coordinator = parameter_server.make_strategy(
      parameter_server.in_process_cluster(2, 2))
  key = NoiseKey.fresh()
  batches = ctr_step.make_batches(TABLE3_VOCAB_SIZES, args.batch, args.steps)
  states = [key.tf_state("dp step", t) for t in range(args.steps)]
  variants = {"workers apply": workers_apply, "chief applies": chief_applies}
  print(f"Table 3 ({sum(TABLE3_VOCAB_SIZES):,} rows × 16) over 2 parameter servers, 2 workers, "
        f"B = {args.batch}, {args.steps} steps × {args.rounds} rounds; {machine.describe()}")
  print("| algorithm | workers apply, ms/step | chief applies, ms/step | ratio |")
  print("|---|---:|---:|---:|")
  for name, config in CONFIGS.items():
    models = {}
    for variant in variants:
      with strategy.scope():
        models[variant] = build(config, args.batch, key)
    times = {variant: [] for variant in variants}
    for round_index in range(args.rounds + 1):
      for variant, run in variants.items():
        start = time.perf_counter()
        run(models[variant], coordinator, batches, states)
        if round_index:  # the first round traces
          times[variant].append(1000 * (time.perf_counter() - start) / args.steps)
    before, after = (statistics.median(times[v]) for v in variants)
    print(f"| {name} | {before:.1f} | {after:.1f} | {after / before:.2f} |")


if __name__ == "__main__":
  main()
