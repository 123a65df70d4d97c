"""`stream`: streaming online training on the periods of the Criteo streaming job.

Trains the pCTR model period by period as they appear (evaluating each new period before training
on it), one privacy ledger for the whole run, a checkpoint every `checkpoint_every` steps and at
every period's end; rerunning the same options after a crash (or kill -9) resumes where it
stopped (`dprec.training.streaming.StreamingTrainer`). Batches, noise and DP top-k draws come
from the run's secret key (`run_dir/secret`: keep the run directory private);
`insecure_noise_seed` makes them reproducible and the run not private.

What ε protects (`privacy_unit`, README "Privacy model"): a row (the default, for Criteo data:
each row lives in one day, so the periods compose in parallel and ε is the costliest period's,
plus the DP top-k refreshes of the running counts, which compose sequentially) or a user (a
`user_id` column; user-level sampling: every step Poisson-samples users at q = B/U, U the first
period's users, treated as public as a period's row count is, and each sampled user brings at
most `max_rows_per_user` rows, drawn by the run's key and clipped as one; the DP base rate and
DP Platt scaling read at most that many rows of a user; everything composes sequentially, in a
ledger of unit "user").

The options are `StreamOptions` (`dprec.workflows.stream_options`, without TensorFlow). The model
and step are `train ctr`'s, defaults included (`CTRTrainOptions`), and so are its utility levers:
the logit bias starts at the first period's DP base rate, each period ends with DP Platt scaling on
its training rows (charged with that period), kept as an affine a·z + b on the model's output that
evaluation applies and training never sees (so the next period trains the raw logits on). Two
measured differences (docs/experiments/stream_parity.md): without `batch_size` the batch is 1024,
at most an eighth of the expected period size (`default_batch_size`), not `train ctr`'s N/150, and
C2 = 10 (`stream_options.STEP_OVERRIDES`); DP Platt scaling's fit is `train ctr`'s, centred on the
base rate's logit. `reference="non_private"` also trains a non-private stream on the same periods
(under `run_dir/reference_non_private`) for the plot and the summary.

The pCTR model streams as `CTRPeriodModel`: tables that grow as the Beam job assigns ids to new
buckets (a new `CTRModel` with more rows; every learned row and optimizer slot carried over, new
rows freshly initialised; the noise generator re-keyed by the trainer at every step from the run's
key), and a DP-FEST row set refreshed at period boundaries (rows stay where they are, so buckets
that stay selected keep what they learned). Embedding widths are fixed by the first period's
vocabulary so rows keep their shape; every checkpoint records them (`shapes`), and a resumed run
rebuilds them, not widths of its grown tables, before restoring.
"""
import dataclasses
import math
import os
import sys
from typing import Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.errors import DprecError
from dprec.models import ctr
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.privacy_unit import UNIT_KEY, USER_KEY
from dprec.training import poisson
from dprec.training import stream_metrics
from dprec.training.callbacks import PeriodProgress
from dprec.training.period_source import BeamStreamSource
from dprec.training.period_model import PeriodModel, transfer_variable
from dprec.training.stream_config import StreamConfig
from dprec.training.streaming import StreamingTrainer
from dprec.workflows import ctr as ctr_workflow
from dprec.workflows import plan as plan_lib
from dprec.workflows import run as run_lib
from dprec.workflows import run_budget
from dprec.workflows import run_summary
from dprec.workflows.stream_options import REFERENCE_DIR, StreamOptions

COMMAND = "stream"
BASE_RATE = "base rate"  # the plan's once-only mechanism (with the first period)
CALIBRATION = "calibration"  # the plan's per-period mechanism (DP Platt scaling)


