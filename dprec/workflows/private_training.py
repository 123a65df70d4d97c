"""`PrivateTraining`, what `dprec.make_private` adds to a model of either Keras: the privacy plan
(`dprec.workflows.plan`), `compile` with the algorithm's `DPOptimizer`, `fit` on Poisson batches
drawn with the run's secret key (or the run's batches on disk) charging the ledger, the output
bias from a DP label statistic before training and the DP recalibration after it; and the
refusals both Kerases share.

User level (`privacy_unit="user"`): the plan is over the U users, `fit` trains on user-level
batches and the one-off releases read at most k rows per user at k times the planned σ
(`dprec.workflows.private_users`: what is protected, and why ε is per user)."""
import dataclasses
import math
import warnings
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.clipping import registry as registry_lib
from dprec.errors import DprecError
from dprec.models.dp_model import per_example_losses
from dprec.models.dp_step import registry_of
from dprec.models.dp_step import table_variable_ids
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
from dprec.training import output_layer
from dprec.training import poisson
from dprec.training import user_sampling
from dprec.training.callbacks import KeyedNoiseCallback
from dprec.workflows import plan as plan_lib
from dprec.workflows import private_batches
from dprec.workflows import private_inputs
from dprec.workflows import private_users
from dprec.workflows import run as run_lib
from dprec.workflows import run_budget
from dprec.workflows.private_options import (
    AUTO_DENSE_LIMIT, AUTO_MAX_TOUCH_SHARE, COMMAND, DEFAULT_CLIP, LABEL_STATISTICS_LABEL,
    PREDICT_BATCH, QUANTILE_COUNT_NOISE, RECALIBRATION_LABEL, SHORT_ADAM_PATH, TRAINING_LABEL,
    PrivateOptions)


@dataclasses.dataclass
class PrivateState:
  """What a private model carries between compile and fit calls (`model._private`)."""
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
  users: Optional[user_sampling.UserRows] = None  # the rows grouped by user, at user level

  @property
  def units(self) -> int:
    """What a batch samples and ε protects: N rows, or U users at user level."""
    return self.options.train_size if self.users is None else self.users.num_users


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


