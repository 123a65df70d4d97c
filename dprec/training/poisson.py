"""Batches for DP training: Poisson sampling (exact accounting) or fixed-size shuffled batches.

The privacy accountant (Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large
Embedding Models", arXiv:2311.08357, §3.3, App. C Lemma C.4) analyses Poisson subsampling: every
example joins every step's batch independently with probability q, so batch sizes vary. We draw the
batch size from Binomial(N, q) and then a uniform subset of that size without replacement, which is
the same distribution as N independent Bernoulli(q) coin flips but costs O(batch) per step instead
of O(N). Fixed-size shuffled batches (what most code does, and what Ghazi et al.'s (2023)
experiments did) are available as an option; the ledger must then say "accounted as if Poisson".
"""
import dataclasses
import itertools
import math
import os
from typing import Dict, Iterator, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec.training.batch_sizes import DATA_SIZED_RANGE, DEFAULT_BATCH_SIZE, STEPS_PER_EPOCH

DEFAULT_MAX_SAMPLING_RATE = 1 / 8


def default_batch_size(num_examples: int, preferred: int = DEFAULT_BATCH_SIZE,
                       max_sampling_rate: float = DEFAULT_MAX_SAMPLING_RATE) -> int:
  """A batch size that works for N examples when the user gives none: `preferred` (the DPFormer
  paper's Amazon setting), but at most q·N with q = 1/8 (so an epoch is at least 8 steps) and at
  least 1. N is public (it sets δ = 1/N too), so choosing B from it releases nothing."""
  if num_examples < 1:
    raise ValueError(f"need at least one training example, got {num_examples}")
  return max(1, min(preferred, int(num_examples * max_sampling_rate)))


def data_sized_batch_size(num_examples: int, steps_per_epoch: int = STEPS_PER_EPOCH) -> int:
  """B when none is given to a DP run that trains for epochs of N examples: the power of two
  nearest N / `steps_per_epoch` within `DATA_SIZED_RANGE`, capped by `default_batch_size` (at
  most N/8). At ε ≈ 1, σ hardly grows with B, so the noise on the mean gradient, σ·C2/B, falls
  almost as 1/B, and DP-AdaFEST keeps more rows (their counts grow with B at a fixed τ): one
  epoch in about `STEPS_PER_EPOCH` steps (BENCHMARKS.md, "Calibrated DP pCTR")."""
  lowest, highest = DATA_SIZED_RANGE
  target = max(num_examples, 1) / steps_per_epoch
  preferred = min(highest, max(lowest, 2 ** round(math.log2(max(target, 1)))))
  return default_batch_size(num_examples, preferred=preferred)


@dataclasses.dataclass(frozen=True)
class BatchSampling:
  """How to draw training batches from N in-memory examples.

  Attributes:
    batch_size: expected batch size B (Poisson) or exact batch size (fixed batches).
    poisson: True draws Poisson batches at rate q = B/N; False draws shuffled fixed-size batches
      (epoch by epoch, the last incomplete batch of an epoch is dropped).
    entropy: seed of the numpy generator that picks batches. The batches are part of the
      privacy proof (amplification by sampling), so this must be secret: a run passes bits
      derived from its noise key (`dprec.workflows.run.Run.key`); None draws 256 bits from
      the OS CSPRNG. Never a public seed, unless the run is flagged as not private.
    max_batch_size: B_max a Poisson batch is truncated to (a uniform subset of B_max of its
      rows), None for exact Poisson; its cost is the plan's (`dprec.privacy.truncation`).
  """
  batch_size: int
  poisson: bool = True
  entropy: Optional[int] = dataclasses.field(default=None, repr=False)
  max_batch_size: Optional[int] = None

  def __post_init__(self):
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
    if self.entropy is None:
      object.__setattr__(self, "entropy", int.from_bytes(os.urandom(32), "little"))

  def sampling_rate(self, num_examples: int) -> float:
    """q = B/N, the rate the accountant uses for either kind of batch."""
    if self.batch_size > num_examples:
      raise ValueError(f"batch_size {self.batch_size} exceeds the {num_examples} training examples")
    return self.batch_size / num_examples


def poisson_batch_indices(num_examples: int, sampling_rate: float, steps: int,
                          rng: np.random.Generator,
                          max_batch_size: Optional[int] = None) -> Iterator[np.ndarray]:
  """Yields `steps` sorted index arrays; each index is present with probability q, independently
  (then, with `max_batch_size`, a uniform subset of at most that many of them).

  A batch may be empty; the DP step still runs on it (noise only), as the analysis assumes.
  """
  if not 0.0 < sampling_rate <= 1.0:
    raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
  for _ in range(steps):
    size = rng.binomial(num_examples, sampling_rate)
    size = size if max_batch_size is None else min(size, max_batch_size)
    yield np.sort(rng.choice(num_examples, size=size, replace=False, shuffle=False))


