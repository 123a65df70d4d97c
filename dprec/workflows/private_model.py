"""`dprec.make_private`: one call from an ordinary Keras or TFRS model to one that trains
privately through the ordinary `compile` and `fit` calls.

    model = dprec.make_private(model, epsilon=1.0, train_size=len(y))
    model.compile(optimizer="adagrad", loss="mse", metrics=[...])
    history = model.fit(x, y, epochs=5)          # history.history["epsilon"], model.epsilon_spent

What the call does to `model` (in place; the same object is returned), for a Keras 3 model
(`import keras`, TensorFlow backend) and a tf.keras (Keras 2) one alike, functional,
Sequential or subclassed:
- the model's class becomes a private subclass of its own: `PrivateTraining`
  (`dprec.workflows.private_training`: plan, compile, fit, output layer) and the DP step of
  its Keras (`DPModel` for tf.keras,
  `dprec.models.keras3.Keras3DPModel` for Keras 3) first, then the model's class, under its
  name and module, so it keeps its `call`, `evaluate`, `predict`, `save`, and a saved model
  loads as the original class;
- its trainable Embedding layers train as DP tables: a tf.keras `Embedding` becomes a
  `DPEmbedding` (`dprec.layers.embedding.convert_embedding`: same object, name and weights), a
  Keras 3 one stays as it is (`dprec.models.keras3.DPTable` records its lookups);
- a TFRS `tfrs.Model` (tf.keras only) trains through its `compute_loss` and Ranking task;
- it refuses, in one line naming them, what per-example clipping cannot bound: layers without a
  per-example norm in the clipping registry, stateful layers (BatchNormalization, stateful
  RNNs), `tfrs.tasks.Retrieval` (in-batch negatives couple the examples), a model holding
  layers of the other Keras, a Keras 3 backend other than TensorFlow, a Keras 3 model class with
  its own `compute_loss` (the step takes compile's per-example loss), and, at the first step,
  losses that return one value per batch and forward passes that write variables.

`compile` plans privacy (`dprec.workflows.plan`: one σ by PLD for ε over the planned steps
T = ⌈epochs·N/B⌉ at q = B/N, composed with the one-off releases below and whatever the ledger
spent on the data before), makes the algorithm's `DPOptimizer` with the run's secret key, and
swaps a stock SGD, Adagrad or Adam for its row-sparse twin (same hyperparameters). The learning
rate stays the user's, and under DP it matters more than without: Adam's second moment holds the
noise, which shrinks its steps, so choose it on validation (measured choices:
docs/experiments/make_private.md). `compile` warns when Adam's lr·T is below `SHORT_ADAM_PATH`.
`fit` draws Poisson batches at q from the run's key (or, for data larger than memory, streams
the run's batches on disk, `write_batches`: `dprec.workflows.private_batches`), charges the
ledger (the one given, else a temporary one) before each block of steps, stops at the budget,
and first initialises the output bias from a DP label statistic (`dprec.training.output_layer`;
MSE, binary and sparse categorical cross-entropy), and recalibrates the output after training
under DP (MSE and binary cross-entropy, by default).
N (`train_size`) is public, as are every option and the model's architecture; vocabularies are
the model's (public, as in Ghazi et al. 2023, arXiv:2311.08357). ε covers the trained weights,
the bias initialisation and the recalibration; the training metrics Keras reports are not
covered (exact, non-private diagnostics of the training batches). At `privacy_unit="user"`, ε
protects a user with all of their rows: U users replace N, batches sample users with at most k
rows each, and the releases read at most k rows per user (`dprec.workflows.private_users`).
"""
import sys
import weakref

import numpy as np
import tensorflow as tf

from dprec.errors import DprecError
from dprec.layers.embedding import convert_embedding
from dprec.models.dp_model import DPModel
from dprec.models.dp_model import unique_by_identity
from dprec.models.dp_step import mixed_class
from dprec.models.dp_step import refusing_variable_updates
from dprec.optimizers import config as config_lib
from dprec.optimizers import sparse as sparse_optimizers
from dprec.workflows import run as run_lib
from dprec.workflows.private_options import COMMAND, PrivateOptions
from dprec.workflows.private_training import (
    PrivateTraining, recording_task, refuse_mixed_keras, refuse_stateful, refuse_unclippable,
    PrivateState)

