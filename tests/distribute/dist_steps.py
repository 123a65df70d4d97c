"""One DP step of a small two-table model (tests/distribute): on one device, under a
`tf.distribute` strategy, or, run as a script with TF_CONFIG set, as one worker of a
MultiWorkerMirroredStrategy cluster (`python dist_steps.py OUT_DIR`): one step of each algorithm
(OUT_DIR/worker{index}.npz), then a chief stopping early (OUT_DIR/stop{index}.npz)."""
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import tensorflow as tf

from dprec.layers.embedding import DPMultiEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPAdaFEST, DPSGD, DPOptimizer, SparseSGD
from dprec.training import poisson
from dprec.training.callbacks import SharedStop

VOCABS = (40, 30)
DIM = 3
N = 96
BATCH = 24  # expected (Poisson) batch size of the global batch
NOISE_SEED = 5  # --insecure-noise-seed: the same noise on one device and on every replica
CONFIGS = {
    "dp_sgd": DPSGD(0.5, 1.0),
    # σ1·C1 = 1 and τ = 2: some touched rows are dropped, some untouched ones are false positives.
    "dp_adafest": DPAdaFEST(0.5, 1.0, contribution_clip=1.0, contribution_noise_multiplier=1.0,
                            threshold=2.0),
    # No row reaches τ: replicas exchange no rows (collectives on empty tensors must not crash).
    "dp_adafest_none_kept": DPAdaFEST(0.5, 1.0, contribution_clip=1.0,
                                      contribution_noise_multiplier=0.05, threshold=50.0),
}


def data(seed=0):
  """(features {"cat": [N, 2] ids, Zipf-like}, labels [N, 1])."""
  rng = np.random.default_rng(seed)
  cat = np.stack([np.minimum(rng.zipf(1.5, N) - 1, v - 1) for v in VOCABS], axis=1)
  return {"cat": cat.astype(np.int64)}, rng.integers(0, 2, (N, 1)).astype(np.float32)


def build_model(config, lr=0.5, expected_batch_size=BATCH, vocabs=VOCABS, optimizer=SparseSGD,
                stack_tables=False):
  """The model (tables of `vocabs` rows, ≥ `VOCABS`; `stack_tables`: in one variable),
  compiled with `config`, `optimizer(lr)` and noise from the insecure seed (call it inside the
  strategy's scope)."""
  tf.keras.utils.set_random_seed(0)
  cat = tf.keras.Input((2,), dtype=tf.int64, name="cat")
  h = DPMultiEmbedding(vocabs, [DIM] * len(vocabs), table_names=["t0", "t1"],
                       stack_tables=stack_tables)(cat)
  h = tf.keras.layers.Dense(4, activation="tanh")(h)
  model = DPModel(cat, tf.keras.layers.Dense(1)(h))
  model.compile(DPOptimizer(config, optimizer(lr), expected_batch_size=expected_batch_size,
                            insecure_noise_seed=NOISE_SEED),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  return model


def one_step(algorithm, strategy=None, **model_args):
  """The trainable weights after one `model.fit` step on the first Poisson batch of `data()`;
  under `strategy`, each replica trains on its shard of that global batch."""
  features, labels = data()
  sampling = poisson.BatchSampling(BATCH, entropy=7)
  if strategy is None:
    model = build_model(CONFIGS[algorithm], **model_args)
    model.fit(poisson.sampled_dataset(features, labels, sampling, 1), steps_per_epoch=1,
              verbose=0)
  else:
    with strategy.scope():
      model = build_model(CONFIGS[algorithm], **model_args)
    model.fit(tf.keras.utils.experimental.DatasetCreator(
        poisson.replica_dataset_fn(features, labels, sampling, 1)), steps_per_epoch=1,
              verbose=0)
  return [w.numpy() for w in model.trainable_weights]


class _StopOnChief(tf.keras.callbacks.Callback):
  """Stops the chief (worker 0) alone after `steps` steps, as the budget callback would."""

  def __init__(self, steps):
    super().__init__()
    self.steps, self.done = steps, 0

  def on_train_batch_end(self, batch, logs=None):
    self.done += 1
    if self.done == self.steps and json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
      self.model.stop_training = True


def stop_early(out, strategy, steps=2):
  """A worker that trains 4 steps of which the chief alone stops after `steps`; with
  `SharedStop` every worker stops there (saves the steps it took), else the others hang."""
  features, labels = data()
  with strategy.scope():
    model = build_model(CONFIGS["dp_sgd"])
  counter = _StopOnChief(steps)
  model.fit(tf.keras.utils.experimental.DatasetCreator(poisson.replica_dataset_fn(
      features, labels, poisson.BatchSampling(BATCH, entropy=7), 4)), steps_per_epoch=4,
            verbose=0, callbacks=[counter, SharedStop(strategy)])
  np.savez(out, steps=counter.done)


def main(out_dir):
  """A worker of the MultiWorkerMirroredStrategy cluster that TF_CONFIG describes: one step of
  each algorithm, then `stop_early`, under one strategy (a process configures its collectives
  once; one cluster start serves both)."""
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  np.savez(os.path.join(out_dir, f"worker{index}.npz"),
           **{f"{algorithm}_{i}": w for algorithm in CONFIGS
              for i, w in enumerate(one_step(algorithm, strategy))})
  stop_early(os.path.join(out_dir, f"stop{index}.npz"), strategy)


if __name__ == "__main__":
  main(*sys.argv[1:])
