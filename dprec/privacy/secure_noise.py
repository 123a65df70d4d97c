"""Secure noise: the DP step's Gaussian noise and false positives with no floating-point
artefact (`DPOptimizer(secure_noise=True)`, `--secure-noise`).

Why: the default noise is float32 from Philox through a Box–Muller-type transform; the set of
floats such a sampler can return, and how often, differs from the Gaussian it stands for, and the
attacks on floating-point DP noise (Mironov 2012 for the Laplace mechanism; Jin et al. 2022 for
Gaussian samplers in DP-SGD) read the secret from exactly that difference.

What secure mode releases instead, per coordinate with clipped-sum value s and noise std σC:
    Δ · round((s + σC·N) / Δ),   Δ = σC / 2^GRID_BITS,  N ~ N(0, 1) exactly,
a deterministic function (rounding to a grid of σC·2^−24) of the Gaussian mechanism's output
s + σC·N. By post-processing its privacy is exactly that of the Gaussian mechanism, so the
accounting stays the tested Gaussian accounting (`dprec.privacy.accounting`): no new accountant
and no bound on a difference. (We did not use the discrete Gaussian of Canonne, Kamath & Steinke
2020: `dp_accounting` 0.6 and 0.4.3 account it only as a scalar with integer sensitivity,
enumerating its support, which is infeasible at a fine grid and not the d-dimensional lattice
mechanism with ℓ2 sensitivity that a gradient needs; at a coarse grid, rounding the query to the
lattice would inflate the sensitivity by up to √d·grid.)
How: s is written in fixed point (s/Δ to 2^−FRACTION_BITS) and N is sampled exactly to
GRID_BITS + FRACTION_BITS binary places (`dprec.privacy.exact_sampling.floor_normal`), which
decides the rounding exactly: with A = round(2^f·s/Δ) and M = ⌊2^(g+f)·N⌋ (g, f the two
constants), round(A/2^f + 2^g·N) = ⌊(A + 2^(f−1) + M) / 2^f⌋, integer arithmetic. DP-AdaFEST
keeps a touched row when that integer reaches T = ⌈τ/Δ1⌉; an untouched row (s = 0) therefore with
probability Ψ((T − 1/2)/2^g), and the untouched rows it keeps are the ones of i.i.d. Bernoulli
bits of that rate, drawn as exact geometric gaps (`exact_sampling.geometric`).

What stays floating point: the query. The clipped sum (and s/Δ) is computed in float32/float64;
as in every DP-SGD library its sensitivity is taken to be C (Casacuberta et al. 2022 show how
float summation can exceed it); secure mode removes the artefacts of the noise, not of the query.

Randomness: a CSPRNG stream per draw, SHAKE-256 (FIPS 202, an extendable-output function used as
a keyed stream, 256-bit security) of (the 256-bit key `NoiseKey` derives for the step, the
draw's counter, the block's counter), so a step's noise depends only on the run's secret key
and the step, as in default mode. It runs in numpy (`tf.numpy_function`) inside the step.
"""
import hashlib
import itertools
import math
import struct

import numpy as np

from dprec.privacy import exact_sampling

GRID_BITS = 24  # the output grid is σC·2^−24
FRACTION_BITS = 16  # s/Δ is held to 2^−16 grid steps (2^−40·σC) in fixed point
# |A| + |M| must fit in int64 with room: |s| ≤ 2^(62 − 40 − 1)·σC ≈ 2·10^6·σC.
MAX_FIXED = 2 ** 61
_BLOCK_BYTES = 1 << 16
CHUNK = 1 << 20  # values sampled per stream: bounds the numpy working memory (~50 MB)


class KeyedStream:
  """64-bit words of SHAKE-256(key ‖ labels ‖ block counter), block after block."""

  def __init__(self, key: bytes, *labels: int):
    self._prefix = (bytes(key) + b"dprec secure noise"
                    + b"".join(struct.pack(">Q", int(label)) for label in labels))
    self._block = 0
    self._buffer = np.zeros([0], np.uint64)

  def words(self, n):
    n = int(n)
    while self._buffer.size < n:
      size = max(_BLOCK_BYTES, 8 * (n - self._buffer.size))
      block = hashlib.shake_256(self._prefix + struct.pack(">Q", self._block)).digest(size)
      self._block += 1
      self._buffer = np.concatenate([self._buffer, np.frombuffer(block, dtype="<u8")])
    out, self._buffer = self._buffer[:n], self._buffer[n:]
    return out


