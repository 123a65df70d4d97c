"""The secret key every random draw of a DP proof comes from (noise, false positives, Poisson
sampling, DP top-k, DP counts).

A mechanism is only private if its randomness is unknown to the adversary: noise replayed from a
public seed can be subtracted, and predictable Poisson batches give no amplification. A
`NoiseKey` holds 256 bits from the operating system's CSPRNG; each use derives its own stream
from (purpose, indices) by HMAC-SHA256, so a step's draws depend only on the key and the step
(exact resume without storing generator state). `NoiseKey.insecure(seed)` derives the key from
a public seed instead, for reproducible experiments and tests: such a key says it is not private
(`private`, `note`), and creating one warns.
"""
import hashlib
import hmac
import os
import struct
import warnings
from typing import Optional

import numpy as np

KEY_BYTES = 32
INSECURE_NOTE = ("--insecure-noise-seed {seed}: the noise, sampling and selection randomness "
                 "is derived from a public seed, so anyone who knows it can replay and subtract "
                 "the noise: this run is NOT differentially private")


class InsecureNoiseWarning(UserWarning):
  """Noise randomness that can be replayed: the run is not differentially private."""


class NoiseKey:
  """A secret key (or an insecure one from a public seed) and the generators derived from it."""

  def __init__(self, key: bytes, insecure_seed: Optional[int] = None):
    if len(key) != KEY_BYTES:
      raise ValueError(f"a noise key has {KEY_BYTES} bytes, got {len(key)}")
    self._key = bytes(key)
    self.insecure_seed = insecure_seed

  @classmethod
  def fresh(cls) -> "NoiseKey":
    """A new secret key from the OS CSPRNG."""
    return cls(os.urandom(KEY_BYTES))

  @classmethod
  def new(cls, insecure_seed: Optional[int] = None) -> "NoiseKey":
    """A fresh secret key, or with `insecure_seed` (`--insecure-noise-seed`) the insecure one."""
    return cls.fresh() if insecure_seed is None else cls.insecure(insecure_seed)

  @classmethod
  def insecure(cls, seed: int) -> "NoiseKey":
    """A deterministic key from a public seed (warns: the run is not private)."""
    seed = int(seed)
    warnings.warn(INSECURE_NOTE.format(seed=seed), InsecureNoiseWarning, stacklevel=2)
    return cls(hashlib.sha256(f"dprec insecure noise seed {seed}".encode()).digest(), seed)

  @property
  def private(self) -> bool:
    return self.insecure_seed is None

  @property
  def note(self) -> Optional[str]:
    """Why the randomness is not secret (None when it is)."""
    return None if self.private else INSECURE_NOTE.format(seed=self.insecure_seed)

  def key_bytes(self) -> bytes:
    """The raw key, for `dprec.workflows.run` to keep in the run's secret directory."""
    return self._key

  def __repr__(self):  # never the key itself
    return "NoiseKey(secret)" if self.private else f"NoiseKey(insecure seed {self.insecure_seed})"

  def derive(self, purpose: str, *index: int) -> bytes:
    """32 bytes for (purpose, index...): independent streams for distinct arguments."""
    message = purpose.encode() + b"\0" + b"".join(struct.pack(">q", int(i)) for i in index)
    return hmac.new(self._key, message, hashlib.sha256).digest()

  def numpy_rng(self, purpose: str, *index: int) -> np.random.Generator:
    """A numpy Generator seeded with 256 derived bits."""
    return np.random.default_rng(self.entropy(purpose, *index))

  def entropy(self, purpose: str, *index: int) -> int:
    """The derived bits as one int (a numpy `SeedSequence` entropy)."""
    return int.from_bytes(self.derive(purpose, *index), "little")

  def tf_state(self, purpose: str, *index: int):
    """A Philox state (128-bit counter and 64-bit key, all derived) for `tf.random.Generator`."""
    return np.frombuffer(self.derive(purpose, *index)[:24], dtype=np.int64).copy()

  def tf_generator(self, purpose: str, *index: int):
    """A `tf.random.Generator` on the derived Philox state."""
    import tensorflow as tf
    return tf.random.Generator.from_state(self.tf_state(purpose, *index), alg="philox")

  def secure_generator(self, purpose: str, *index: int):
    """A `dprec.privacy.secure_noise.SecureNoise` keyed with the 256 derived bits."""
    from dprec.privacy import secure_noise
    return secure_noise.SecureNoise(self.derive(purpose, *index))

  def reset(self, generator, purpose: str, *index: int):
    """Puts `generator` (a `tf.random.Generator` or a `SecureNoise`) on the state derived for
    (purpose, index...), e.g. once per step."""
    from dprec.privacy import secure_noise
    if secure_noise.is_secure(generator):
      generator.reset(self.derive(purpose, *index))
    else:
      generator.reset(self.tf_state(purpose, *index))