class CTRPeriodModel(PeriodModel):
  """`PeriodModel` of the pCTR model (Ghazi et al. 2023, arXiv:2311.08357, App. D.1.1) trained
  by `DPModel`'s step.

  Args:
    options: `dprec train ctr`'s options; the algorithm and model/step hyper-parameters are used
      (algorithm, l2_norm_clip, ratio, threshold, contribution_clip, learning_rate, optimizer,
      adambc_floor, hidden_units, eval_batch_size, seed: public, initialisation only).
    noise_multiplier: the plan's composed σ (split into σ1 = r·σ2 and σ2 for DP-AdaFEST).
    expected_batch_size: q · N_period, the normaliser of the noisy sum (q · U, users, at the
      user level).
    user_level: batches carry `UNIT_KEY` (user-level sampling: the step clips per user).
    calibration_logit_bound: L of DP Platt scaling's fit on z − logit(base rate).
    calibration_prior_examples, calibration_level_prior_examples: n0 and n1, the weights of DP
      Platt scaling's priors towards the base rate on the affine and on the level.
  """

  def __init__(self, options: ctr_workflow.CTRTrainOptions, noise_multiplier: float,
               expected_batch_size: float,
               calibration_logit_bound: float = StreamOptions.calibration_logit_bound,
               calibration_prior_examples: float = StreamOptions.calibration_prior_examples,
               calibration_level_prior_examples: float = (
                   StreamOptions.calibration_level_prior_examples),
               user_level: bool = False):
    self.options, self.noise_multiplier = options, noise_multiplier
    self.user_level = user_level
    self.calibration_logit_bound = calibration_logit_bound
    self.calibration_prior_examples = calibration_prior_examples
    self.calibration_level_prior_examples = calibration_level_prior_examples
    self.expected_batch_size = expected_batch_size
    self.model = self.optimizer = None
    self.embedding_dims = None  # {table: width}, fixed by the first build
    self._compiled_for = None  # (model, selected rows) the train step was last compiled for
    # Released, covered by ε, checkpointed: DP Platt scaling's (a, b) on the output (training
    # never sees it) and the first period's (DP) base rate (0: none).
    self.calibration = tf.Variable([1.0, 0.0], dtype=tf.float64, trainable=False)
    self.base_rate = tf.Variable(0.0, dtype=tf.float64, trainable=False)

  def build(self, table_rows: Mapping[str, int]):
    names = tuple(table_rows)
    sizes = tuple(int(table_rows[n]) for n in names)
    if self.embedding_dims is None:  # fixed when first built, so rows keep their shape
      self.embedding_dims = {n: ctr.embedding_dim(max(v - 1, 1)) for n, v in zip(names, sizes)}
    tf.keras.utils.set_random_seed(self.options.seed + sum(sizes))  # fresh rows: reproducible
    model = ctr.build_ctr_model(sizes, table_names=names,
                                embedding_dims=tuple(self.embedding_dims[n] for n in names),
                                hidden_units=self.options.hidden_units)
    optimizer = ctr_workflow.make_optimizer(self.options, model)
    optimizer.build(model.trainable_variables)
    if self.model is not None:  # same architecture, so variables correspond by position
      pairs = list(zip(self.model.trainable_variables, model.trainable_variables))
      pairs += list(zip(self.optimizer.variables, optimizer.variables))
      for old, new in pairs:
        transfer_variable(old.numpy(), new)
    self.model, self.optimizer = model, optimizer

  def shapes(self):
    """The embedding widths, per table (fixed by the first build, not by the grown rows)."""
    return {"embedding_dims": dict(self.embedding_dims)}

  def set_shapes(self, shapes):
    self.embedding_dims = shapes.get("embedding_dims")

  def shapes_in_checkpoint(self, prefix, table_rows):
    """The widths of the tables `trackables()` saved at `prefix` (model/embedding/tables/i)."""
    saved = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    key = "model/embedding/tables/{}/embeddings/.ATTRIBUTES/VARIABLE_VALUE"
    return {"embedding_dims": {name: saved[key.format(i)][1]
                               for i, name in enumerate(table_rows)}}

  def trackables(self):
    return {"model": self.model, "optimizer": self.optimizer, "calibration": self.calibration,
            "base_rate": self.base_rate}

  def before_training(self, features, labels, releases):
    """The logit layer starts at the (DP) base rate of the first period's labels (`train
    ctr`'s `base_rate`): zero kernel, bias logit(r). A private run without the mechanism
    releases nothing."""
    if self.options.private and BASE_RATE not in releases:
      return {}
    sigma, rng = releases.get(BASE_RATE, (None, None))
    rate = ctr_workflow.base_rate(labels, sigma, rng)
    self.base_rate.assign(rate)
    if self.options.logit_init == "base_rate":
      self.model.logit.kernel.assign(tf.zeros_like(self.model.logit.kernel))
      self.model.logit.bias.assign([math.log(rate / (1 - rate))])
    return {"base_rate": rate}

  def after_training(self, features, labels, releases):
    """DP Platt scaling (`dprec.privacy.dp_platt_scaling`) of the raw logits on the period's
    training rows, towards the base rate r: the affine evaluation applies. The fit reads
    z − logit(r) clipped to ±`calibration_logit_bound` (centring on a released value is
    post-processing), so the narrow logits of a DP model are not a sliver of [−L, L] that the
    fit's noise floor swamps; its priors pull the affine and, harder, the level towards r
    (the fit serves the next period, after the rate moved: docs/experiments/streaming.md)."""
    if CALIBRATION not in releases or not self.base_rate.numpy() > 0:
      return {}
    sigma, rng = releases[CALIBRATION]
    rows = ctr_workflow.calibration_rows(dict(features, label=labels), rng)
    rate = float(self.base_rate.numpy())
    scale, shift = privacy.dp_platt_scaling(
        ctr.predict_logits(self.model, rows, self.options.eval_batch_size), rows["label"], sigma,
        rate, rng, logit_bound=self.calibration_logit_bound, center=math.log(rate / (1 - rate)),
        prior_examples=self.calibration_prior_examples,
        level_prior_examples=self.calibration_level_prior_examples)
    self.calibration.assign([scale, shift])
    return {"calibration_scale": scale, "calibration_shift": shift}

  def noise_generators(self):
    return {"dp step": self.model.dp_optimizer.generator}

  def set_selected_rows(self, selected_rows: Optional[Mapping[str, np.ndarray]]):
    key = (id(self.model), None if selected_rows is None
           else tuple((k, np.asarray(v).tobytes()) for k, v in sorted(selected_rows.items())))
    if key == self._compiled_for:
      return  # same step: keep the traced function (retracing costs seconds)
    self._compiled_for = key
    config = ctr_workflow.algorithm_config(self.options, self.noise_multiplier, selected_rows)
    # A secret generator, re-keyed by the trainer before every step (`noise_generators`).
    self.model.compile(optimizer=DPOptimizer(config, self.optimizer,
                                             expected_batch_size=self.expected_batch_size,
                                             secure_noise=self.options.secure_noise))

  def train_steps(self, batches, steps, on_step):
    units = (UNIT_KEY,) * self.user_level

    def generate():
      for features, labels in batches:
        yield ({ctr.CAT_FEATURES: features[ctr.CAT_FEATURES].astype(np.int32),
                ctr.INT_FEATURES: features[ctr.INT_FEATURES].astype(np.float32),
                **{key: features[key].astype(np.int32) for key in units}},
               labels.astype(np.int32))

    config = self.model.config
    # A None batch dimension: one trace serves every Poisson batch size (no per-size retrace).
    signature = ({ctr.CAT_FEATURES: tf.TensorSpec([None, len(config.vocab_sizes)], tf.int32),
                  ctr.INT_FEATURES: tf.TensorSpec([None, config.num_integer_features],
                                                  tf.float32),
                  **{key: tf.TensorSpec([None], tf.int32) for key in units}},
                 tf.TensorSpec([None], tf.int32))
    self.model.fit(tf.data.Dataset.from_generator(generate, output_signature=signature),
                   steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[_OnStep(on_step)])

  def evaluate(self, features, labels):
    """AUC and log loss of the calibrated output σ(a·z + b), and the base rate's log loss."""
    scale, shift = (float(value) for value in self.calibration.numpy())
    logits = tf.cast(ctr.predict_logits(self.model, features, self.options.eval_batch_size),
                     tf.float64) * scale + shift
    auc = tf.keras.metrics.AUC(num_thresholds=self.model.config.auc_thresholds, from_logits=True)
    auc.update_state(labels, logits)
    loss = tf.nn.sigmoid_cross_entropy_with_logits(labels=np.asarray(labels, np.float64),
                                                   logits=logits)
    rate = float(self.base_rate.numpy())
    return {"auc": float(auc.result()), "loss": float(tf.reduce_mean(loss)),
            "base_rate_log_loss": ctr.log_loss_of_constant(labels, rate) if rate > 0 else None}


