"""`make_private`'s `fit` from the run's Poisson batches on disk, for more examples than memory
holds.

    model = dprec.make_private(model, epsilon=1.0, train_size=N)
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    batches = model.write_batches(files, "/data/batches", parse=parse)  # a Beam job
    model.fit(batches)

`write_batches` runs the Beam job `poisson_batches` (through `dprec.beam_jobs`), the job of
`train ctr --out-of-core` (each example draws the steps it joins from the run's secret key, then
a group by step: Chua et al., "Scalable DP-SGD: Shuffling vs. Poisson Subsampling",
arXiv:2411.04205), over the user's TFRecord files (N records in all, in order) for the run's
plan: q = B/N, the T planned steps, B_max if `make_private(max_batch_size=...)`. `fit` streams
the shards of the steps not yet taken, in order (`dprec.training.batch_shards`: each read,
checked against the manifest, then parsed by `parse`), so memory grows with B and the model, not
with N; the ledger is charged per step as in memory. A shard is one planned step: a `fit` asking
for more steps than are left trains those left and stops after the last shard with a warning
(`used_up`), paying for no step it cannot train; a later `fit` is refused. The releases that
read every example (the output bias's DP label statistic, the recalibration) read a uniform
sample of at most `STATISTIC_ROWS` examples drawn with the run's key in one streaming pass over
the inputs: a Gaussian mechanism of per-example sensitivity on a subset chosen independently of
the data is as private as on all of it, and the subset's size, min(N, `STATISTIC_ROWS`), is
public.

The batches belong to the run of the model that wrote them (a `make_private` run lives as long
as its model): a directory of another run, drawn with another key or for another plan,
unfinished, or with a missing or altered shard is refused in one line naming the file.

`fit` never trains on batches the user made (a `tf.data` pipeline of batches): the privacy
proof's amplification by sampling needs each example to join each step independently with
probability q, drawn from a secret key, which dprec cannot check of batches it did not draw.
A `tf.data.Dataset` given to `fit` is the training set itself, loaded and Poisson-sampled by
dprec; data that does not fit in memory goes through `write_batches`.
"""
import dataclasses
import os
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from dprec import beam_jobs
from dprec.errors import DprecError
from dprec.training import batch_shards

STATISTIC_ROWS = 1 << 18  # examples the output bias and recalibration read out of core
READ_BATCH = 8192  # records the statistic pass reads at once


@dataclasses.dataclass(frozen=True)
class PoissonBatches:
  """A run's Poisson batch directory (`write_batches`) and `parse`: serialized records (a string
  tensor [b]) → (x, y), or x alone for a TFRS model (default `batch_shards.parse_rows`: the rows
  `dprec preprocess criteo` writes)."""
  directory: str
  parse: Callable = batch_shards.parse_rows


def as_batches(x) -> Optional[PoissonBatches]:
  """`x` as `PoissonBatches` (a path is a directory of criteo rows), None for in-memory data."""
  if isinstance(x, PoissonBatches):
    return x
  if isinstance(x, (str, os.PathLike)):
    return PoissonBatches(os.fspath(x))
  return None


def plan_fields(plan) -> dict:
  """The manifest's plan of a make_private `plan`: N, B, all planned steps, B_max."""
  return batch_shards.plan_fields(plan.examples_per_period, plan.batch_size, plan.steps,
                                  plan.max_batch_size)


def write(run, plan, files: Sequence[str], directory: str, parse: Optional[Callable],
          beam_args: Sequence[str]) -> PoissonBatches:
  """Runs the batch job over `files` for `run`'s key and `plan` into `directory`."""
  fields = plan_fields(plan)
  beam_jobs.launch(
      "poisson_batches", beam_args, files=tuple(os.fspath(f) for f in files),
      output=os.fspath(directory), run_id=run.run_id,
      key_fingerprint=batch_shards.key_fingerprint(run.key),
      num_examples=fields["num_examples"], batch_size=fields["batch_size"],
      steps=fields["steps"], key_path=run.directory.key_file(run.key) if run.key.private else None,
      insecure_noise_seed=None if run.key.private else run.key.insecure_seed,
      max_batch_size=plan.max_batch_size)
  return PoissonBatches(os.fspath(directory), parse or batch_shards.parse_rows)


def used_up(batches: PoissonBatches, steps: int, start: int, asked: int) -> str:
  """The warning of a `fit` from step `start` that asked for `asked` steps of batches holding
  `steps` in all: it stopped after the last shard."""
  return (f"{batches.directory}: fit asked for {asked} steps from step {start}, but the run's "
          f"batches hold its {steps} planned steps: training stopped after the last shard "
          f"(step {steps - 1})")


def checked_manifest(run, plan, batches: PoissonBatches, start: int) -> dict:
  """The manifest of `batches`, refused in one line unless it is this run's, key's and plan's
  and the shards of steps `start`.. are all there."""
  manifest = batch_shards.read_manifest(batches.directory, run.run_id, run.key,
                                        plan_fields(plan))
  batch_shards.check_shards(batches.directory, manifest, start)
  return manifest


def dataset(batches: PoissonBatches, manifest: dict, start: int) -> tf.data.Dataset:
  """The parsed batches of steps `start`.. in order."""
  return batch_shards.batch_dataset(batches.directory, manifest, start, parse=batches.parse)


def statistic_sample(batches: PoissonBatches, manifest: dict, rng):
  """`parse` of a uniform sample (by `rng`) of at most `STATISTIC_ROWS` of the inputs' records
  (all of them, in order, when N is no more), in one streaming pass; refuses inputs that hold
  other than N records."""
  num_examples = manifest["plan"]["num_examples"]
  chosen = (None if num_examples <= STATISTIC_ROWS
            else np.sort(rng.choice(num_examples, STATISTIC_ROWS, replace=False)))
  parts, offset = [], 0
  records = tf.data.TFRecordDataset(manifest["inputs"]).batch(READ_BATCH)
  for block in records.as_numpy_iterator():
    picked = block if chosen is None else block[
        chosen[(chosen >= offset) & (chosen < offset + len(block))] - offset]
    if len(picked):
      parts.append(batches.parse(tf.constant(picked)))
    offset += len(block)
  if offset != num_examples:
    raise DprecError(f"{os.path.join(batches.directory, batch_shards.MANIFEST)}: its inputs "
                     f"hold {offset} records, but make_private was planned for "
                     f"train_size={num_examples}")
  return tf.nest.map_structure(lambda *leaves: np.concatenate([np.asarray(v) for v in leaves]),
                               *parts)
