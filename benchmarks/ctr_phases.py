"""Where the DP-AdaFEST pCTR step spends its time, phase by phase, beside the non-private step.

Each phase is a `tf.function` running the step up to that point on the same batch; the cost of
a phase is the difference between consecutive prefixes. All prefixes of both models run
interleaved in one process, `--rounds` times; each time is the median over rounds of the
process's CPU time per call (summed over its threads: other jobs on a shared machine delay a
call's wall time far more than its CPU time; wall times are printed beside, and the load).
Prefixes:

  forward     the forward pass and per-example losses
  norms       + recording, one backward pass to the recorded tensors, distinct (example, row)
              pairs, DP-AdaFEST selection (contribution map, noisy counts, false positives),
              per-example squared norms (`DPModel.per_example_squared_norms`)
  gradients   + clip factors, book-kept clipped sums, noise, normalisation (`dp_gradients`)
  step        + gradient-size metric, apply (SparseSGD), metrics (`train_step`)

The non-private model runs `forward`, `gradients` (one backward pass) and `step`. Also printed:
the number of graph ops of each prefix (a count independent of the load), and with `--executed`
the ops one whole step actually runs after TensorFlow's graph optimisations (counted by the TF
profiler; each costs the executor a dispatch however small it is), and how many of the step's
random draws wait for a gradient (such a draw cannot overlap the backward pass).

    .venv/bin/python benchmarks/ctr_phases.py --vocab table3 scaled:10M --json after.json
    PYTHONPATH=OLD_TREE .venv/bin/python benchmarks/ctr_phases.py ... --json before.json
    .venv/bin/python benchmarks/ctr_phases.py --compare before.json after.json
"""
import argparse
import glob
import json
import os
import tempfile

import tensorflow as tf

import dprec  # noqa: F401  (Keras 2 before TensorFlow binds tf.keras)
from dprec.data import synthetic
from dprec.optimizers import config as config_lib

import ctr_step
import machine

DP_PHASES = ("forward", "norms", "gradients", "step")
NON_PRIVATE_PHASES = ("forward", "gradients", "step")


def _prefixes(model, private):
  """{phase: tf.function(x, y)} running `model`'s step up to the end of that phase."""

  def forward(x, y):
    return tf.reduce_sum(model.per_example_loss(y, model(x, training=True)))

  def gradients(x, y):
    if private:
      pairs = model.dp_gradients(x, y)
    else:
      with tf.GradientTape() as tape:
        loss = model.compute_loss(x, y, model(x, training=True))
      pairs = zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in pairs]

  phases = {"forward": forward, "gradients": gradients,
            "step": lambda x, y: model.train_step((x, y))}
  if private:
    phases["norms"] = lambda x, y: model.per_example_squared_norms(x, y)
  return {name: tf.function(phases[name])
          for name in (DP_PHASES if private else NON_PRIVATE_PHASES)}


def _op_count(function, x, y):
  return len(function.get_concrete_function(x, y).graph.get_operations())


def _batch(spec, batch_size):
  """(vocabulary sizes, features, labels) of one benchmark batch as tensors."""
  vocab_sizes = tuple(v + 1 for v in synthetic.vocab_sizes(spec))
  x, y = ctr_step.make_batches(vocab_sizes, batch_size, 1)[0]
  return vocab_sizes, {k: tf.constant(v) for k, v in x.items()}, tf.constant(y)