class _OnStep(tf.keras.callbacks.Callback):
  """Hands each step's logs to the streaming trainer (journal, progress)."""

  def __init__(self, on_step):
    super().__init__()
    self.on_step = on_step

  def on_train_batch_end(self, batch, logs=None):
    self.on_step({k: float(v) for k, v in (logs or {}).items()})


def expected_periods(options: StreamOptions, source) -> Tuple[int, str]:
  """How many periods the budget must last, and where that number comes from: the options, the
  training periods of `train_days`, or (not a live stream) the days the data holds now."""
  if options.expected_periods:
    return options.expected_periods, "--expected-periods"
  if options.train_days is not None:
    return -(-options.train_days // options.period_days), "--train-days"
  days = source.days_present()
  if not days:
    raise DprecError(f"{options.data}: no complete day yet; give --expected-periods")
  return (-(-len(days) // options.period_days),
          f"the {len(days)} days in {options.data} (not a live stream: --idle-timeout 0)")




def default_batch_size(examples_per_period: int) -> int:
  """B when none is given: `poisson.default_batch_size` (1024, at most an eighth of a period; N
  is public), not `train ctr`'s N/150: σ is calibrated for one period, whose few rows amplify
  less, so σ grows with q faster than on `train ctr`'s whole data set, and on 25k-row periods
  B = 128 (N/150) lost 0.08 AUC to B = 1024 (docs/experiments/stream_parity.md)."""
  return poisson.default_batch_size(examples_per_period)


def users_per_period(options: StreamOptions, source) -> int:
  """U of a user-level stream: the users of the first period, treated as public (as a period's
  number of rows is at the row level)."""
  first = source.period(0)
  if first is None:
    raise DprecError(f"{options.data}: no complete period yet; --privacy-unit user counts the "
                     "users of the first period: start once it has arrived")
  features, _ = first.load()
  if USER_KEY not in features:
    raise DprecError(f"{options.data}: period 0 (days {list(first.days)}): --privacy-unit user "
                     f"needs a '{USER_KEY}' column in the stream's records")
  return int(np.unique(features[USER_KEY]).size)


def plan_privacy(options: StreamOptions, source, expected: int, run=None) -> plan_lib.PrivacyPlan:
  """One budget over `expected` periods, q from the expected units per period (rows: given, or
  the first period's; users: the first period's, `users_per_period`; B of users by the same
  rule), composed with what `run`'s ledger (of the stream's unit) spent on the data before (δ:
  the ledger's, else 1 / expected units; `run_budget.plan_prior`)."""
  per_period = options.examples_per_period
  if options.privacy_unit == "user":
    if per_period is not None:
      raise DprecError("--examples-per-period goes with --privacy-unit row; at the user level "
                       "the number of users per period comes from the first period")
    per_period = users_per_period(options, source)
  if per_period is None:
    first = source.period(0)
    if first is None:
      raise DprecError(f"{options.data}: no complete period yet; give --examples-per-period to "
                       "start before the first one arrives")
    per_period = first.examples
  selection = (options.top_k_epsilon
               if options.private and options.algorithm in ctr_workflow.FEST_ALGORITHMS else 0.0)
  epsilon = options.epsilon_total if options.private else math.inf
  delta, spent = run_budget.plan_prior(run and run.budget, epsilon, options.delta,
                                       options.accountant,
                                       default_delta=1.0 / (expected * per_period),
                                       unit=options.privacy_unit)
  return plan_lib.plan_stream(
      epsilon, delta, expected, per_period,
      options.batch_size or default_batch_size(per_period),
      epochs_per_period=options.epochs_per_period, selection_epsilon=selection,
      noise_multiplier=options.noise_multiplier, accountant=options.accountant, spent=spent,
      privacy_unit=options.privacy_unit, max_rows_per_user=options.max_rows_per_user,
      mechanisms=[(BASE_RATE, options.base_rate_share)],
      period_mechanisms=[(CALIBRATION, options.calibration_share)] * bool(
          options.calibration_share))


def build_trainer(options: StreamOptions, source, plan, run) -> StreamingTrainer:
  """The `StreamingTrainer` of `options` on `source` under `plan` in `run`."""
  model = CTRPeriodModel(options.model_options(), plan.noise_multiplier,
                         plan.sampling_rate * plan.examples_per_period,
                         options.calibration_logit_bound, options.calibration_prior_examples,
                         options.calibration_level_prior_examples,
                         user_level=plan.privacy_unit == "user")
  config = StreamConfig(
      checkpoint_every=options.checkpoint_interval(plan.steps_per_period),
      train_periods=None if options.train_days is None else plan.expected_periods,
      idle_timeout=options.idle_timeout, poll_interval=options.poll_interval,
      top_k=options.top_k if options.algorithm in ctr_workflow.FEST_ALGORITHMS else None,
      headroom=options.headroom, diagnostics=options.diagnostics)
  progress = PeriodProgress(plan.steps_per_period, options.diagnostics)
  return StreamingTrainer(model, source, plan, config, run,
                          progress=progress if options.progress else None,
                          log=_say if options.progress else None)


def _say(line):
  print(f"dprec stream: {line}", file=sys.stderr, flush=True)


def run(options: StreamOptions) -> dict:
  """Trains (or resumes) the stream; returns the JSON summary (also written to `summary_json`).
  Warns, as `train ctr` does, when the last period evaluated has a log loss worse than the
  constant predictor's at its click rate (`ctr.warn_if_worse_than_base_rate`)."""
  summary = _run(options)
  ctr_workflow.warn_if_worse_than_base_rate(summary)
  return summary


def last_evaluation(periods) -> dict:
  """The summary's yardstick fields (`train ctr`'s names) for the last period evaluated (the one
  the result line reports): its log loss, click rate, the constant predictor's log loss at that
  rate, and whether the model is worse (`ctr.base_rate_check`); None before any evaluation."""
  evaluated = [row for row in periods if row.get("auc") is not None]
  last = evaluated[-1] if evaluated else {}
  if last.get("eval_base_rate") is None:  # none yet (or a row of a run from before the field)
    return {"eval_log_loss": None, "eval_base_rate": None, "base_rate_log_loss": None,
            "worse_than_base_rate": None}
  return {"eval_log_loss": last["log_loss"],
          **ctr_workflow.base_rate_check(last["log_loss"], last["eval_base_rate"])}


def _run(options: StreamOptions) -> dict:
  options.validate()
  source = BeamStreamSource(options.data, options.period_days, options.train_days)
  expected, expected_from = expected_periods(options, source)
  with run_lib.Run(COMMAND, options.run_dir, options.ledger, options.insecure_noise_seed,
                   options.secure_noise, options.data) as run:
    plan = plan_privacy(options, source, expected, run)
    summary = build_trainer(options, source, plan, run).run()
  if summary["resumed"] and not summary["trained_now"]:
    _say(f"nothing new to train in {options.run_dir} ({summary['stopped']}); nothing charged")
  summary["algorithm"] = options.algorithm
  summary["expected_periods"], summary["expected_periods_from"] = expected, expected_from
  summary["batch_size"], summary["batch_size_chosen"] = plan.batch_size, not options.batch_size
  summary.update(last_evaluation(summary["periods"]))
  if options.reference:
    summary["reference"] = _reference(options)
    stream_metrics.plot_auc_epsilon(
        summary["periods"], os.path.join(options.run_dir, stream_metrics.PLOT_NAME),
        reference=summary["reference"]["periods"])
  run_summary.write_summary(summary, options.summary_json)
  return summary


def _reference(options: StreamOptions) -> dict:
  """The non-private stream of the same periods and model (`reference`): its per-period AUC and
  log loss, and its hold-out (no privacy: a yardstick, not a release of the private run)."""
  reference = _run(dataclasses.replace(
      options, algorithm="non_private", epsilon_total=None, delta=None, noise_multiplier=None,
      reference=None, ledger=None, summary_json=None, privacy_unit="row",
      max_rows_per_user=None, run_dir=os.path.join(options.run_dir, REFERENCE_DIR)))
  keep = ("period", "eval_period", "auc", "log_loss", "base_rate_log_loss")
  return {"algorithm": "non_private", "run_dir": reference["run_dir"],
          "periods": [{k: row.get(k) for k in keep} for row in reference["periods"]],
          "holdout": reference["holdout"]}