# A stock optimizer's row-sparse twin (`dprec.optimizers.sparse`): the same update, touching
# only the rows of an IndexedSlices gradient.
ROW_SPARSE = {tf.keras.optimizers.SGD: sparse_optimizers.SparseSGD,
              tf.keras.optimizers.Adagrad: sparse_optimizers.SparseAdagrad,
              tf.keras.optimizers.Adam: sparse_optimizers.LazyAdam}


def _private_base(model):
  """The private class of `model`'s Keras: `Keras3PrivateModel` (`dprec.workflows.
  private_keras3`, imported only for a Keras 3 model) or `PrivateModel` (tf.keras)."""
  keras = sys.modules.get("keras")
  if (keras is not None and int(keras.__version__.split(".")[0]) >= 3
      and isinstance(model, keras.Model)):
    from dprec.workflows import private_keras3
    return private_keras3.Keras3PrivateModel
  if isinstance(model, tf.keras.Model):
    return PrivateModel
  raise DprecError(f"make_private needs a Keras model (Keras 3 `import keras`, or tf.keras with "
                   f"TF_USE_LEGACY_KERAS=1 set before TensorFlow is imported), got "
                   f"{type(model).__name__}")


def make_private(model, *, epsilon, train_size, delta=None, batch_size=None, epochs=1,
                 algorithm="auto", ledger=None, l2_norm_clip=None, target_quantile=None,
                 clip_learning_rate=0.2, ratio=config_lib.ADAFEST_RATIO,
                 threshold=config_lib.ADAFEST_THRESHOLD, contribution_clip=1.0,
                 init_output_bias=True, output_bias_share=0.02, recalibrate=None,
                 recalibration_share=0.05, label_range=None, accountant="pld", charge_every=100,
                 secure_noise=False, insecure_noise_seed=None, max_batch_size=None,
                 privacy_unit="row", user_id=None, max_rows_per_user=None):
  """Makes `model` (a Keras 3 `keras.Model` on the TensorFlow backend, or a `tf.keras.Model`:
  functional, Sequential, subclassed, or a TFRS `tfrs.Model` whose `compute_loss` calls a
  `tfrs.tasks.Ranking`) train with (ε, δ)-DP for
  adding or removing one training example, through its ordinary `compile(optimizer, loss,
  metrics)` and `fit(x, y, epochs=...)` (arrays, dicts of arrays, or a finite `tf.data.Dataset`;
  TFRS: features with the label inside). Changes `model` in place and returns it (module
  docstring: what changes, what is refused).

  Args:
    epsilon: ε of everything the run releases (training, output bias, recalibration).
    train_size: N, the number of training examples (public; `fit` refuses other data sizes).
    delta: δ (default 1/N, or the existing ledger's).
    batch_size: expected Poisson batch size B (default: the power of two nearest
      N / 150, `dprec.training.poisson.data_sized_batch_size`: about 150 steps per epoch).
    epochs: epochs the budget is planned for: T = ⌈epochs·N/B⌉ steps; `fit` may train fewer,
      and stops at the budget if asked for more.
    algorithm: "dp_adafest" (sparse updates of the embedding rows a DP contribution map keeps,
      Ghazi et al. 2023), "dp_sgd" (noise on every row), or "auto": DP-SGD when the embedding tables
      hold at most `AUTO_DENSE_LIMIT` (2^20) floats in all, or when a row would need more than
      `AUTO_MAX_TOUCH_SHARE` (a tenth) of a batch's examples to reach τ (an example gives each
      of its k rows C1/√k: `rows_per_example`), else DP-AdaFEST.
    ledger: path of a privacy ledger to charge (shared across runs); default a temporary one.
    l2_norm_clip: C2, the per-example gradient clip (with `target_quantile`: its start);
      default `DEFAULT_CLIP` by the loss: 3 for MSE, 1 otherwise.
    target_quantile: None (C2 fixed), or γ in (0, 1): C2 follows the γ-quantile of the
      per-example gradient norms under DP (adaptive clipping, Andrew et al. 2021, Algorithm 1:
      a noisy count of unclipped examples per step, noise σ_b = max(B/20, σ), its cost taken
      from the gradient's σ so that each step still costs the planned σ;
      `dprec.optimizers.config.QuantileClipping`). `model.dp_optimizer.clip` holds C2.
    clip_learning_rate: η_C of the geometric update C2 ← C2·exp(−η_C·(b̃ − γ)).
    ratio, threshold, contribution_clip: DP-AdaFEST's σ1/σ2, τ and C1 (default `train ctr`'s
      r = 2, τ = 7: τ/σ1 ≈ 3–4 at ε ≈ 1, so noise alone keeps few rows; at r = 5, τ = 5 it kept
      13–17% of every table's rows each step: `benchmarks/make_private_ctr.py`).
    init_output_bias: set the output layer's bias from a DP label statistic before training
      (MSE: mean; binary cross-entropy: logit of the rate; sparse categorical: log class
      frequencies), at `output_bias_share` of ε; a model with `initialise_output(x, y, σ, rng)`
      releases its own statistic there instead (`dprec.models.retrieval.SampledTwoTower`: the
      DP item histogram behind its negatives' distribution and popularity prior).
    recalibrate: after training, fit an affine map of the output under DP (MSE: least squares;
      binary cross-entropy: Platt scaling of the logit) at `recalibration_share` of ε. None
      (default): for binary cross-entropy, and for MSE when a label range is known
      (`label_range`, or `init_output_bias` finds one); True: also refuses, at `compile`, an
      MSE model without one.
    label_range: (lo, hi) public bounds of regression labels (default: found under DP within
      the output bias's share).
    accountant: "pld" or "rdp". charge_every: steps paid per ledger charge.
    secure_noise: exact noise sampling (`dprec.privacy.secure_noise`).
    insecure_noise_seed: public noise seed: reproducible and NOT private (flagged).
    max_batch_size: truncate each Poisson batch to B_max examples (default: exact Poisson); its
      cost, δ_trunc = (1 + e^ε)·P[some step's batch > B_max] (Chua et al. 2024,
      `dprec.privacy.truncation`), is charged to the ledger and taken from training's δ;
      refused where it exceeds a tenth of δ. Row level only.
    privacy_unit: what ε protects: "row" (default: adding or removing one training example) or
      "user" (adding or removing a user with all of their rows; `dprec.workflows.
      private_training`, "User level"). At "user", N, B, δ's default and the plan are over users
      (U, the number of distinct ids, is public as N is): B is the expected users per batch
      (default: the rule above applied to U), T = ⌈epochs·U/B⌉ at q = B/U; each step's sampled
      users bring at most k = `max_rows_per_user` of their rows, drawn by the run's key (a
      user's other rows sit that step out), and the step clips each user's summed gradient to
      C2. The ledger is user-level: `epsilon_spent` and `history.history["epsilon"]` are ε per
      user.
    user_id: at privacy_unit="user", an integer array of train_size non-negative user ids, one
      per training example in the order `fit` receives them (not a model input: the model never
      sees it; give it as a feature as well if the model reads it).
    max_rows_per_user: k (default `dprec.training.user_sampling.DEFAULT_MAX_ROWS_PER_USER`, 16):
      public, never read off the data.

  After `fit`: `history.history["epsilon"]`, `model.epsilon_spent`, `model.privacy_ledger`.
  """
  options = PrivateOptions(
      epsilon=epsilon, train_size=int(train_size), delta=delta, batch_size=batch_size,
      epochs=epochs, algorithm=algorithm, ledger=ledger, l2_norm_clip=l2_norm_clip,
      target_quantile=target_quantile, clip_learning_rate=clip_learning_rate, ratio=ratio,
      threshold=threshold, contribution_clip=contribution_clip,
      init_output_bias=init_output_bias, output_bias_share=output_bias_share,
      recalibrate=recalibrate, recalibration_share=recalibration_share,
      label_range=tuple(label_range) if label_range is not None else None,
      accountant=accountant, charge_every=charge_every, secure_noise=secure_noise,
      insecure_noise_seed=insecure_noise_seed, max_batch_size=max_batch_size,
      privacy_unit=privacy_unit, user_id=None if user_id is None else np.asarray(user_id),
      max_rows_per_user=max_rows_per_user)
  users = options.validate()
  base = _private_base(model)
  if isinstance(model, PrivateTraining):
    raise DprecError(f"model '{model.name}' is already private")
  original = type(model)
  model.__class__ = mixed_class(base, original)
  try:
    model.prepare_private()
    if model.built:
      refuse_unclippable(model)
  except DprecError:
    model.__class__ = original
    raise
  run = run_lib.Run(COMMAND, ledger=options.ledger,
                    insecure_noise_seed=options.insecure_noise_seed,
                    secure_noise=options.secure_noise)
  weakref.finalize(model, run.close)  # removes a temporary ledger
  object.__setattr__(model, "_private", PrivateState(options, run, users=users))
  return model


