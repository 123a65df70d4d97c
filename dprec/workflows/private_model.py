"""`dprec.make_private`: one call from an ordinary Keras or TFRS model to one that trains
privately through the ordinary `compile` and `fit` calls.

    model = dprec.make_private(model, epsilon=1.0, train_size=len(y))
    model.compile(optimizer="adagrad", loss="mse", metrics=[...])
    history = model.fit(x, y, epochs=5)          # history.history["epsilon"], model.epsilon_spent

What the call does to `model` (in place; the same object is returned), for a Keras 3 model
(`import keras`, TensorFlow backend) and a tf.keras (Keras 2) one alike, functional,
Sequential or subclassed:
- the model's class becomes a private subclass of its own: `PrivateTraining` (this module:
  plan, compile, fit, output layer) and the DP step of its Keras (`DPModel` for tf.keras,
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
noise, which shrinks its steps, so choose it on validation (a one-epoch pCTR model wanted Adam
1e-2, not Keras' 1e-3: AUC 0.723 against 0.578; the 5-epoch TFRS ranking model wanted 1e-3;
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
covered (exact, non-private diagnostics of the training batches).
"""
import dataclasses
import math
import sys
import warnings
import weakref
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.clipping import registry as registry_lib
from dprec.errors import DprecError
from dprec.layers.embedding import convert_embedding
from dprec.models.dp_model import DPModel
from dprec.models.dp_model import per_example_losses
from dprec.models.dp_model import unique_by_identity
from dprec.models.dp_step import mixed_class
from dprec.models.dp_step import refusing_variable_updates
from dprec.models.dp_step import registry_of
from dprec.models.dp_step import table_variable_ids
from dprec.optimizers import config as config_lib
from dprec.optimizers import sparse as sparse_optimizers
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
from dprec.training import output_layer
from dprec.training import poisson
from dprec.workflows import plan as plan_lib
from dprec.workflows import private_batches
from dprec.workflows import run as run_lib

COMMAND = "make_private"
TRAINING_LABEL = "make_private training"
LABEL_STATISTICS_LABEL = "make_private output bias"
RECALIBRATION_LABEL = "make_private recalibration"
# "auto" and the algorithms that need no rows drawn before training (DP-FEST's top-k).
ALGORITHMS = ("auto",) + tuple(name for name, algorithm in config_lib.ALGORITHMS.items()
                               if algorithm.private and not algorithm.preselected)
# "auto": DP-SGD while dense noise on every row of the DP tables is cheap (Σ V·d up to this many
# floats, the size of a modest Dense layer), DP-AdaFEST above. On the ranking benchmark's small
# tables DP-SGD was better (docs/experiments/make_private.md); AdaFEST pays off in gradient size.
AUTO_DENSE_LIMIT = 1 << 20
# ... and DP-SGD too when DP-AdaFEST could keep only noise: an example gives each of its k rows
# C1/√k of its contribution map, so a row reaches τ only if ⌈τ·√k/C1⌉ examples of the batch touch
# it; above this share of B hardly any row does, and the rows kept are false positives (the
# sampled retriever, k = 203: a random 2.3% of rows, docs/experiments/make_private.md).
AUTO_MAX_TOUCH_SHARE = 0.1
PREDICT_BATCH = 8192
# The default B: `poisson.data_sized_batch_size`, about 150 steps per epoch: per step σ·C2/B falls
# faster than the planned σ grows with B (docs/experiments/make_private.md, "Adaptive clipping
# and the batch").
# The default C2 by loss kind: MSE on a rating scale has per-example norms well above 1, and
# C2 = 1 clips nearly every example and trains towards the label median (same record). Other
# losses keep 1 (not re-measured).
DEFAULT_CLIP = {output_layer.MSE: 3.0}
# σ_b of the quantile count per expected batch example: the noisy unclipped fraction has std
# 1/20 (Andrew et al. 2021 §3: σ_b = m/20); at B = 128 and σ = 0.74 it raises the gradient's σ
# by 0.2%. Never below σ itself (the gradient's σ then grows by at most 15%).
QUANTILE_COUNT_NOISE = 1 / 20
# A stock optimizer's row-sparse twin (`dprec.optimizers.sparse`): the same update, touching
# only the rows of an IndexedSlices gradient.
ROW_SPARSE = {tf.keras.optimizers.SGD: sparse_optimizers.SparseSGD,
              tf.keras.optimizers.Adagrad: sparse_optimizers.SparseAdagrad,
              tf.keras.optimizers.Adam: sparse_optimizers.LazyAdam}
