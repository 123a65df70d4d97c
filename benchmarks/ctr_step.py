"""Step time of the full pCTR model (Ghazi et al., "Sparsity-Preserving Differentially Private
Training of Large Embedding Models", arXiv:2311.08357, App. D.1.1) at batch 2048, side by side.

Variants, run one after another in this process on the same batches:
  non_private   dprec `CTRModel` + `SparseSGD` (row-sparse updates), the reference
  dp_adafest    dprec DP-AdaFEST (σ1 = 5, σ2 = 1, τ = --threshold, C1 = 1, C2 = 10); false
                positives among untouched rows: V·Ψ(τ/(σ1·C1)) a step, so larger vocabularies
                need a larger τ (15 → ~460 rows of table3's 0.34M, ~13,500 of 10M; 25 → ~0)
  dp_sgd        dprec DP-SGD (dense noise on every embedding row)
  dp_sgd_lazy   dprec DP-SGD with lazy dense noise (`DPSGDLazy`: noise on the rows a step reads,
                each row's pending steps drawn as one Gaussian); not in the default list
  dp_sgd_lazy_momentum
                the same with momentum 0.9 on the tables (`TableSGD`: the dense tower on lazy
                Adam; the pending (row, velocity) noise a 2-variable Gaussian); on request only
  dp_adafest_secure, dp_sgd_secure
                the same with `secure_noise=True` (every noise draw exact, no floating-point
                artefact: `dprec.privacy.secure_noise`); not in the default list
  non_private_stacked, dp_adafest_stacked, dp_sgd_stacked
                the same with the tables stacked in one variable per width rounded up to
                a multiple of --stack-multiple (`CTRConfig.stack_tables`; 1: exact widths);
                not in the default list
  tfp_dpmodel   tensorflow_privacy's DPModel (`make_dp_model_class`) with its fast gradient
                clipping layer registry and stock Keras SGD: the tool users have today (only
                where tensorflow_privacy imports, TF <= 2.15: `pip install -e .[tfp]`; skipped
                with a note elsewhere)
  keras         stock Keras functional model and SGD, non-private (what tfp_dpmodel adds to)

Batches: Zipf-like ids (P(rank r) ∝ 1/r) per table, heavy-tailed integers; vocabularies of note
001 Table 3 (`table3`) or scaled to M rows in all (`scaled:10M`), each plus the OOV row.
Times exclude the first step (tracing). Prints a Markdown table; ratios are against
`non_private` in the same run (a `_stacked` variant's against `non_private_stacked` if it ran).
Three modes: one `fit` per variant in turn (default); `--interleaved R`, every variant's
`train_step` called in turn for R rounds (static batch shapes); `--fit-rounds R`, every
variant's model held at once and `fit` for --steps steps each in turn, R rounds (what `train
ctr` runs: Keras' loop, batch size unknown when the step is traced), the median of per-step
times, so load changes hit every variant alike. Ratios in the last two: against the first variant.

    .venv/bin/python benchmarks/ctr_step.py --vocab table3 scaled:10M
    .venv/bin/python benchmarks/ctr_step.py --vocab table3 scaled:10M \
        --variants non_private dp_adafest dp_adafest_secure   # secure vs default noise
"""
import argparse
import gc
import itertools
import json
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

import dprec  # noqa: F401  (Keras 2 before TensorFlow binds tf.keras)
from dprec.data import synthetic
from dprec.models import ctr
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import SparseSGD
from dprec.optimizers.sparse import TableSGD
from dprec.training.callbacks import StepTimer

import machine

VARIANTS = ("non_private", "dp_adafest", "dp_sgd", "tfp_dpmodel", "keras")
SECURE = ("dp_adafest_secure", "dp_sgd_secure")  # `secure_noise=True`; on request only
STACKED = ("non_private_stacked", "dp_adafest_stacked", "dp_sgd_stacked")  # on request only
LAZY = ("dp_sgd_lazy", "dp_sgd_lazy_momentum")  # on request only
DENSE = ("dp_sgd", "dp_sgd_secure", "dp_sgd_stacked", "tfp_dpmodel", "keras")  # cost ∝ V·d
LEARNING_RATE, C2, SIGMA2, SIGMA1, C1 = 0.5, 10.0, 1.0, 5.0, 1.0


