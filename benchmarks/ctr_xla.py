"""What XLA (`jit_compile`) could gain in the pCTR step: the dense tower's share of the step,
compiled and not.

The full step (`ctr_step.build`: embeddings + tower) cannot be compiled: its distinct pairs
(`tf.unique`), kept rows (`boolean_mask`) and false positives (`tf.while_loop` over a
`TensorArray`) have data-dependent shapes. Its dense part can: the same tower (4×Dense(598) and
the logit, on the full model's [B, Σd + 13] input computed once from the batch) as a `DPModel` of
its own, whose DP step is the dense half of the DP-AdaFEST step (forward/backward, ghost norms,
book-kept clipped GEMMs, dense noise σ2·C2 on its 1.3M parameters; DP-SGD with no tables is
exactly that) and whose non-private step is the tower's forward/backward and update. Variants
(every one a `tf.function` of `train_step`, traced first, run in turn, `--rounds` rounds of
`--calls` calls; medians of wall and process CPU ms per step):

  full_non_private, full_dp_adafest     the whole step (as `ctr_step.py`)
  tower_non_private, tower_dp           the tower alone, uncompiled
  tower_non_private_xla, tower_dp_xla   the tower alone, `tf.function(jit_compile=True)`

So the embedding half of each step is about full − tower, and XLA's gain on the dense half is
tower − tower_xla (`--kernels`: the tower's GEMMs, ghost norms and dense noise alone). Also
printed: the first call (trace + compile) of each variant, and of the
compiled DP tower at each `--buckets` batch size (a Poisson batch padded to a few sizes compiles
once per size).

    /work/helpers/quiet-run .venv/bin/python benchmarks/ctr_xla.py --vocab table3
"""
import argparse
import time

import tensorflow as tf

import dprec  # noqa: F401  (Keras 2 before TensorFlow binds tf.keras)
from dprec.data import synthetic
from dprec.models import ctr
from dprec.models.dp_model import DPModel
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import SparseSGD
from dprec.sparse import gaussian

import ctr_step
import machine


def tower_model(width, private, batch_size):
  """The pCTR tower (App. D.1.1) on a [B, width] input, with the full model's loss and AUC."""
  config = ctr.CTRConfig(vocab_sizes=(2,))
  inputs = tf.keras.Input((width,))
  activations = inputs
  for units in config.hidden_units:
    activations = tf.keras.layers.Dense(units, activation="relu")(activations)
  model = DPModel(inputs, tf.keras.layers.Dense(1)(activations))
  algorithm = (config_lib.DPSGD(l2_norm_clip=ctr_step.C2, noise_multiplier=ctr_step.SIGMA2)
               if private else config_lib.NonPrivate())
  model.compile(optimizer=DPOptimizer(algorithm, SparseSGD(ctr_step.LEARNING_RATE),
                                      expected_batch_size=batch_size),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
                metrics=[tf.keras.metrics.AUC(num_thresholds=config.auc_thresholds,
                                              from_logits=True)])
  model.optimizer.build(model.trainable_variables)
  return model


def _step(model, jit_compile=False):
  return tf.function(lambda x, y: model.train_step((x, y)), jit_compile=jit_compile)


def _first_call_seconds(function, inputs):
  start = time.perf_counter()
  ctr_step.fetch(function(*inputs))
  return time.perf_counter() - start