def _tfrs():
  """The TFRS module if the process imported it (a TFRS model implies it did)."""
  return sys.modules.get("tensorflow_recommenders")


def _ranking_tasks(model):
  tfrs = _tfrs()
  if tfrs is None:
    return []
  return [m for m in model.submodules if isinstance(m, tfrs.tasks.Ranking)]


def _refuse_tfrs_retrieval(model):
  """Refuses a TFRS Retrieval task, and a tfrs.Model without exactly one Ranking task."""
  tfrs = _tfrs()
  if tfrs is None:
    return
  retrieval = [m.name for m in model.submodules if isinstance(m, tfrs.tasks.Retrieval)]
  if retrieval:
    raise DprecError(
        f"make_private refuses tfrs.tasks.Retrieval ({', '.join(retrieval)}): its in-batch "
        "negatives make every example part of every other example's loss, so clipping each "
        "example's gradient does not bound its influence; use dprec's private two-tower "
        "retrieval with negatives sampled independently of the batch")
  if isinstance(model, tfrs.models.Model) and len(_ranking_tasks(model)) != 1:
    raise DprecError(f"make_private supports a tfrs.Model whose compute_loss calls one "
                     f"tfrs.tasks.Ranking; '{model.name}' has {len(_ranking_tasks(model))}")