def make_batches(vocab_sizes, batch_size, count, seed=0):
  """`count` batches of (features, labels) with 1/r-distributed ids in every table."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    uniform = rng.random((batch_size, len(vocab_sizes)))
    sizes = np.asarray(vocab_sizes, np.float64)
    ids = np.minimum(np.floor(np.exp(uniform * np.log(sizes))), sizes - 1).astype(np.int32)
    ints = np.log1p(rng.pareto(1.5, (batch_size, 13))).astype(np.float32)
    labels = (rng.random(batch_size) < 0.25).astype(np.int32)
    batches.append(({ctr.CAT_FEATURES: ids, ctr.INT_FEATURES: ints}, labels))
  return batches


def _dprec_model(vocab_sizes, algorithm, batch_size, secure_noise=False, stack_tables=False,
                 momentum=None, hidden_units=None):
  model = ctr.build_ctr_model(vocab_sizes, stack_tables=stack_tables,
                              **({"hidden_units": hidden_units} if hidden_units else {}))
  inner = (SparseSGD(LEARNING_RATE) if momentum is None
           else TableSGD(1e-2, table_learning_rate=LEARNING_RATE, momentum=momentum))
  model.compile(optimizer=DPOptimizer(algorithm, inner, expected_batch_size=batch_size,
                                      secure_noise=secure_noise))
  if momentum is not None:
    inner.train_tables([t.embeddings for t in model.dp_step_tables])
  model.optimizer.build(model.trainable_variables)
  return model


def _keras_model(vocab_sizes, dp):
  """The same architecture from stock Keras layers (one Input per table, as tf_privacy's fast
  clipping needs registered layers in a functional graph)."""
  config = ctr.CTRConfig(vocab_sizes=tuple(vocab_sizes))
  cat_inputs = [tf.keras.Input((1,), dtype=tf.int32, name=name) for name in config.table_names]
  int_input = tf.keras.Input((13,), name=ctr.INT_FEATURES)
  embedded = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(v, d)(x))
              for v, d, x in zip(config.vocab_sizes, config.embedding_dims, cat_inputs)]
  activations = tf.keras.layers.Concatenate()(embedded + [int_input])
  for units in config.hidden_units:
    activations = tf.keras.layers.Dense(units, activation="relu")(activations)
  logits = tf.keras.layers.Dense(1)(activations)
  inputs = cat_inputs + [int_input]
  if dp:
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.keras_models import dp_keras_model
    model_class = dp_keras_model.make_dp_model_class(tf.keras.Model)
    model = model_class(l2_norm_clip=C2, noise_multiplier=SIGMA2, use_xla=False,
                        layer_registry=layer_registry.make_default_layer_registry(),
                        inputs=inputs, outputs=logits)
    assert model._enable_fast_peg_computation
  else:
    model = tf.keras.Model(inputs, logits)
  model.compile(optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  return model, config.table_names


def build(variant, vocab_sizes, batch_size, threshold, stack_multiple=8, hidden_units=None):
  """(model, function mapping a dprec batch (features, labels) to this model's)."""
  if variant in ("tfp_dpmodel", "keras"):
    model, names = _keras_model(vocab_sizes, dp=variant == "tfp_dpmodel")

    def adapt(features, labels):
      columns = {n: features[ctr.CAT_FEATURES][:, f:f + 1] for f, n in enumerate(names)}
      columns[ctr.INT_FEATURES] = features[ctr.INT_FEATURES]
      return columns, labels[:, np.newaxis].astype(np.float32)
    return model, adapt
  algorithm = {
      "non_private": config_lib.NonPrivate(),
      "dp_sgd": config_lib.DPSGD(l2_norm_clip=C2, noise_multiplier=SIGMA2),
      "dp_sgd_lazy": config_lib.DPSGDLazy(l2_norm_clip=C2, noise_multiplier=SIGMA2),
      "dp_adafest": config_lib.DPAdaFEST(l2_norm_clip=C2, noise_multiplier=SIGMA2,
                                         contribution_clip=C1, contribution_noise_multiplier=SIGMA1,
                                         threshold=threshold),
  }[variant.removesuffix("_secure").removesuffix("_stacked").removesuffix("_momentum")]
  model = _dprec_model(vocab_sizes, algorithm, batch_size, variant.endswith("_secure"),
                       variant.endswith("_stacked") and stack_multiple,
                       0.9 if variant.endswith("_momentum") else None, hidden_units)
  return model, lambda features, labels: (features, labels)


def _cycled(batches, count):
  """A dataset of `count` batches cycling through `batches` (numpy), batch size left unknown."""
  return tf.data.Dataset.from_generator(
      lambda: itertools.islice(itertools.cycle(batches), count),
      output_signature=tf.nest.map_structure(
          lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)), batches[0]))


