"""`stream`: streaming online training on the periods of the Criteo streaming job.

Trains the pCTR model period by period as they appear (evaluating each new period before training
on it), one privacy ledger for the whole run, a checkpoint every `checkpoint_every` steps and at
every period's end; rerunning the same options after a crash (or kill -9) resumes where it
stopped (`dprec.training.streaming.StreamingTrainer`). Batches, noise and DP top-k draws come
from the run's secret key (`run_dir/secret`: keep the run directory private);
`insecure_noise_seed` makes them reproducible and the run not private.

The pCTR model streams as `CTRPeriodModel`: tables that grow as the Beam job assigns ids to new
buckets (a new `CTRModel` with more rows; every learned row and optimizer slot carried over, new
rows freshly initialised; the noise generator re-keyed by the trainer at every step from the run's
key), and a DP-FEST row set refreshed at period boundaries (rows stay where they are, so buckets
that stay selected keep what they learned). Embedding widths are fixed by the first period's
vocabulary so rows keep their shape.
"""
import dataclasses
import math
from typing import Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec.errors import DprecError
from dprec.models import ctr
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.training.callbacks import PeriodProgress
from dprec.training.period_source import BeamStreamSource
from dprec.training.streaming import PeriodModel, StreamConfig, StreamingTrainer
from dprec.training.streaming import transfer_variable
from dprec.workflows import ctr as ctr_workflow
from dprec.workflows import plan as plan_lib
from dprec.workflows import run as run_lib

COMMAND = "stream"
# `train ctr`'s options that shape the streamed model and its step.
MODEL_FIELDS = ("algorithm", "l2_norm_clip", "ratio", "threshold", "contribution_clip",
                "learning_rate", "optimizer", "adambc_floor", "hidden_units", "seed")


@dataclasses.dataclass
class StreamOptions(run_lib.RunOptions):
  """Everything `dprec stream` accepts (see `dprec.workflows.stream_cli` for each field)."""
  data: str
  run_dir: str = dataclasses.field(default="stream_run", kw_only=True)
  period_days: int = 1
  train_days: Optional[int] = None
  idle_timeout: float = 0.0
  poll_interval: float = 1.0
  algorithm: str = "dp_adafest"
  epsilon_total: Optional[float] = None
  delta: Optional[float] = None
  expected_periods: Optional[int] = None
  examples_per_period: Optional[int] = None
  epochs_per_period: float = 1.0
  noise_multiplier: Optional[float] = None
  top_k: Optional[int] = None
  top_k_epsilon: float = 0.1
  batch_size: int = 1024
  # The step's hyper-parameters are `train ctr`'s (one source), but τ, lower for short periods.
  l2_norm_clip: float = ctr_workflow.CTRTrainOptions.l2_norm_clip
  ratio: float = ctr_workflow.CTRTrainOptions.ratio
  threshold: float = 1.0
  contribution_clip: float = ctr_workflow.CTRTrainOptions.contribution_clip
  learning_rate: float = ctr_workflow.CTRTrainOptions.learning_rate
  optimizer: str = ctr_workflow.CTRTrainOptions.optimizer
  adambc_floor: float = ctr_workflow.CTRTrainOptions.adambc_floor
  hidden_units: Tuple[int, ...] = ctr_workflow.CTRTrainOptions.hidden_units
  headroom: float = 1.5

  @property
  def private(self):
    return self.algorithm != "non_private"

  def validate(self):
    super().validate()
    if self.private and not (self.epsilon_total or 0) > 0:
      raise DprecError(f"--algorithm {self.algorithm} needs a positive --epsilon-total")
    if self.algorithm in ctr_workflow.FEST_ALGORITHMS and not (self.top_k or 0) > 0:
      raise DprecError(f"--algorithm {self.algorithm} needs --top-k (rows per table)")
    if self.period_days < 1 or (self.train_days is not None and self.train_days < 1):
      raise DprecError("--period-days and --train-days must be positive")
    if self.expected_periods is None and self.train_days is None and self.idle_timeout > 0:
      raise DprecError("a live stream (--idle-timeout > 0) needs --expected-periods (or "
                       "--train-days) so the budget can be planned")

  def model_options(self) -> ctr_workflow.CTRTrainOptions:
    """`train ctr`'s options of the model and its step (algorithm, clips, optimizer, ...)."""
    return ctr_workflow.CTRTrainOptions(data=self.data,
                                        **{k: getattr(self, k) for k in MODEL_FIELDS})