def row_sparse_optimizer(optimizer):
  """A stock Keras SGD (without momentum), Adagrad or Adam as its row-sparse twin with the same
  hyperparameters; any other optimizer as it is."""
  optimizer = tf.keras.optimizers.get(optimizer)
  twin = ROW_SPARSE.get(type(optimizer))
  if twin is None or (twin is sparse_optimizers.SparseSGD and optimizer.momentum):
    return optimizer
  config = optimizer.get_config()
  for key in ("name", "is_legacy_optimizer", "jit_compile", "momentum", "nesterov", "amsgrad"):
    config.pop(key, None) if key != "amsgrad" or not config.get(key) else None
  return twin.from_config(config)


class PrivateModel(PrivateTraining, DPModel):
  """The private class of a tf.keras model (the TFRS path)."""

  keras_module = tf.keras
  row_sparse = staticmethod(row_sparse_optimizer)

  def prepare_private(self):
    """Refuses a TFRS Retrieval task, mixed and stateful layers; every `tf.keras.layers.
    Embedding` becomes a `DPEmbedding` (`convert_embedding`)."""
    _refuse_tfrs_retrieval(self)
    refuse_stateful(self)
    keras3 = sys.modules.get("keras")
    if keras3 is not None and int(keras3.__version__.split(".")[0]) >= 3:
      refuse_mixed_keras([self, *self.step_layers()], keras3.layers.Layer, "tf.keras", "Keras 3")
    for layer in unique_by_identity(m for m in self.submodules
                                    if type(m) is tf.keras.layers.Embedding):
      convert_embedding(layer)

  def ranking_tasks(self):
    return _ranking_tasks(self)

  # ---- the DP step of a TFRS model: its Ranking task's per-example losses --------------------

  def forward_losses(self, x, y, sample_weight=None):
    tasks = self.ranking_tasks()
    if not tasks:
      return super().forward_losses(x, y, sample_weight)
    records = []
    with recording_task(tasks[0], records), refusing_variable_updates():
      self.compute_loss(dict(x) if isinstance(x, dict) else x, training=True)
    if len(records) != 1:
      raise DprecError(f"compute_loss of '{self.name}' called its Ranking task {len(records)} "
                       "times in one step; make_private needs exactly one call")
    labels, predictions, weights, losses = records[0]
    return (labels, predictions, weights), losses

  def train_step(self, data):
    tasks = self.ranking_tasks()
    if not tasks:
      return super().train_step(data)
    labels, predictions, weights = self.apply_step(data, None, None)
    loss = tasks[0](labels, predictions, sample_weight=weights, compute_metrics=True)
    return dict({m.name: m.result() for m in self.metrics}, loss=loss, **self.clip_logs())
