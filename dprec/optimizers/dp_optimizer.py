"""The DP optimizer object passed to `DPModel.compile` (in the spirit of tensorflow_privacy's
`DPKeras*Optimizer`): an algorithm configuration plus the optimizer that applies the update."""
import dataclasses
import sys
import warnings
from typing import Any, Optional

import tensorflow as tf

from dprec.distribute import parameter_server
from dprec.optimizers import config as config_lib
from dprec.privacy import secure_noise as secure_noise_lib
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.privacy.noise_key import NoiseKey

NOISE_PURPOSE = "dp step"  # the derivation label of the step's generator (`NoiseKey.derive`)
GENERATOR_NOTE = ("a caller-supplied noise generator: the noise is only as secret as its seed; "
                  "treat the run as NOT differentially private")


def _is_keras3_optimizer(optimizer) -> bool:
  keras = sys.modules.get("keras")
  return (keras is not None and int(keras.__version__.split(".")[0]) >= 3
          and isinstance(optimizer, keras.optimizers.Optimizer))


@dataclasses.dataclass
class DPOptimizer:
  """`config`: one of `dprec.optimizers.config`'s algorithms. `inner`: the Keras optimizer that
  applies the noisy gradient (use `SparseSGD`, `SparseAdagrad`, `LazyAdam` or `AdamBC` so sparse
  updates stay sparse; the DP step tells `AdamBC` the noise variance it subtracts).
  `expected_batch_size`: the normaliser of the noisy sum (q·N for Poisson
  sampling; None divides by the actual batch size, right for fixed-size batches only). At user
  level (batches with `dprec.clipping.units.UNIT_KEY`) it counts units: q·users.

  The noise and selection randomness is secret by default: a generator keyed from a fresh
  `NoiseKey` (the OS CSPRNG). At most one of these replaces it:
    `noise_key`: a run's key (`dprec.workflows.run.Run.key`); private unless the key is
      an insecure one.
    `insecure_noise_seed`: deterministic noise from a public seed (warns; `private` is False).
    `generator`: a `tf.random.Generator` of the caller's (tests; a `SecureNoise` with
      `secure_noise`), flagged like an insecure seed.
  `secure_noise`: every noise draw of the step (gradient noise on kept rows and dense variables,
  contribution-map noise, false positives) sampled exactly, with no floating-point artefact
  (`dprec.privacy.secure_noise`: the rounded Gaussian mechanism, accounted as the Gaussian one).
  Created in a `ParameterServerStrategy`'s scope, the generator has one state per worker
  (`dprec.distribute.parameter_server`), which each scheduled step resets to its own.
  `private` says whether the noise is secret; `privacy_note` why not.
  `clip`: under the config's `quantile_clipping`, the current C2 (a non-trainable variable,
  starting at `l2_norm_clip`, updated by every step; a DP release like the weights); else None."""
  config: Any
  inner: tf.keras.optimizers.Optimizer
  expected_batch_size: Optional[float] = None
  noise_key: Optional[NoiseKey] = dataclasses.field(default=None, repr=False)
  insecure_noise_seed: Optional[int] = None
  generator: Optional[Any] = dataclasses.field(default=None, repr=False)
  secure_noise: bool = False

  def __post_init__(self):
    if not isinstance(self.config, tuple(config_lib.ALGORITHMS.values())):
      raise TypeError(f"config must be one of {sorted(config_lib.ALGORITHMS)}'s configuration "
                      f"classes, got {type(self.config).__name__}")
    if not _is_keras3_optimizer(self.inner):  # a Keras 3 one: `dprec.models.keras3` applies it
      self.inner = tf.keras.optimizers.get(self.inner)
    if self.expected_batch_size is not None and not self.expected_batch_size > 0:
      raise ValueError(f"expected_batch_size must be positive, got {self.expected_batch_size}")
    given = [name for name in ("noise_key", "insecure_noise_seed", "generator")
             if getattr(self, name) is not None]
    if len(given) > 1:
      raise ValueError(f"give at most one of noise_key, insecure_noise_seed, generator; got "
                       f"{', '.join(given)}")
    self.privacy_note = None
    self.clip = (tf.Variable(float(self.config.l2_norm_clip), trainable=False, name="dp_clip")
                 if getattr(self.config, "quantile_clipping", None) is not None else None)
    if self.generator is not None:
      if self.secure_noise != secure_noise_lib.is_secure(self.generator):
        raise ValueError("secure_noise needs a SecureNoise generator, and a SecureNoise "
                         "generator needs secure_noise=True")
      warnings.warn(GENERATOR_NOTE, InsecureNoiseWarning, stacklevel=3)
      self.privacy_note = GENERATOR_NOTE
      return
    if self.insecure_noise_seed is not None:
      self.noise_key = NoiseKey.insecure(self.insecure_noise_seed)
    self.noise_key = self.noise_key or NoiseKey.fresh()
    self.privacy_note = self.noise_key.note
    if parameter_server.in_scope():  # one state per worker, reset by every scheduled step
      if self.secure_noise:
        raise ValueError("secure_noise is not available under ParameterServerStrategy")
      self.generator = parameter_server.worker_generator(self.noise_key.tf_state(NOISE_PURPOSE))
    else:
      self.generator = (self.noise_key.secure_generator(NOISE_PURPOSE) if self.secure_noise
                        else self.noise_key.tf_generator(NOISE_PURPOSE))

  @property
  def private(self) -> bool:
    """Whether the noise randomness is secret."""
    return self.privacy_note is None