def time_variant(variant, vocab_sizes, batches, steps, threshold, stack_multiple=8,
                 hidden_units=None):
  """Seconds per step over `steps` timed steps (after one untimed tracing step)."""
  model, adapt = build(variant, vocab_sizes, len(batches[0][1]), threshold, stack_multiple,
                       hidden_units)
  inputs = [adapt(x, y) for x, y in batches]
  dataset = _cycled(inputs, steps + 1)
  timer = StepTimer()
  model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, callbacks=[timer], verbose=0)
  seconds = timer.seconds / (timer.steps - 1)
  extra = {}
  if variant.startswith(("dp_", "non_private")):
    extra["gradient_size"] = float(model.gradient_size_tracker.result())
  inputs.clear()  # the batches, freed with the model before the next variant
  del model, dataset
  tf.keras.backend.clear_session()
  gc.collect()
  return seconds, extra


def fetch(result):
  """`result` (nested) with every tensor read back, so that its work is done."""
  return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)


def interleaved_medians(functions, rounds, calls):
  """{name: (median wall ms, median CPU ms)} per call of `functions` {name: (function, [args,
  ...])}: each called `calls` times in turn (cycling through its argument tuples, its result
  fetched before the clock stops), `rounds` rounds, so a shared machine's load changes hit all
  alike; CPU is the process's, summed over threads. Trace (warm up) them first."""
  wall, cpu = {name: [] for name in functions}, {name: [] for name in functions}
  for r in range(rounds):
    for name, (function, arguments) in functions.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      for i in range(calls):
        result = function(*arguments[(r * calls + i) % len(arguments)])
      fetch(result)
      wall[name].append(1000 * (time.perf_counter() - start) / calls)
      cpu[name].append(1000 * (time.process_time() - start_cpu) / calls)
  return {name: (statistics.median(wall[name]), statistics.median(cpu[name]))
          for name in functions}


def interleaved(variants, vocab_sizes, batches, rounds, calls, threshold, stack_multiple=8,
                hidden_units=None):
  """{variant: (median wall ms, median CPU ms)} per step: every variant's `train_step` (one
  `tf.function` each, traced first) through `interleaved_medians`."""
  steps, inputs = {}, [(tf.nest.map_structure(tf.constant, x), tf.constant(y)) for x, y in batches]
  for variant in variants:
    model, _ = build(variant, vocab_sizes, len(batches[0][1]), threshold, stack_multiple,
                     hidden_units)
    steps[variant] = (tf.function(lambda x, y, model=model: model.train_step((x, y))), inputs)
    fetch(steps[variant][0](*inputs[0]))
  return interleaved_medians(steps, rounds, calls)


class _StepTimes(tf.keras.callbacks.Callback):
  """Wall ms of every training step."""

  def __init__(self):
    super().__init__()
    self.times, self._start = [], None

  def on_train_batch_begin(self, batch, logs=None):
    self._start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(1000 * (time.perf_counter() - self._start))


def fit_rounds(variants, vocab_sizes, batches, rounds, steps, threshold, stack_multiple=8,
               hidden_units=None):
  """{variant: (median ms a step, steps timed)}: every variant's model built, then `rounds`
  rounds of `fit` for `steps` steps each in turn (a first round traces; each call's first step,
  which starts the input pipeline, is dropped)."""
  models = {variant: build(variant, vocab_sizes, len(batches[0][1]), threshold, stack_multiple,
                           hidden_units)[0] for variant in variants}
  times = {variant: [] for variant in variants}
  for r in range(rounds + 1):
    for variant, model in models.items():
      timer = _StepTimes()
      model.fit(_cycled(batches, steps + 1), epochs=1, steps_per_epoch=steps + 1,
                callbacks=[timer], verbose=0)
      if r:
        times[variant].extend(timer.times[1:])
  return {variant: (statistics.median(t), len(t)) for variant, t in times.items()}


def _tensorflow_privacy_imports():
  try:
    import tensorflow_privacy  # noqa: F401
  except ImportError:
    return False
  return True


def _by_vocabulary(args, mode, rounds):
  """(vocabulary, `mode`'s times) for each of `args.vocab` (`mode`: `interleaved` or
  `fit_rounds`, `rounds` rounds of `args.steps` steps)."""
  for spec in args.vocab:
    vocab_sizes = tuple(v + 1 for v in synthetic.vocab_sizes(spec))
    yield spec, mode(args.variants, vocab_sizes, make_batches(vocab_sizes, args.batch_size, 8),
                     rounds, args.steps, args.threshold, args.stack_multiple, args.hidden_units)


