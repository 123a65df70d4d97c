"""The DP optimizer object passed to `DPModel.compile` (in the spirit of tensorflow_privacy's
`DPKeras*Optimizer`): an algorithm configuration plus the optimizer that applies the update."""
import dataclasses
from typing import Any, Optional

import tensorflow as tf

from dprec.optimizers import config as config_lib


@dataclasses.dataclass
class DPOptimizer:
  """`config`: one of `dprec.optimizers.config`'s algorithms. `inner`: the Keras optimizer that
  applies the noisy gradient (use `SparseSGD`, `SparseAdagrad`, `LazyAdam` or `AdamBC` so sparse
  updates stay sparse; the DP step tells `AdamBC` the noise variance it subtracts).
  `expected_batch_size`: the normaliser of the noisy sum (q·N for Poisson
  sampling; None divides by the actual batch size, right for fixed-size batches only).
  `seed`: seeds the noise and selection generator (None: non-deterministic). `generator`: a
  `tf.random.Generator` to draw from instead (e.g. one restored from a checkpoint, so a resumed
  run continues the same noise stream)."""
  config: Any
  inner: tf.keras.optimizers.Optimizer
  expected_batch_size: Optional[float] = None
  seed: Optional[int] = None
  generator: Optional[tf.random.Generator] = None

  def __post_init__(self):
    if not isinstance(self.config, tuple(config_lib.ALGORITHMS.values())):
      raise TypeError(f"config must be one of {sorted(config_lib.ALGORITHMS)}'s configuration "
                      f"classes, got {type(self.config).__name__}")
    self.inner = tf.keras.optimizers.get(self.inner)
    if self.expected_batch_size is not None and not self.expected_batch_size > 0:
      raise ValueError(f"expected_batch_size must be positive, got {self.expected_batch_size}")