class SecureNoise:
  """The DP step's secure randomness, keyed by 32 secret bytes (`NoiseKey.secure_generator`).

  Like a `tf.random.Generator` it is put on a key per step (`reset`, which
  `NoiseKey.reset` and `KeyedNoiseCallback` call); each draw in the step gets its own stream.
  It holds its key in Python only (no TensorFlow variable, so never in a checkpoint).
  `digit_bits`: u-rand digit width (32; tests use fewer to exercise ties)."""

  def __init__(self, key: bytes, digit_bits: int = 32):
    self.digit_bits = digit_bits
    self.reset(key)

  def reset(self, key: bytes):
    if len(key) != 32:
      raise ValueError(f"a secure noise key has 32 bytes, got {len(key)}")
    self._key, self._draws = bytes(key), itertools.count(1)  # next(): atomic, never repeats

  def __repr__(self):  # never the key
    return "SecureNoise(secret)"

  def _sampler(self, draw=None, chunk=0):
    """A sampler on the stream of (`draw`, `chunk`); a new draw by default."""
    draw = next(self._draws) if draw is None else draw
    return exact_sampling._Sampler(
        KeyedStream(self._key, draw, chunk), self.digit_bits)

  # ------------------------------------------------------------------ numpy
  def rounded_gaussian(self, values, std):
    """Integers round(values/Δ + 2^g·N) (Δ = std/2^g), N ~ N(0, 1) exact per entry."""
    values = np.asarray(values, np.float64)
    fixed = np.rint(values * (2.0 ** (GRID_BITS + FRACTION_BITS) / std))
    if values.size and not np.all(np.abs(fixed) < MAX_FIXED):
      raise OverflowError(
          f"a clipped sum of {np.nanmax(np.abs(values)):.3g} is beyond secure noise's fixed-point "
          f"range ({MAX_FIXED * std / 2.0 ** (GRID_BITS + FRACTION_BITS):.3g} = 2^21·σC)")
    fixed = fixed.astype(np.int64).reshape(-1)
    draw = next(self._draws)
    for start in range(0, fixed.size, CHUNK):  # one stream per chunk of the draw
      normal = self._sampler(draw, start // CHUNK).floor_normal(
          min(CHUNK, fixed.size - start), GRID_BITS + FRACTION_BITS)
      fixed[start:start + CHUNK] = (fixed[start:start + CHUNK] + normal
                                    + (1 << (FRACTION_BITS - 1))) >> FRACTION_BITS
    return fixed.reshape(values.shape)

  def noisy(self, values, std):
    """values + N(0, std²) released on the grid std·2^−g (the rounded Gaussian mechanism)."""
    grid = self.rounded_gaussian(values, std)
    return (grid.astype(np.float64) * (std * 2.0 ** -GRID_BITS)).astype(np.asarray(values).dtype)

  def passes(self, values, std, threshold):
    """Whether each noisy value, on the grid, reaches `threshold` (T = ⌈threshold/Δ⌉)."""
    return self.rounded_gaussian(values, std) >= grid_threshold(threshold, std)

  def bernoulli_positions(self, length, rate):
    """Sorted positions of the ones of `length` i.i.d. Bernoulli bits (`rate`: an
    `exact_sampling.Rate`, or a float p taken exactly)."""
    if not isinstance(rate, exact_sampling.Rate):
      rate = exact_sampling.Rate(rate)
    return exact_sampling.bernoulli_positions(self._sampler(), length, rate)

  # ------------------------------------------------------------------ TensorFlow
  def add_noise(self, values, std):
    """`noisy` as a TensorFlow op (inside `tf.function` too)."""
    import tensorflow as tf
    out = tf.numpy_function(lambda v: self.noisy(v, std), [values], values.dtype, stateful=True)
    out.set_shape(values.shape)
    return out

  def add_passes(self, values, std, threshold):
    """`passes` as a TensorFlow op: bool, the shape of `values`."""
    import tensorflow as tf
    out = tf.numpy_function(lambda v: self.passes(v, std, threshold), [values], tf.bool,
                            stateful=True)
    out.set_shape(values.shape)
    return out

  def positions_op(self, length, rate):
    """`bernoulli_positions` as a TensorFlow op: int64 [None]."""
    import tensorflow as tf
    out = tf.numpy_function(lambda n: self.bernoulli_positions(n, rate), [length], tf.int64,
                            stateful=True)
    out.set_shape([None])
    return out


def grid_threshold(threshold, std):
  """T = ⌈τ/Δ⌉ on the grid Δ = std/2^g: a noisy value passes τ when its grid integer ≥ T."""
  return int(math.ceil(threshold * 2.0 ** GRID_BITS / std))


def tail_rate(threshold, std):
  """The exact rate at which a row with value 0 passes: Pr[round(2^g·N) ≥ T] = Ψ((T − ½)/2^g)."""
  return exact_sampling.Rate.gaussian_tail(
      (grid_threshold(threshold, std) - 0.5) * 2.0 ** -GRID_BITS)


def is_secure(generator) -> bool:
  return isinstance(generator, SecureNoise)
