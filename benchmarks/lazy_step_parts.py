"""Where lazy DP-SGD's step time over DP-AdaFEST's goes: the lazy step beside copies
with one part switched off, interleaved in one process (`ctr_step.interleaved_medians`), at
`train ctr`'s batch size and tower. The copies are not DP (they leave noise out): timing only.

  lazy            `DPSGDLazy` on `SparseSGD`, as `ctr_step.py`'s dp_sgd_lazy
  no_draw         the pending noise is zeros (the Gaussian draw skipped, the rest kept)
  no_materialise  rows read but not brought up to date (no draw, no bookkeeping, no scatter)
  no_look_ahead   not even the rows read: the step's clipped sum over every touched row and
                  its SGD update alone

    .venv/bin/python benchmarks/lazy_step_parts.py --vocab scaled:10M --rounds 4 --calls 4
"""
import argparse

import tensorflow as tf

import dprec  # noqa: F401  (Keras 2 before TensorFlow binds tf.keras)
from dprec.data import synthetic

import ctr_step
import machine

PARTS = ("lazy", "no_draw", "no_materialise", "no_look_ahead")


def _switch_off(model, part):
  """`model` (a dp_sgd_lazy `ctr_step` model, before its first trace) with `part` switched off."""
  lazy = model._lazy_noise(model.dp_optimizer.config)
  if part == "no_draw":
    lazy._one_gaussian = lambda pending, with_velocity, dtype, width: (
        tf.zeros([tf.size(pending), width], dtype), None)
  elif part == "no_materialise":
    lazy.materialise = lambda f, rows, upto, read=False: None
  elif part == "no_look_ahead":
    object.__setattr__(model, "_rows_read", lambda x: [])
  return model


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--vocab", default="scaled:10M")
  parser.add_argument("--batch-size", type=int, default=16384)
  parser.add_argument("--hidden-units", type=lambda text: tuple(map(int, text.split(","))),
                      default=(256, 256))
  parser.add_argument("--threshold", type=float, default=20.0, help="DP-AdaFEST τ")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--calls", type=int, default=4)
  parser.add_argument("--static-batch", action="store_true",
                      help="trace with the batch size known (default: unknown, as under `fit`)")
  args = parser.parse_args(argv)
  vocab_sizes = tuple(v + 1 for v in synthetic.vocab_sizes(args.vocab))
  inputs = [(tf.nest.map_structure(tf.constant, x), tf.constant(y))
            for x, y in ctr_step.make_batches(vocab_sizes, args.batch_size, 4)]
  signature = None if args.static_batch else tf.nest.map_structure(
      lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]), t.dtype), inputs[0])
  steps = {}
  for name in ("dp_adafest",) + PARTS:
    variant = "dp_adafest" if name == "dp_adafest" else "dp_sgd_lazy"
    model, _ = ctr_step.build(variant, vocab_sizes, args.batch_size, args.threshold,
                              hidden_units=args.hidden_units)
    if variant == "dp_sgd_lazy" and name != "lazy":
      _switch_off(model, name)
    steps[name] = (tf.function(lambda x, y, model=model: model.train_step((x, y)),
                               input_signature=signature), inputs)
    ctr_step.fetch(steps[name][0](*inputs[0]))
  times = ctr_step.interleaved_medians(steps, args.rounds, args.calls)
  base_wall, base_cpu = times["dp_adafest"]
  print(f"# {machine.describe()}")
  print("| step | wall ms | CPU ms | wall ÷ DP-AdaFEST | CPU ÷ DP-AdaFEST |")
  print("|---|---:|---:|---:|---:|")
  for name, (wall, cpu) in times.items():
    print(f"| {name} | {wall:.1f} | {cpu:.1f} | {wall / base_wall:.2f} | {cpu / base_cpu:.2f} |")
  print(f"# {machine.describe()}")


if __name__ == "__main__":
  main()