def measure(spec, batch_size, rounds, calls, threshold, buckets):
  """({variant: (median wall ms, median CPU ms)}, {variant: first call s},
  {bucket: first call s})."""
  vocab_sizes = tuple(v + 1 for v in synthetic.vocab_sizes(spec))
  batches = ctr_step.make_batches(vocab_sizes, batch_size, 4)
  full_inputs = [(tf.nest.map_structure(tf.constant, x), tf.constant(y)) for x, y in batches]
  steps, first = {}, {}
  for variant in ("non_private", "dp_adafest"):
    model, _ = ctr_step.build(variant, vocab_sizes, batch_size, threshold)
    steps["full_" + variant] = (_step(model), full_inputs)
  embed = ctr.build_ctr_model(vocab_sizes).embedding
  tower_inputs = [(tf.concat([embed(x[ctr.CAT_FEATURES]), x[ctr.INT_FEATURES]], axis=1), y)
                  for x, y in full_inputs]
  width = tower_inputs[0][0].shape[1]
  for private, name in ((False, "tower_non_private"), (True, "tower_dp")):
    steps[name] = (_step(tower_model(width, private, batch_size)), tower_inputs)
    steps[name + "_xla"] = (_step(tower_model(width, private, batch_size), jit_compile=True),
                            tower_inputs)
  for variant, (function, inputs) in steps.items():
    first[variant] = _first_call_seconds(function, inputs[0])
  times = ctr_step.interleaved_medians(steps, rounds, calls)
  compiled = steps["tower_dp_xla"][0]
  per_bucket = {}
  for size in buckets:
    x = tf.tile(tower_inputs[0][0], [-(-size // batch_size), 1])[:size]
    y = tf.tile(tower_inputs[0][1], [-(-size // batch_size)])[:size]
    per_bucket[size] = _first_call_seconds(compiled, (x, y))
  return times, first, per_bucket


def _gemms(activations, weights, gradients):
  """The tower's 15 GEMMs at its shape: forward, backward and weight gradient of 5 layers."""
  products = []
  for _ in range(5):
    products += [tf.matmul(activations, weights),
                 tf.matmul(gradients, weights, transpose_b=True),
                 tf.matmul(activations, gradients, transpose_a=True)]
  return [tf.reduce_sum(p) for p in products]


def _ghost_norms(activations, gradients):
  """5 Dense layers' per-example squared norms ‖a_i‖²·‖g_i‖² + ‖g_i‖², clip factors and the
  c-weighted output gradients with their bias sums (the DP step's elementwise dense work)."""
  squared = tf.zeros([activations.shape[0]])
  for _ in range(5):
    row = tf.reduce_sum(tf.square(gradients), 1)
    squared += tf.reduce_sum(tf.square(activations), 1) * row + row
  factors = tf.minimum(1.0, ctr_step.C2 / tf.sqrt(squared + 1e-12))[:, tf.newaxis]
  return [tf.reduce_sum(gradients * factors, 0) for _ in range(5)] + [gradients * factors]


def kernels(batch_size, rounds, calls, units=598, noised=1_300_000):
  """{(kernel, compiled): median CPU ms per call} of `_gemms`, `_ghost_norms` and the dense
  noise (`noised` N(0, 1) values from a Philox generator, as the DP step draws them)."""
  activations, gradients = (tf.random.normal([batch_size, units]) for _ in range(2))
  weights = tf.random.normal([units, units])
  generator = tf.random.Generator.from_seed(0, alg="philox")
  functions = {(name, jit): (tf.function(fn, jit_compile=jit), [args])
               for name, fn, args in (("15 GEMMs", _gemms, (activations, weights, gradients)),
                                      ("ghost norms", _ghost_norms, (activations, gradients)),
                                      ("dense noise", lambda: gaussian.normal(generator, [noised]),
                                       ()))
               for jit in (False, True)}
  for function, (args,) in functions.values():
    ctr_step.fetch(function(*args))  # trace and compile
  return {key: cpu for key, (_, cpu) in
          ctr_step.interleaved_medians(functions, rounds, calls).items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--vocab", nargs="+", default=["table3"],
                      help="vocabularies: table3 and/or scaled:M (default: %(default)s)")
  parser.add_argument("--batch-size", type=int, default=2048, help="default: %(default)s")
  parser.add_argument("--rounds", type=int, default=7, help="default: %(default)s")
  parser.add_argument("--calls", type=int, default=3, help="default: %(default)s")
  parser.add_argument("--threshold", type=float, default=25.0,
                      help="DP-AdaFEST τ (default: %(default)s)")
  parser.add_argument("--buckets", type=int, nargs="*", default=[1920, 2176],
                      help="batch sizes at which to time the compiled DP tower's first call "
                           "(default: %(default)s)")
  parser.add_argument("--kernels", action="store_true",
                      help="instead: the tower's GEMMs, ghost norms and dense noise alone, "
                           "compiled and not")
  args = parser.parse_args(argv)
  print(f"# {machine.describe()}")
  if args.kernels:
    print("| kernel | TensorFlow CPU ms | XLA CPU ms |\n|---|---:|---:|")
    times = kernels(args.batch_size, args.rounds, args.calls)
    for name in ("15 GEMMs", "ghost norms", "dense noise"):
      print(f"| {name} | {times[name, False]:.1f} | {times[name, True]:.1f} |")
    print(f"# {machine.describe()}")
    return
  print("| vocabulary | variant | wall ms/step | CPU ms/step | first call s |")
  print("|---|---|---:|---:|---:|")
  for spec in args.vocab:
    times, first, per_bucket = measure(spec, args.batch_size, args.rounds, args.calls,
                                       args.threshold, args.buckets)
    for variant, (wall_ms, cpu_ms) in times.items():
      print(f"| {spec} | {variant} | {wall_ms:.1f} | {cpu_ms:.1f} | {first[variant]:.1f} |",
            flush=True)
    for private in ("non_private", "dp"):
      tower, full = times[f"tower_{private}"][0], times["full_" + (
          "dp_adafest" if private == "dp" else private)][0]
      print(f"# {spec} {private}: tower {tower / full:.0%} of the full step's wall; XLA tower / "
            f"tower {times[f'tower_{private}_xla'][0] / tower:.2f} (wall), "
            f"{times[f'tower_{private}_xla'][1] / times[f'tower_{private}'][1]:.2f} (CPU)")
    print("# compiled DP tower, first call at batch size: " + ", ".join(
        f"{size}: {seconds:.1f} s" for size, seconds in per_bucket.items()))
  print(f"# {machine.describe()}")


if __name__ == "__main__":
  main()