# Adam moves a weight by about its learning rate a step, so by at most ≈ lr·T over T steps. Below
# this, a private model barely leaves its initialisation (the pCTR and TFRS ranking models
# measured in docs/experiments/make_private.md).
SHORT_ADAM_PATH = 0.5


@dataclasses.dataclass
class PrivateOptions:
  """The options of `make_private` (documented there)."""
  epsilon: float
  train_size: int
  delta: Optional[float] = None
  batch_size: Optional[int] = None
  epochs: float = 1
  algorithm: str = "auto"
  ledger: Optional[str] = None
  l2_norm_clip: Optional[float] = None
  target_quantile: Optional[float] = None
  clip_learning_rate: float = 0.2
  ratio: float = config_lib.ADAFEST_RATIO
  threshold: float = config_lib.ADAFEST_THRESHOLD
  contribution_clip: float = 1.0
  init_output_bias: bool = True
  output_bias_share: float = 0.02
  recalibrate: Optional[bool] = None
  recalibration_share: float = 0.05
  label_range: Optional[Tuple[float, float]] = None
  accountant: str = "pld"
  charge_every: int = 100
  secure_noise: bool = False
  insecure_noise_seed: Optional[int] = None
  max_batch_size: Optional[int] = None

  private = True  # the algorithms' `from_plan` reads it

  def validate(self):
    if not self.epsilon > 0 or not math.isfinite(self.epsilon):
      raise DprecError(f"epsilon must be positive and finite, got {self.epsilon}")
    if int(self.train_size) < 1:
      raise DprecError(f"train_size must be a positive number of examples, got "
                       f"{self.train_size}")
    if self.delta is not None and not 0 < self.delta < 1:
      raise DprecError(f"delta must be in (0, 1), got {self.delta}")
    if self.batch_size is not None and not 1 <= self.batch_size <= self.train_size:
      raise DprecError(f"batch_size must be in [1, train_size={self.train_size}], got "
                       f"{self.batch_size}")
    if not self.epochs > 0:
      raise DprecError(f"epochs must be positive, got {self.epochs}")
    if self.algorithm not in ALGORITHMS:
      raise DprecError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got "
                       f"{self.algorithm!r}")
    if self.target_quantile is not None and not 0 < self.target_quantile < 1:
      raise DprecError(f"target_quantile must be in (0, 1) or None, got {self.target_quantile}")
    for name in ("l2_norm_clip", "clip_learning_rate", "ratio", "threshold",
                 "contribution_clip"):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise DprecError(f"{name} must be positive, got {getattr(self, name)}")
    shares = self.output_bias_share * self.init_output_bias + (
        self.recalibration_share * (self.recalibrate is not False))
    if not (0 < self.output_bias_share < 1 and 0 < self.recalibration_share < 1
            and shares < 0.5):
      raise DprecError("output_bias_share and recalibration_share must be in (0, 1) and leave "
                       f"training at least half of epsilon, got {self.output_bias_share}, "
                       f"{self.recalibration_share}")
    if self.label_range is not None and not (len(self.label_range) == 2
                                             and self.label_range[0] < self.label_range[1]):
      raise DprecError(f"label_range must be (lo, hi) with lo < hi, got {self.label_range}")