def executed_ops(function, x, y):
  """Ops run by one call of `function` (after Grappler), from a TF profiler trace."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, function(x, y))
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0],
              "rb") as file:
      space.ParseFromString(file.read())
  host = next(plane for plane in space.planes if plane.name == "/host:CPU")
  names = (host.event_metadata[event.metadata_id].name
           for line in host.lines if line.name.startswith("tf_Compute") for event in line.events)
  # Op events are named "node:OpType"; the executor's own are "Class::method".
  return sum(1 for name in names if ":" in name and "::" not in name)


def draws_after_gradients(function, x, y):
  """(random draws, those waiting for a gradient op) in `function`'s graph: a draw's inputs and
  control inputs, followed back, reach no op of the gradient tape iff it can run beside the
  backward pass."""
  graph = function.get_concrete_function(x, y).graph
  draws = [op for op in graph.get_operations() if op.type == "RngReadAndSkip"]
  waiting = 0
  for draw in draws:
    seen, stack = set(), [draw]
    while stack:
      op = stack.pop()
      for parent in [t.op for t in op.inputs] + list(op.control_inputs):
        if parent.name not in seen:
          seen.add(parent.name)
          stack.append(parent)
    waiting += any(name.startswith("gradient_tape") for name in seen)
  return len(draws), waiting


def structure(spec, batch_size, threshold):
  """{variant: (executed ops per step, draws, draws waiting for a gradient)}."""
  vocab_sizes, x, y = _batch(spec, batch_size)
  result = {}
  for variant in ("non_private", "dp_adafest"):
    model, _ = ctr_step.build(variant, vocab_sizes, batch_size, threshold)
    step = tf.function(lambda x, y, model=model: model.train_step((x, y)))
    step(x, y)  # trace and warm up
    result[variant] = (executed_ops(step, x, y),) + draws_after_gradients(step, x, y)
  return result


def measure(spec, batch_size, rounds, calls, threshold):
  """{variant: {phase: (median CPU ms, median wall ms, ops)}} for one vocabulary."""
  vocab_sizes, x, y = _batch(spec, batch_size)
  functions, ops = {}, {}
  for variant in ("non_private", "dp_adafest"):
    model, _ = ctr_step.build(variant, vocab_sizes, batch_size, threshold)
    private = config_lib.is_private(model.dp_optimizer.config)
    for phase, function in _prefixes(model, private).items():
      functions[variant, phase] = function
      ops[variant, phase] = _op_count(function, x, y)
      ctr_step.fetch(function(x, y))  # trace and warm up
  times = ctr_step.interleaved_medians(
      {key: (function, [(x, y)]) for key, function in functions.items()}, rounds, calls)
  result = {}
  for (variant, phase), (wall, cpu) in times.items():
    result.setdefault(variant, {})[phase] = (cpu, wall, ops[variant, phase])
  return result


def print_breakdown(spec, result):
  print(f"\n{spec}: median CPU ms per call of each prefix; a phase = its prefix minus the one "
        "before")
  print("| variant | phase | prefix CPU ms | phase CPU ms | share of step | prefix wall ms | "
        "prefix ops |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for variant, phases in result.items():
    previous, total = 0.0, phases["step"][0]
    for phase, (ms, wall_ms, ops) in phases.items():
      print(f"| {variant} | {phase} | {ms:.1f} | {ms - previous:.1f} | "
            f"{(ms - previous) / total:.0%} | {wall_ms:.1f} | {ops:,} |")
      previous = ms
  for column, label in ((0, "CPU"), (1, "wall")):
    ratio = result["dp_adafest"]["step"][column] / result["non_private"]["step"][column]
    print(f"dp_adafest step / non_private step ({label}): {ratio:.2f}x")


def compare(before, after):
  """Before/after CPU ms, ops and the DP / non-private step ratio, per vocabulary and phase."""
  print("| vocabulary | variant | phase | before CPU ms | after CPU ms | after/before | "
        "before ops | after ops |")
  print("|---|---|---|---:|---:|---:|---:|---:|")
  for spec in after:
    for variant, phases in after[spec].items():
      for phase, (ms, _, ops) in phases.items():
        old_ms, _, old_ops = before[spec][variant][phase]
        print(f"| {spec} | {variant} | {phase} | {old_ms:.1f} | {ms:.1f} | {ms / old_ms:.2f} | "
              f"{old_ops:,} | {ops:,} |")
    for label, run in (("before", before), ("after", after)):
      ratio = run[spec]["dp_adafest"]["step"][0] / run[spec]["non_private"]["step"][0]
      print(f"{spec} {label}: dp_adafest / non_private step {ratio:.2f}x (CPU)")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--vocab", nargs="+", default=["table3", "scaled:10M"],
                      help="vocabularies: table3 and/or scaled:M (default: %(default)s)")
  parser.add_argument("--batch-size", type=int, default=2048, help="default: %(default)s")
  parser.add_argument("--rounds", type=int, default=7,
                      help="interleaved rounds; times are medians over them (default: %(default)s)")
  parser.add_argument("--calls", type=int, default=3,
                      help="calls of each prefix per round (default: %(default)s)")
  parser.add_argument("--threshold", type=float, default=25.0,
                      help="DP-AdaFEST τ (default: %(default)s)")
  parser.add_argument("--json", help="write the results here (for --compare)")
  parser.add_argument("--executed", action="store_true",
                      help="instead of timing: ops one step runs, and draws waiting for a "
                           "gradient")
  parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                      help="print before/after of two --json files instead of measuring")
  args = parser.parse_args(argv)
  if args.compare:
    runs = []
    for path in args.compare:
      with open(path, encoding="utf-8") as file:
        runs.append(json.load(file))
    compare(*runs)
    return
  if args.executed:
    print("| vocabulary | variant | ops run per step | random draws | draws after a gradient |")
    print("|---|---|---:|---:|---:|")
    for spec in args.vocab:
      for variant, (ops, draws, waiting) in structure(spec, args.batch_size,
                                                      args.threshold).items():
        print(f"| {spec} | {variant} | {ops:,} | {draws} | {waiting} |", flush=True)
    return
  print(f"# {machine.describe()}")
  results = {}
  for spec in args.vocab:
    results[spec] = measure(spec, args.batch_size, args.rounds, args.calls, args.threshold)
    print_breakdown(spec, results[spec])
  print(f"# {machine.describe()}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as out:
      json.dump(results, out, indent=2)


if __name__ == "__main__":
  main()