def _finish(json_path, results):
  """The machine line after a table; the results to `json_path` if given."""
  print(f"# {machine.describe()}")
  if json_path:
    with open(json_path, "w", encoding="utf-8") as out:
      json.dump(results, out, indent=2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--vocab", nargs="+", default=["table3", "scaled:10M"],
                      help="vocabularies: table3 and/or scaled:M")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                      choices=VARIANTS + SECURE + STACKED + LAZY)
  parser.add_argument("--batch-size", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
  parser.add_argument("--dense-steps", type=int, default=3,
                      help="timed steps of dense variants above 1M rows")
  parser.add_argument("--threshold", type=float, default=15.0, help="DP-AdaFEST τ")
  parser.add_argument("--stack-multiple", type=int, default=8,
                      help="_stacked variants: stack widths round up to this (default: 8)")
  parser.add_argument("--hidden-units", type=lambda text: tuple(map(int, text.split(","))),
                      help="dprec variants' dense tower (default: App. D.1.1's 598,598,598,598; "
                           "train ctr's is 256,256)")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--interleaved", type=int, metavar="ROUNDS",
                      help="instead: all variants' steps in turn, ROUNDS rounds of --steps calls "
                           "each; median wall and CPU ms per step (for a shared machine)")
  parser.add_argument("--fit-rounds", type=int, metavar="ROUNDS",
                      help="instead: every variant's model `fit` for --steps steps in turn, ROUNDS "
                           "rounds; median ms per step (train ctr's loop, on a shared machine)")
  args = parser.parse_args(argv)
  if "tfp_dpmodel" in args.variants and not _tensorflow_privacy_imports():
    args.variants.remove("tfp_dpmodel")
    print("# tfp_dpmodel skipped: tensorflow_privacy does not import on this TensorFlow "
          f"({tf.__version__}); run on the [tfp] stack for it", file=sys.stderr)
  results = []
  print(f"# {machine.describe()}")
  if args.fit_rounds:
    print("| vocabulary | variant | ms/step (median) | steps timed | × first variant |")
    print("|---|---|---:|---:|---:|")
    for spec, times in _by_vocabulary(args, fit_rounds, args.fit_rounds):
      first = times[args.variants[0]][0]
      for variant, (ms, count) in times.items():
        print(f"| {spec} | {variant} | {ms:.1f} | {count} | {ms / first:.3f} |", flush=True)
        results.append(dict(vocab=spec, variant=variant, fit_ms=ms, steps_timed=count,
                            batch_size=args.batch_size, hidden_units=args.hidden_units))
    _finish(args.json, results)
    return
  if args.interleaved:
    print("| vocabulary | variant | wall ms/step | CPU ms/step | wall × reference | "
          "CPU × reference |")
    print("|---|---|---:|---:|---:|---:|")
    for spec, times in _by_vocabulary(args, interleaved, args.interleaved):
      for variant, (wall_ms, cpu_ms) in times.items():
        reference = times.get("non_private_stacked" if variant.endswith("_stacked")
                              else "non_private", times.get("non_private", (np.nan, np.nan)))
        print(f"| {spec} | {variant} | {wall_ms:.1f} | {cpu_ms:.1f} | "
              f"{wall_ms / reference[0]:.2f} | {cpu_ms / reference[1]:.2f} |", flush=True)
        results.append(dict(vocab=spec, variant=variant, wall_ms=wall_ms, cpu_ms=cpu_ms))
    _finish(args.json, results)
    return
  print("| vocabulary | rows | variant | ms/step | × non_private | tfp_dpmodel / variant |")
  print("|---|---:|---|---:|---:|---:|")
  for spec in args.vocab:
    vocab_sizes = tuple(v + 1 for v in synthetic.vocab_sizes(spec))
    batches = make_batches(vocab_sizes, args.batch_size, 8)
    rows = {}
    for variant in args.variants:
      steps = args.dense_steps if variant in DENSE and sum(vocab_sizes) > 10 ** 6 else args.steps
      seconds, extra = time_variant(variant, vocab_sizes, batches, steps, args.threshold,
                                    args.stack_multiple, args.hidden_units)
      rows[variant] = seconds
      results.append(dict(vocab=spec, rows=sum(vocab_sizes), variant=variant,
                          seconds_per_step=seconds, timed_steps=steps, **extra))
      print(f"# {spec} {variant}: {1000 * seconds:.1f} ms/step ({steps} steps) {extra}",
            file=sys.stderr, flush=True)
    for variant, seconds in rows.items():
      reference = "non_private_stacked" if variant.endswith("_stacked") else "non_private"
      reference = reference if reference in rows else "non_private"
      ratio = seconds / rows[reference] if reference in rows else float("nan")
      versus = rows["tfp_dpmodel"] / seconds if "tfp_dpmodel" in rows else float("nan")
      print(f"| {spec} | {sum(vocab_sizes):,} | {variant} | {1000 * seconds:.1f} | "
            f"{ratio:.2f} | {versus:.2f} |", flush=True)
  _finish(args.json, results)


if __name__ == "__main__":
  main()