def rows_per_example(model) -> Optional[int]:
  """Embedding rows an example of `model` looks up in its DP tables: the model's own
  `rows_per_example` if it has one (`SampledTwoTower`), else the ids per example of each table's
  input (None when a table's input shape is not known yet)."""
  declared = getattr(model, "rows_per_example", None)
  if declared is not None:
    return int(declared)
  total = 0
  for table in model.dp_step_tables:
    try:
      shape = tf.TensorShape(table.input_shape)
    except (AttributeError, RuntimeError, ValueError):
      return None
    if shape.rank is None or not shape[1:].is_fully_defined():
      return None
    total += int(np.prod(shape[1:]))  # 1 for ids of shape [batch]
  return total or None


def _private_base(model):
  """The private class of `model`'s Keras: `Keras3PrivateModel` (`dprec.workflows.
  private_keras3`, imported only for a Keras 3 model) or `PrivateModel` (tf.keras)."""
  keras = sys.modules.get("keras")
  if (keras is not None and int(keras.__version__.split(".")[0]) >= 3
      and isinstance(model, keras.Model)):
    from dprec.workflows import private_keras3  # pylint: disable=import-outside-toplevel
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
                 secure_noise=False, insecure_noise_seed=None, max_batch_size=None):
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
      refused where it exceeds a tenth of δ.

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
      insecure_noise_seed=insecure_noise_seed, max_batch_size=max_batch_size)
  options.validate()
  base = _private_base(model)
  if isinstance(model, PrivateTraining):
    raise DprecError(f"model '{model.name}' is already private")
  original = type(model)
  model.__class__ = mixed_class(base, original)
  try:
    model.prepare_private()
    if model.built:
      _refuse_unclippable(model)
  except DprecError:
    model.__class__ = original
    raise
  run = run_lib.Run(COMMAND, ledger=options.ledger,
                    insecure_noise_seed=options.insecure_noise_seed,
                    secure_noise=options.secure_noise)
  weakref.finalize(model, run.close)  # removes a temporary ledger
  object.__setattr__(model, "_private", _State(options, run))
  return model


@dataclasses.dataclass
class _State:
  options: PrivateOptions
  run: run_lib.Run
  plan: Optional[plan_lib.PrivacyPlan] = None
  kind: Optional[str] = None
  logits: bool = False
  steps: int = 0
  fits: int = 0
  initialised: bool = False
  label_range: Optional[Tuple[float, float]] = None
  prior: Optional[float] = None
  recalibration: Optional[Tuple[float, float]] = None


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


def refuse_stateful(model):
  """Refuses trainable BatchNormalization and stateful RNN layers of the model's Keras."""
  keras = model.keras_module
  stateful = [m.name for m in model.step_layers()
              if (isinstance(m, keras.layers.BatchNormalization) and m.trainable)
              or (getattr(m, "stateful", False) is True
                  and not isinstance(m, keras.metrics.Metric))]
  if stateful:
    raise DprecError(f"make_private refuses stateful layer(s) {', '.join(stateful)}: they update "
                     "state from the batch without clipping or noise (freeze a "
                     "BatchNormalization with trainable=False, or use LayerNormalization)")


def refuse_mixed_keras(layers, foreign, model_keras, foreign_keras):
  """Refuses, in one line, `foreign` layers (a class: the other Keras version's Layer) held by
  any of `layers`: neither Keras finds the other's weights, so they would train unclipped or
  not at all."""
  held = []
  for layer in layers:
    for value in vars(layer).values():
      values = value.values() if isinstance(value, dict) else (
          value if isinstance(value, (list, tuple)) else [value])
      held += [v.name for v in values if isinstance(v, foreign)]
  if held:
    raise DprecError(f"make_private cannot train a {model_keras} model holding {foreign_keras} "
                     f"layer(s) {', '.join(sorted(set(held)))}: build every layer with one Keras "
                     "(`import keras` for Keras 3; tf.keras for tf-keras and TFRS models)")