def steps_joined(rng: np.random.Generator, num_examples: int, sampling_rate: float,
                 steps: int) -> Tuple[np.ndarray, np.ndarray]:
  """(example, step) pairs of `num_examples` examples that each join each of `steps` steps
  independently with probability q = `sampling_rate`, sorted by example then step: the other
  face of `poisson_batch_indices` (per example instead of per step), for a job that reads
  each example once (Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling",
  arXiv:2411.04205). An example's next step lies a Geometric(q) gap after its last, so the
  work is O(q·T + 1) per example; the draws are made for all examples at once, gap by gap.
  """
  if not 0.0 < sampling_rate <= 1.0:
    raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
  examples, joined = [], []
  active = np.arange(num_examples, dtype=np.int64)
  position = np.full(num_examples, -1, np.int64)
  while active.size:
    position = position + rng.geometric(sampling_rate, size=active.size)
    inside = position < steps
    active, position = active[inside], position[inside]
    examples.append(active)
    joined.append(position)
  example, step = np.concatenate(examples), np.concatenate(joined)
  order = np.lexsort((step, example))
  return example[order], step[order]


def fixed_batch_indices(num_examples: int, batch_size: int, steps: int,
                        rng: np.random.Generator) -> Iterator[np.ndarray]:
  """Yields `steps` index arrays of exactly `batch_size`, shuffling again at every epoch."""
  per_epoch = num_examples // batch_size
  if per_epoch == 0:
    raise ValueError(f"batch_size {batch_size} exceeds the {num_examples} training examples")
  produced = 0
  while produced < steps:
    order = rng.permutation(num_examples)
    for start in range(0, min(per_epoch, steps - produced) * batch_size, batch_size):
      yield order[start:start + batch_size]
    produced += min(per_epoch, steps - produced)


def batch_indices(num_examples: int, sampling: BatchSampling, steps: int,
                  start: int = 0) -> Iterator[np.ndarray]:
  """Index arrays for batches `start`..`steps - 1` of the sequence `sampling` draws.

  A run resumed at step `start` therefore sees the very batches an uninterrupted run would.
  """
  rng = np.random.default_rng(sampling.entropy)
  if sampling.poisson:
    batches = poisson_batch_indices(num_examples, sampling.sampling_rate(num_examples), steps,
                                    rng, sampling.max_batch_size)
  else:
    batches = fixed_batch_indices(num_examples, sampling.batch_size, steps, rng)
  return itertools.islice(batches, start, None)


def _num_examples(arrays: Mapping[str, np.ndarray]) -> int:
  sizes = {name: len(array) for name, array in arrays.items()}
  if not sizes or len(set(sizes.values())) != 1:
    raise ValueError(f"arrays must be non-empty and of equal length, got sizes {sizes}")
  return next(iter(sizes.values()))


def sampled_dataset(features: Mapping[str, np.ndarray], labels: Optional[np.ndarray],
                    sampling: BatchSampling, steps: int, start: int = 0,
                    shards: Optional[Tuple[int, int, int]] = None) -> tf.data.Dataset:
  """A `tf.data.Dataset` of batches `start`..`steps - 1` `(features_dict, labels)` for `model.fit`.

  The batch dimension is `None` in the element spec, so a `tf.function` train step traces once
  however the Poisson batch size varies. Pass `labels=None` for feature-only batches.
  `shards` (first, count, total): each global batch is split into `total` near-equal shards
  (one per replica of a `tf.distribute` step) and the dataset yields shards
  first..first + count − 1 of each batch in turn (`replica_dataset_fn`).
  """
  arrays: Dict[str, np.ndarray] = {name: np.asarray(value) for name, value in features.items()}
  if labels is not None:
    arrays["__label__"] = np.asarray(labels)
  num_examples = _num_examples(arrays)
  first, count, total = shards or (0, 1, 1)

  def spec(array):
    return tf.TensorSpec((None,) + array.shape[1:], tf.as_dtype(array.dtype))

  feature_spec = {name: spec(arrays[name]) for name in features}

  def generate():
    for global_batch in batch_indices(num_examples, sampling, steps, start):
      for indices in np.array_split(global_batch, total)[first:first + count]:
        batch = {name: arrays[name][indices] for name in features}
        yield (batch, arrays["__label__"][indices]) if labels is not None else batch

  signature = (feature_spec, spec(arrays["__label__"])) if labels is not None else feature_spec
  return tf.data.Dataset.from_generator(generate, output_signature=signature).prefetch(2)


def replica_dataset_fn(features: Mapping[str, np.ndarray], labels: Optional[np.ndarray],
                       sampling: BatchSampling, steps: int, start: int = 0):
  """A dataset function for `tf.distribute` (`tf.keras.utils.experimental.DatasetCreator`):
  every input pipeline draws the same global batches (`sampling`'s entropy comes from the run's
  shared key) and yields, step after step, the shards of its replicas, which take them in turn.
  The global batch is Poisson-sampled once; each replica trains on its shard."""

  def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
    per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
    return sampled_dataset(features, labels, sampling, steps, start,
                           (context.input_pipeline_id * per_pipeline, per_pipeline,
                            context.num_replicas_in_sync))

  return dataset_fn


def dataset_to_arrays(dataset: tf.data.Dataset) -> Dict[str, np.ndarray]:
  """Loads a finite, batched dataset of feature dicts into memory for `sampled_dataset`.

  Exact Poisson sampling needs random access to all N examples, which a stream does not give.
  """
  parts: Dict[str, list] = {}
  for element in dataset.as_numpy_iterator():
    if not isinstance(element, dict):
      raise ValueError("dataset elements must be dicts of feature name -> array")
    for name, value in element.items():
      parts.setdefault(name, []).append(value)
  if not parts:
    raise ValueError("dataset is empty")
  return {name: np.concatenate(values) for name, values in parts.items()}