def refuse_unclippable(model):
  """Refuses trainable weights that no per-example norm function covers (DP tables and the
  clipping registry's layers), naming the innermost layers that hold them."""
  registry = registry_of(model)
  layers = model.step_layers()
  covered = table_variable_ids(model.dp_step_tables)
  covered.update(id(w) for m in layers if registry.is_elem(m) for w in m.trainable_weights)
  registry_lib.refuse_uncovered(layers, model.trainable_weights, covered, registry, COMMAND)


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
    return self._private.run.budget.ledger

  @property
  def epsilon_spent(self) -> float:
    """ε the ledger has been charged (prepaid steps included; 0 before training)."""
    ledger = self.privacy_ledger
    return ledger.epsilon_spent() if ledger is not None else 0.0

  @property
  def privacy_plan(self):
    """The `dprec.workflows.plan.PrivacyPlan` of the run (after `compile`)."""
    return self._private.plan

  def compile(self, optimizer=None, loss=None, metrics=None, **kwargs):
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
                                noise_key=state.run.key,
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
    n = state.units  # U users at user level: public, as N
    batch_size = options.batch_size or poisson.data_sized_batch_size(n)
    steps = max(1, math.ceil(options.epochs * n / batch_size))
    mechanisms = []
    if options.init_output_bias and state.kind is not None:
      mechanisms.append((LABEL_STATISTICS_LABEL, options.output_bias_share))
    if self._recalibrates(options, state.kind):
      mechanisms.append((RECALIBRATION_LABEL, options.recalibration_share))
    delta, spent = run_budget.plan_prior(state.run.budget, options.epsilon, options.delta,
                                         options.accountant, default_delta=1.0 / n,
                                         unit=options.privacy_unit)
    plan = plan_lib.plan_privacy(options.epsilon, delta, n, batch_size, steps,
                                 mechanisms=mechanisms, accountant=options.accountant,
                                 spent=spent, max_batch_size=options.max_batch_size)
    if state.users is not None:
      plan = dataclasses.replace(plan, privacy_unit=options.privacy_unit)
    state.run.budget.open_plan_ledger(plan)
    state.run.budget.check(plan, TRAINING_LABEL, steps)
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
    if self._private.users is not None:
      raise DprecError("write_batches draws row-level Poisson batches; at privacy_unit='user' "
                       "fit trains on in-memory data")
    return private_batches.write(self._private.run, self._private.plan, files, directory, parse,
                                 beam_args)

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
          validation_data=None, sample_weight=None, **kwargs):
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
    if on_disk is not None and state.users is not None:
      raise DprecError("fit at privacy_unit='user' trains on in-memory data, not on Poisson "
                       "batches on disk (they sample rows, not users)")
    if on_disk is None:
      dataset, statistics = self._in_memory_batches(x, y, epochs)
    else:
      dataset, statistics = self._batches_on_disk(on_disk, y)
    if not state.initialised:
      self._initialise(*statistics())
    budget = state.run.budget.callback(state.plan, TRAINING_LABEL, state.steps,
                                       state.options.charge_every,
                                       steps_held=None if on_disk is None else state.plan.steps)
    fit_callbacks = [KeyedNoiseCallback(state.run.key, {NOISE_PURPOSE: self.dp_optimizer.generator},
                                        start_step=state.steps), budget,
                     *(callbacks or [])]
    state.fits += 1
    start = budget.steps_taken
    steps_per_epoch = math.ceil(state.units / state.plan.batch_size)
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
    structure) of all of it); at user level, user-level batches and at most k rows per user
    (`private_users`)."""
    state = self._private
    features, labels, structure = private_inputs.in_memory(x, y)
    n = len(next(iter(features.values())))
    if n != state.options.train_size:
      raise DprecError(f"fit got {n} training examples but make_private was planned for "
                       f"train_size={state.options.train_size}")
    steps = epochs * math.ceil(state.units / state.plan.batch_size)
    if state.users is not None:
      k = state.options.rows_per_unit
      sampling = user_sampling.UserSampling(state.plan.batch_size, k,
                                            state.run.key.entropy("user poisson", state.fits))
      dataset = private_users.batches(features, labels, structure, state.options.user_id,
                                      sampling, steps)
      return dataset, lambda: (*private_users.statistic_rows(
          features, labels, state.users, k, state.run.key.numpy_rng("user statistic rows")),
                               structure)
    sampling = poisson.BatchSampling(state.plan.batch_size, True,
                                     state.run.key.entropy("poisson", state.fits),
                                     state.plan.max_batch_size)
    dataset = poisson.sampled_dataset(features, labels, sampling, steps)
    return (dataset.map(private_inputs.packer(structure, labels is not None)),
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
                                                state.run.key.numpy_rng("statistic sample"))
      return private_inputs.in_memory(*(sample if isinstance(sample, tuple) else (sample, None)))

    return private_batches.dataset(batches, manifest, state.steps), statistics

  def _pack(self, features, structure):
    names = private_inputs.keys(structure)
    return tf.nest.pack_sequence_as(structure, [features[k] for k in names])

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
      with recording_task(tasks[0], records):
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
    refuse_unclippable(self)
    if state.users is not None:
      private_users.check_step(self, features, labels, structure)
    # Slots in the model's variable order (the DP step's is another): `save` and `load_model`
    # of the original class agree on them.
    self.optimizer.build(self.trainable_variables)
    state.run.budget.pay_once(state.plan)  # before anything they shape is released
    state.initialised = True
    sigma = state.plan.mechanisms.get(LABEL_STATISTICS_LABEL)
    if sigma is None:
      return
    sigma *= state.options.rows_per_unit  # per row: a user's k rows move it k times as far
    if custom is not None:
      custom(self._pack(features, structure), labels, sigma, state.run.key.numpy_rng("output bias"))
      return
    true_labels, _ = (self._labels_and_predictions(features, labels, structure)
                      if labels is None else (labels, None))
    rng = state.run.key.numpy_rng("output bias")
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
        state.plan.mechanisms[RECALIBRATION_LABEL] * state.options.rows_per_unit,
        state.run.key.numpy_rng("recalibration"),
        prior=state.prior if state.prior is not None else 0.5,
        label_range=state.label_range, logits=state.logits)

  def ranking_tasks(self):
    """The model's TFRS Ranking tasks (none but in a tf.keras TFRS model)."""
    return []


class recording_task:
  """While active, a Ranking task's calls record (labels, predictions, sample weights,
  per-example losses) and compute no metrics (their updates would be batch state)."""

  def __init__(self, task, records):
    self.task, self.records = task, records

  def __enter__(self):
    task, records = self.task, self.records

    def call(labels, predictions, sample_weight=None, training=False, compute_metrics=True):
      del training, compute_metrics
      losses = per_example_losses(task._loss, labels, predictions, sample_weight)
      records.append((labels, predictions, sample_weight, losses))
      return tf.reduce_mean(losses)

    object.__setattr__(task, "call", call)
    return self

  def __exit__(self, *exc):
    object.__delattr__(self.task, "call")