def _refuse_unclippable(model):
  """Refuses trainable weights that no per-example norm function covers (DP tables and the
  clipping registry's layers), naming the innermost layers that hold them."""
  registry = registry_of(model)
  layers = model.step_layers()
  covered = table_variable_ids(model.dp_step_tables)
  covered.update(id(w) for m in layers if registry.is_elem(m) for w in m.trainable_weights)
  registry_lib.refuse_uncovered(layers, model.trainable_weights, covered, registry, COMMAND)


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


def _warn_on_a_short_adam_path(optimizer, steps, adam):
  """Warns when an Adam's (an `adam`, the class of the model's Keras) constant learning rate
  times the planned steps is below `SHORT_ADAM_PATH` (a schedule or another optimizer: no
  warning)."""
  if not isinstance(optimizer, adam):
    return
  if callable(getattr(optimizer, "_learning_rate", None)):  # a schedule
    return
  rate = float(np.asarray(optimizer.learning_rate))
  if rate * steps < SHORT_ADAM_PATH:
    warnings.warn(
        f"Adam at learning rate {rate:g} over the {steps} planned DP steps moves a weight by at "
        f"most about lr·steps = {rate * steps:.2g} in all: under DP noise the model may stay "
        f"near its initialisation (a one-epoch pCTR model: AUC 0.578 at Adam 1e-3, 0.723 at "
        f"1e-2). Choose the learning rate on validation; the models measured in "
        f"docs/experiments/make_private.md wanted lr·steps of about 1 to 3.", stacklevel=3)


def _algorithm_config(options, plan):
  """The DP configuration of the step at the plan's σ: with `target_quantile`, σ is shared
  between the gradient (σ_Δ) and the quantile count (2σ_b), composed back to σ."""
  if options.target_quantile is None:
    return config_lib.ALGORITHMS[options.algorithm].from_plan(plan.noise_multiplier, options)
  quantile = config_lib.QuantileClipping(
      count_noise_multiplier=max(QUANTILE_COUNT_NOISE * plan.batch_size, plan.noise_multiplier),
      target_quantile=options.target_quantile, learning_rate=options.clip_learning_rate)
  sigma = privacy.quantile_gradient_noise_multiplier(plan.noise_multiplier,
                                                     quantile.count_noise_multiplier)
  return dataclasses.replace(config_lib.ALGORITHMS[options.algorithm].from_plan(sigma, options),
                             quantile_clipping=quantile)