class CTRPeriodModel(PeriodModel):
  """`PeriodModel` of the pCTR model (seed 001 App. D.1.1) trained by `DPModel`'s step.

  Args:
    options: `dprec train ctr`'s options; the algorithm and model/step hyper-parameters are used
      (algorithm, l2_norm_clip, ratio, threshold, contribution_clip, learning_rate, optimizer,
      adambc_floor, hidden_units, eval_batch_size, seed: public, initialisation only).
    noise_multiplier: the plan's composed σ (split into σ1 = r·σ2 and σ2 for DP-AdaFEST).
    expected_batch_size: q · N_period, the normaliser of the noisy sum (DESIGN §4 step 5).
  """

  def __init__(self, options: ctr_workflow.CTRTrainOptions, noise_multiplier: float,
               expected_batch_size: float):
    self.options, self.noise_multiplier = options, noise_multiplier
    self.expected_batch_size = expected_batch_size
    self.model = self.optimizer = self.embedding_dims = None
    self._compiled_for = None  # (model, selected rows) the train step was last compiled for

  def build(self, table_rows: Mapping[str, int]):
    names = tuple(table_rows)
    sizes = tuple(int(table_rows[n]) for n in names)
    if self.embedding_dims is None:
      self.embedding_dims = tuple(ctr.embedding_dim(max(v - 1, 1)) for v in sizes)
    tf.keras.utils.set_random_seed(self.options.seed + sum(sizes))  # fresh rows: reproducible
    model = ctr.build_ctr_model(sizes, table_names=names, embedding_dims=self.embedding_dims,
                                hidden_units=self.options.hidden_units)
    optimizer = ctr_workflow.make_optimizer(self.options)
    optimizer.build(model.trainable_variables)
    if self.model is not None:  # same architecture, so variables correspond by position
      pairs = list(zip(self.model.trainable_variables, model.trainable_variables))
      pairs += list(zip(self.optimizer.variables, optimizer.variables))
      for old, new in pairs:
        transfer_variable(old.numpy(), new)
    self.model, self.optimizer = model, optimizer

  def trackables(self):
    return {"model": self.model, "optimizer": self.optimizer}

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
    def generate():
      for features, labels in batches:
        yield ({ctr.CAT_FEATURES: features[ctr.CAT_FEATURES].astype(np.int32),
                ctr.INT_FEATURES: features[ctr.INT_FEATURES].astype(np.float32)},
               labels.astype(np.int32))

    config = self.model.config
    # A None batch dimension: one trace serves every Poisson batch size (no per-size retrace).
    signature = ({ctr.CAT_FEATURES: tf.TensorSpec([None, len(config.vocab_sizes)], tf.int32),
                  ctr.INT_FEATURES: tf.TensorSpec([None, config.num_integer_features],
                                                  tf.float32)},
                 tf.TensorSpec([None], tf.int32))
    self.model.fit(tf.data.Dataset.from_generator(generate, output_signature=signature),
                   steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[_OnStep(on_step)])

  def evaluate(self, features, labels):
    return ctr.evaluate(self.model, features, labels, self.options.eval_batch_size)


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


def plan_privacy(options: StreamOptions, source, expected: int, run=None) -> plan_lib.PrivacyPlan:
  """One budget over `expected` periods, q from the expected examples per period (default: the
  first period's), composed with what `run`'s ledger spent on the data before (δ: the ledger's,
  else 1 / expected examples; `run_lib.plan_prior`)."""
  per_period = options.examples_per_period
  if per_period is None:
    first = source.period(0)
    if first is None:
      raise DprecError(f"{options.data}: no complete period yet; give --examples-per-period to "
                       "start before the first one arrives")
    per_period = first.examples
  selection = (options.top_k_epsilon
               if options.private and options.algorithm in ctr_workflow.FEST_ALGORITHMS else 0.0)
  epsilon = options.epsilon_total if options.private else math.inf
  delta, spent = run_lib.plan_prior(run, epsilon, options.delta, options.accountant,
                                    default_delta=1.0 / (expected * per_period))
  return plan_lib.plan_stream(
      epsilon, delta, expected, per_period, options.batch_size,
      epochs_per_period=options.epochs_per_period, selection_epsilon=selection,
      noise_multiplier=options.noise_multiplier, accountant=options.accountant, spent=spent)


def build_trainer(options: StreamOptions, source, plan, run) -> StreamingTrainer:
  """The `StreamingTrainer` of `options` on `source` under `plan` in `run`."""
  model = CTRPeriodModel(options.model_options(), plan.noise_multiplier,
                         plan.sampling_rate * plan.examples_per_period)
  config = StreamConfig(
      checkpoint_every=options.checkpoint_every,
      train_periods=None if options.train_days is None else plan.expected_periods,
      idle_timeout=options.idle_timeout, poll_interval=options.poll_interval,
      top_k=options.top_k if options.algorithm in ctr_workflow.FEST_ALGORITHMS else None,
      headroom=options.headroom, diagnostics=options.diagnostics)
  progress = PeriodProgress(plan.steps_per_period, options.diagnostics)
  return StreamingTrainer(model, source, plan, config, run,
                          progress=progress if options.progress else None)


def run(options: StreamOptions) -> dict:
  """Trains (or resumes) the stream; returns the JSON summary (also written to `summary_json`)."""
  options.validate()
  source = BeamStreamSource(options.data, options.period_days, options.train_days)
  expected, expected_from = expected_periods(options, source)
  with run_lib.Run(COMMAND, options.run_dir, options.ledger, options.insecure_noise_seed,
                   options.secure_noise, options.data) as run:
    plan = plan_privacy(options, source, expected, run)
    summary = build_trainer(options, source, plan, run).run()
  summary["algorithm"] = options.algorithm
  summary["expected_periods"], summary["expected_periods_from"] = expected, expected_from
  run_lib.write_summary(summary, options.summary_json)
  return summary
