"""Gaussian noise from a `tf.random.Generator` by the Box–Muller transform of its uniforms.

For two independent U1, U2 ~ U[0, 1), R = √(−2 ln(1 − U1)) and Θ = 2π·U2 give R·cos Θ and R·sin Θ,
two independent N(0, 1) (Box & Muller 1958). TensorFlow's own `Generator.normal` applies the
same transform one number at a time inside its kernel; written with TensorFlow's vectorised
elementwise ops it costs ~40% less CPU for the same Philox stream, but holds about two more
buffers of the output's size while it runs (BENCHMARKS.md, "DP step phases"). So tensors of
more than `FUSED_ABOVE` elements (DP-SGD's V×d table noise, DPFormer's tied table) keep
TensorFlow's one-buffer kernel. Like TensorFlow's, its tails end where the 23-bit uniforms do
(|z| <= 5.65 for float32); secure mode (`dprec.privacy.secure_noise`) is the exact alternative.
"""
import math

import tensorflow as tf

# Above this many elements (64 MB of float32) memory beats the Box–Muller form's CPU saving.
FUSED_ABOVE = 2 ** 24


def normal(generator, shape, stddev=1.0, dtype=tf.float32):
  """N(0, stddev²) samples of `shape` (a static or dynamic shape) drawn from `generator`."""
  static = tf.TensorShape(tf.get_static_value(shape))
  if static.is_fully_defined() and static.num_elements() > FUSED_ABOVE:
    return generator.normal(shape, stddev=stddev, dtype=dtype)
  shape = tf.cast(shape, tf.int64)
  count = tf.reduce_prod(shape)
  uniform = generator.uniform(tf.stack([2, (count + 1) // 2]), dtype=dtype)
  radius = tf.sqrt(-2.0 * tf.math.log1p(-uniform[0])) * tf.cast(stddev, dtype)
  angle = (2.0 * math.pi) * uniform[1]
  pairs = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], axis=0)
  return tf.reshape(pairs[:count], shape)