class PrivateTraining:
  """What `make_private` adds to a model of either Keras (mixed in first, before the binding's
  DP model class, `DPModel` or `dprec.models.keras3.Keras3DPModel`): the plan, compile, fit with
  Poisson batches and the ledger, the output bias and recalibration. A binding's private class
  gives `keras_module` (tf.keras or keras), `row_sparse(optimizer)` and `prepare_private()`
  (what `make_private` checks and converts before training)."""

  @property
  def privacy_ledger(self):
    """The run's `dprec.privacy.PrivacyLedger` (None before `compile`)."""
    return self._private.run.ledger

  @property
  def epsilon_spent(self) -> float:
    """ε the ledger has been charged (prepaid steps included; 0 before training)."""
    ledger = self.privacy_ledger
    return ledger.epsilon_spent() if ledger is not None else 0.0

  @property
  def privacy_plan(self):
    """The `dprec.workflows.plan.PrivacyPlan` of the run (after `compile`)."""
    return self._private.plan

  def compile(self, optimizer=None, loss=None, metrics=None, **kwargs):  # pylint: disable=arguments-renamed
    """As Keras' `Model.compile`, with a DP step: plans σ for the budget and wraps the
    optimizer (default: Adam at 1e-3) in the algorithm's `DPOptimizer`."""
    state = self._private
    tasks = self.ranking_tasks()
    kind_loss = getattr(tasks[0], "_loss", None) if tasks else loss
    state.kind = output_layer.loss_kind(kind_loss) if kind_loss is not None else None
    state.logits = output_layer.from_logits(kind_loss)
    state.plan = self._plan()
    options = state.options
    if options.algorithm == "auto":
      options = dataclasses.replace(options, algorithm=self._auto_algorithm(options))
    if options.l2_norm_clip is None:
      options = dataclasses.replace(options, l2_norm_clip=DEFAULT_CLIP.get(state.kind, 1.0))
    config = _algorithm_config(options, state.plan)
    adam = self.keras_module.optimizers.Adam
    inner = self.row_sparse(optimizer if optimizer is not None else adam(1e-3))
    _warn_on_a_short_adam_path(inner, state.plan.steps_per_period, adam)
    super().compile(DPOptimizer(config, inner, expected_batch_size=state.plan.batch_size,
                                noise_key=state.run.noise_key,
                                secure_noise=state.options.secure_noise),
                    loss=loss, metrics=metrics, **kwargs)

  def _auto_algorithm(self, options) -> str:
    """"auto"'s choice: DP-SGD for small tables (`AUTO_DENSE_LIMIT`) or when a row would need
    more than `AUTO_MAX_TOUCH_SHARE` of a batch's examples to reach τ; else DP-AdaFEST."""
    if self.dense_embedding_size <= AUTO_DENSE_LIMIT:
      return "dp_sgd"
    rows = rows_per_example(self)
    needed = options.threshold * math.sqrt(rows or 1) / options.contribution_clip
    return "dp_sgd" if needed > AUTO_MAX_TOUCH_SHARE * self._private.plan.batch_size else (
        "dp_adafest")

  @staticmethod
  def _recalibrates(options, kind):
    """Whether the run plans a recalibration (`make_private`'s `recalibrate`)."""
    if options.recalibrate is False or kind not in (output_layer.MSE, output_layer.BCE):
      return False
    has_range = options.label_range is not None or options.init_output_bias
    if kind == output_layer.MSE and not has_range:
      if options.recalibrate:
        raise DprecError("recalibrating a regression model needs a label range: give "
                         "label_range, or keep init_output_bias on (it finds one under DP)")
      return False
    return True

  def _plan(self):
    state, options = self._private, self._private.options
    n = options.train_size
    batch_size = options.batch_size or poisson.data_sized_batch_size(n)
    steps = max(1, math.ceil(options.epochs * n / batch_size))
    mechanisms = []
    if options.init_output_bias and state.kind is not None:
      mechanisms.append((LABEL_STATISTICS_LABEL, options.output_bias_share))
    if self._recalibrates(options, state.kind):
      mechanisms.append((RECALIBRATION_LABEL, options.recalibration_share))
    delta, spent = run_lib.plan_prior(state.run, options.epsilon, options.delta,
                                      options.accountant, default_delta=1.0 / n)
    plan = plan_lib.plan_privacy(options.epsilon, delta, n, batch_size, steps,
                                 mechanisms=mechanisms, accountant=options.accountant,
                                 spent=spent, max_batch_size=options.max_batch_size)
    state.run.open_plan_ledger(plan)
    state.run.check_budget(plan, TRAINING_LABEL, steps)
    return plan

  # ---- fit -----------------------------------------------------------------------------------

  def write_batches(self, files, directory, parse=None, beam_args=()):
    """Writes this run's Poisson batches of the TFRecord `files` (N = `train_size` records in
    all) into `directory` with a Beam job (`beam_args`: e.g. `["--runner", "DaskRunner"]`) and
    returns them for `fit` (`dprec.workflows.private_batches`: how, and why `fit` takes no
    batches made elsewhere). `parse`: serialized records → (x, y), or x for a TFRS model
    (default: the rows of `dprec preprocess criteo`)."""
    if self._private.plan is None:
      raise DprecError("compile the private model before write_batches: the batches are drawn "
                       "for its plan")
    return private_batches.write(self._private.run, self._private.plan, files, directory, parse,
                                 beam_args)

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
          validation_data=None, sample_weight=None, **kwargs):  # pylint: disable=arguments-differ
    """As Keras' `Model.fit`, with `epochs` of ⌈N/B⌉ DP steps each; stops at the budget. `x`:
    in-memory data (arrays, dicts, or a finite dataset, loaded into memory for Poisson
    sampling), or this run's batches on disk (`write_batches`, or their directory), streamed
    from the next step not taken, stopping after the last planned one (with a warning when
    `epochs` asked for more). The first call initialises the output bias under DP; with
    `recalibrate`, the call that completes the planned steps recalibrates the output."""
    state = self._private
    if state.plan is None:
      raise DprecError("compile the private model before fit")
    unsupported = {k: v for k, v in kwargs.items() if v is not None and k in (
        "steps_per_epoch", "class_weight", "validation_split", "shuffle")}
    if sample_weight is not None or unsupported:
      refused = ["sample_weight"] * (sample_weight is not None) + list(unsupported)
      raise DprecError(f"make_private's fit does not take {', '.join(refused)}"
                       ": per-example weights would change the sensitivity, and batches are "
                       "Poisson-sampled from the whole training set")
    kwargs.pop("shuffle", None)  # None: the batches are Poisson samples (refused otherwise)
    if batch_size is not None and batch_size != state.plan.batch_size:
      raise DprecError(f"fit(batch_size={batch_size}) differs from the planned batch size "
                       f"{state.plan.batch_size}: give batch_size to make_private")
    on_disk = private_batches.as_batches(x)
    if on_disk is None:
      dataset, statistics = self._in_memory_batches(x, y, epochs)
    else:
      dataset, statistics = self._batches_on_disk(on_disk, y)
    if not state.initialised:
      self._initialise(*statistics())
    budget = state.run.budget_callback(state.plan, TRAINING_LABEL, state.steps,
                                       state.options.charge_every,
                                       steps_held=None if on_disk is None else state.plan.steps)
    fit_callbacks = [state.run.noise_callback({NOISE_PURPOSE: self.dp_optimizer.generator},
                                              start_step=state.steps), budget,
                     *(callbacks or [])]
    state.fits += 1
    start = budget.steps_taken
    steps_per_epoch = math.ceil(state.options.train_size / state.plan.batch_size)
    try:
      history = super().fit(dataset, epochs=epochs, steps_per_epoch=steps_per_epoch,
                            verbose=verbose, callbacks=fit_callbacks, shuffle=False,
                            validation_data=validation_data, **kwargs)
    finally:
      state.steps += budget.steps_taken - start
    if on_disk is not None and state.steps == state.plan.steps < start + epochs * steps_per_epoch:
      warnings.warn(private_batches.used_up(on_disk, state.plan.steps, start,
                                            epochs * steps_per_epoch), stacklevel=2)
    if (state.recalibration is None
        and state.steps >= state.plan.steps and RECALIBRATION_LABEL in state.plan.mechanisms):
      self._recalibrate(*statistics())
    return history

  def _in_memory_batches(self, x, y, epochs):
    """(Poisson batches of in-memory data for `epochs` epochs, () → (features, labels,
    structure) of all of it)."""
    state = self._private
    features, labels, structure = _in_memory(x, y)
    n = len(next(iter(features.values())))
    if n != state.options.train_size:
      raise DprecError(f"fit got {n} training examples but make_private was planned for "
                       f"train_size={state.options.train_size}")
    sampling = poisson.BatchSampling(state.plan.batch_size, True,
                                     state.run.entropy("poisson", state.fits),
                                     state.plan.max_batch_size)
    dataset = poisson.sampled_dataset(features, labels, sampling,
                                      epochs * math.ceil(n / state.plan.batch_size))
    return (dataset.map(_packer(structure, labels is not None)),
            lambda: (features, labels, structure))

  def _batches_on_disk(self, batches, y):
    """(this run's batches on disk from the next step, () → (features, labels, structure) of
    the statistic sample: `private_batches`)."""
    state = self._private
    if y is not None:
      raise DprecError("fit on Poisson batches takes no y: `parse` returns each record's (x, y)")
    if state.steps >= state.plan.steps:
      raise DprecError(f"{batches.directory}: all {state.plan.steps} planned steps are trained")
    manifest = private_batches.checked_manifest(state.run, state.plan, batches, state.steps)

    def statistics():  # the same sample at every call: drawn from the key
      sample = private_batches.statistic_sample(batches, manifest,
                                                state.run.numpy_rng("statistic sample"))
      return _in_memory(*(sample if isinstance(sample, tuple) else (sample, None)))

    return private_batches.dataset(batches, manifest, state.steps), statistics

  def _pack(self, features, structure):
    return tf.nest.pack_sequence_as(structure, [features[k] for k in _keys(structure)])

  def _labels_and_predictions(self, features, labels, structure):
    """(labels, predictions) over the training examples, in order (a TFRS model's labels are
    what its compute_loss gives its Ranking task)."""
    tasks = self.ranking_tasks()
    n = len(next(iter(features.values())))
    if not tasks:
      predictions = self.predict(self._pack(features, structure), batch_size=PREDICT_BATCH,
                                 verbose=0)
      return np.asarray(labels), np.asarray(predictions)
    found, predicted = [], []
    for start in range(0, n, PREDICT_BATCH):
      batch = self._pack({k: v[start:start + PREDICT_BATCH] for k, v in features.items()},
                         structure)
      records = []
      with _recording_task(tasks[0], records):
        self.compute_loss(dict(batch) if isinstance(batch, dict) else batch, training=False)
      found.append(records[-1][0].numpy())
      predicted.append(records[-1][1].numpy())
    return np.concatenate(found), np.concatenate(predicted)

  def _output_layer(self, features, structure):
    sample = self._pack({k: v[:2] for k, v in features.items()}, structure)
    return output_layer.output_dense(self, sample, self.step_layers(),
                                     self.keras_module.layers.Dense)

  def _initialise(self, features, labels, structure):
    """Builds the model, refuses unclippable layers, pays the plan's one-off releases, and sets
    the output bias from the DP label statistic."""
    state = self._private
    # Built on a batch of unknown size, as the DP step will call it (a Sequential built lazily
    # on one batch size would rebuild itself inside the step, calling its layers twice).
    specs = {k: tf.TensorSpec((None,) + v.shape[1:], tf.as_dtype(v.dtype))
             for k, v in features.items()}
    tf.function(lambda batch: self(self._pack(batch, structure), training=False)
                ).get_concrete_function(specs)
    # A model may release its own output statistics (`initialise_output(x, y, σ, rng)`: one
    # Gaussian release of L2 sensitivity 1 per example, e.g. `SampledTwoTower`'s item histogram).
    custom = getattr(self, "initialise_output", None)
    # Found before anything is paid, where the bias or the recalibration will set it.
    releases_output = {LABEL_STATISTICS_LABEL, RECALIBRATION_LABEL} & set(state.plan.mechanisms)
    layer = (self._output_layer(features, structure)
             if state.kind and not custom and releases_output else None)
    _refuse_unclippable(self)
    # Slots in the model's variable order (the DP step's is another): `save` and `load_model`
    # of the original class agree on them.
    self.optimizer.build(self.trainable_variables)
    state.run.pay_once(state.plan)  # before anything they shape is released
    state.initialised = True
    sigma = state.plan.mechanisms.get(LABEL_STATISTICS_LABEL)
    if sigma is None:
      return
    if custom is not None:
      custom(self._pack(features, structure), labels, sigma, state.run.numpy_rng("output bias"))
      return
    true_labels, _ = (self._labels_and_predictions(features, labels, structure)
                      if labels is None else (labels, None))
    rng = state.run.numpy_rng("output bias")
    state.label_range = state.options.label_range
    releases = 1
    if state.kind == output_layer.MSE and state.label_range is None:
      releases = 2  # the range and the mean, each at σ·√2 (`dprec.privacy.label_stats`)
      state.label_range = output_layer.privacy.dp_label_range(true_labels,
                                                              sigma * math.sqrt(2), rng)
    bias = output_layer.initial_bias(state.kind, true_labels, sigma * math.sqrt(releases), rng,
                                     num_classes=layer.units, label_range=state.label_range)
    output_layer.set_bias(layer, bias)
    if state.kind == output_layer.BCE:
      state.prior = float(1 / (1 + np.exp(-bias[0])))

  def _recalibrate(self, features, labels, structure):
    state = self._private
    layer = self._output_layer(features, structure)
    true_labels, predictions = self._labels_and_predictions(features, labels, structure)
    state.recalibration = output_layer.recalibrate(
        layer, state.kind, predictions, true_labels,
        state.plan.mechanisms[RECALIBRATION_LABEL], state.run.numpy_rng("recalibration"),
        prior=state.prior if state.prior is not None else 0.5,
        label_range=state.label_range, logits=state.logits)

  def ranking_tasks(self):
    """The model's TFRS Ranking tasks (none but in a tf.keras TFRS model)."""
    return []


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
                                    if type(m) is tf.keras.layers.Embedding):  # pylint: disable=unidiomatic-typecheck
      convert_embedding(layer)

  def ranking_tasks(self):
    return _ranking_tasks(self)

  # ---- the DP step of a TFRS model: its Ranking task's per-example losses --------------------

  def forward_losses(self, x, y, sample_weight=None):
    tasks = self.ranking_tasks()
    if not tasks:
      return super().forward_losses(x, y, sample_weight)
    records = []
    with _recording_task(tasks[0], records), refusing_variable_updates():
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


class _recording_task:  # pylint: disable=invalid-name
  """While active, a Ranking task's calls record (labels, predictions, sample weights,
  per-example losses) and compute no metrics (their updates would be batch state)."""

  def __init__(self, task, records):
    self.task, self.records = task, records

  def __enter__(self):
    task, records = self.task, self.records

    def call(labels, predictions, sample_weight=None, training=False, compute_metrics=True):
      del training, compute_metrics
      losses = per_example_losses(task._loss, labels, predictions, sample_weight)  # pylint: disable=protected-access
      records.append((labels, predictions, sample_weight, losses))
      return tf.reduce_mean(losses)

    object.__setattr__(task, "call", call)
    return self

  def __exit__(self, *exc):
    object.__delattr__(self.task, "call")


def _keys(structure):
  return [f"input_{i}" for i in range(len(tf.nest.flatten(structure)))]


def _packer(structure, with_labels):
  keys = _keys(structure)

  def pack(features, labels=None):
    packed = tf.nest.pack_sequence_as(structure, [features[k] for k in keys])
    return (packed, labels) if with_labels else packed

  return pack


def _in_memory(x, y):
  """(features {input_i: array}, labels or None, the structure of x) of in-memory data or a
  finite dataset of (x, y) or of features (a TFRS model's, labels inside)."""
  if isinstance(x, tf.data.Dataset):
    if y is not None:
      raise DprecError("give y inside the dataset, not beside it")
    dataset = x
    leaves = tf.nest.flatten(dataset.element_spec)
    if not all(spec.shape.rank and spec.shape[0] is None for spec in leaves):
      dataset = dataset.batch(PREDICT_BATCH)  # unbatched elements
    parts = list(dataset.as_numpy_iterator())
    if not parts:
      raise DprecError("the training dataset is empty")
    element = tf.nest.map_structure(lambda *a: np.concatenate(a), *parts)
    if isinstance(element, tuple) and len(element) == 2:
      x, y = element
    elif isinstance(element, tuple) and len(element) == 3:
      raise DprecError("make_private's fit does not take sample weights")
    else:
      x = element
  leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(x)]
  if not leaves:
    raise DprecError("fit needs training features")
  structure = tf.nest.map_structure(lambda _: 0, x)
  features = dict(zip(_keys(structure), leaves))
  for key, leaf in features.items():
    if leaf.dtype.kind in "OU":  # str → bytes, which tf.data holds as tf.string
      features[key] = leaf.astype(bytes)
  return features, (None if y is None else np.asarray(y)), structure
