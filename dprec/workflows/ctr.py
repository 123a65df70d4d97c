"""`train ctr`: the pCTR model on Criteo data with one of the algorithms of Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357.

`data` is a directory of Criteo TSV `day_N` files (vocabularies built in-process from the training
days; the last day is held out for evaluation) or a Beam preprocessing output directory (its
`manifest.json`). σ comes from ε (`dprec.workflows.plan`: σ1, σ2 at ratio r for DP-AdaFEST); the
ledger is charged as training proceeds and training stops at the budget. `run` returns the JSON
summary.

After training, a DP run recalibrates its logits on the training data (DP Platt scaling,
`dprec.privacy.dp_platt_scaling`, `calibration_share` of ε, composed with training in the
accountant): clipping at C2 keeps the ranking but biases the probabilities (BENCHMARKS.md,
"Calibrated DP pCTR").

Without a batch size or steps, both come from the (public) number of training rows N
(`sized_for`): one epoch in about `STEPS_PER_EPOCH` steps at the largest B that allows (at ε ≈ 1
σ hardly grows with B, so the noise on the mean gradient σ·C2/B falls almost as 1/B).

With `out_of_core`, for more rows than memory holds, a Beam job writes the run's Poisson
(or user-level) batches and training streams them; the base rate, DP Platt scaling and the
evaluation are streaming passes (`dprec.workflows.out_of_core`).

What ε protects (`privacy_unit`): a training row, or a user: all rows with one `user_id`, bounded
to k a user (ULS, or ELS + group; in memory and out of core: `dprec.workflows.ctr_users`).

The noise, false positives, Poisson batches, DP top-k draws, the DP base rate and the DP Platt
scaling come from the run's secret key (`dprec.workflows.run.Run`); `seed` seeds only
initialisation. With a run directory the run checkpoints every `checkpoint_every` steps, and the
same options resume a killed run from its last checkpoint on the batches and noise an
uninterrupted run would have used, paying no step twice.
"""
import contextlib
import dataclasses
import json
import math
import os
import tempfile
import warnings
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.data.ctr_data import CTRData, hold_out_validation, load_data
from dprec.distribute import cluster
from dprec.distribute import parameter_server
from dprec.errors import DprecError
from dprec.models import ctr
from dprec.optimizers import config as config_lib
from dprec.optimizers import sparse as sparse_optimizers
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
from dprec.sparse import fest
from dprec.training import callbacks as callbacks_lib
from dprec.training import output_layer
from dprec.training import poisson
from dprec.workflows import ctr_users
from dprec.workflows import out_of_core
from dprec.workflows import plan as plan_lib
from dprec.workflows import run as run_lib
from dprec.workflows import run_budget
from dprec.workflows import run_summary
# The options and the names the command line offers, without TensorFlow (`ctr_options`).
from dprec.workflows.ctr_options import ALGORITHMS, BATCH_SIZE_RANGE  # noqa: F401
from dprec.workflows.ctr_options import (CTRTrainOptions, DEFAULT_LEARNING_RATES,
                                         SELECTION_POINTS)
from dprec.workflows.ctr_options import FEST_ALGORITHMS, LOCAL_CLUSTERS, LOGIT_INITS  # noqa: F401
from dprec.workflows.ctr_options import NON_PRIVATE_TABLE_LEARNING_RATE, OPTIMIZER_NAMES
from dprec.workflows.ctr_options import ROWS_IN_MEMORY, STEPS_PER_EPOCH, STRATEGIES  # noqa: F401

COMMAND = "train ctr"
OPTIMIZERS = dict(zip(OPTIMIZER_NAMES, (
    sparse_optimizers.SparseSGD, sparse_optimizers.SparseAdagrad, sparse_optimizers.LazyAdam,
    sparse_optimizers.AdamBC, sparse_optimizers.TableSGD)))
BASE_RATE_LABEL = "train ctr base rate"
CALIBRATION_LABEL = "train ctr calibration"
# DP Platt scaling fits on `dp_platt_scaling`'s default feature, z clipped to ±10, not `stream`'s
# centred one (docs/experiments/ctr_calibration.md, "The centred feature").
# Below this many rows × ε a DP pCTR model ranks near chance (ctr_utility.md, "Small data").
SMALL_DATA = 50_000
CALIBRATION_ROWS = 1_000_000  # rows DP Platt scaling fits on (BENCHMARKS.md: as good as all)
SELECTION_LABEL = "dp-fest top-k"
VOCABULARY_NOTE = ("vocabularies (and the bucket counts DP-FEST uses with --top-k-epsilon 0) are "
                   "treated as public, as Ghazi et al. 2023 do, unless dataset.vocab_privacy says "
                   "the vocabulary is DP (its epsilon is then in epsilon_parts); build them from "
                   "public data or by DP top-k for a guarantee that covers them")
EPSILON_COVERS = {
    "epsilon": "(epsilon, delta)-DP for adding or removing one training example (row), "
               "covering the model, the DP top-k rows and every field listed under 'covered'",
    "covered": ["auc", "eval_loss", "eval_log_loss", "base_rate", "base_rate_log_loss",
                "eval_base_rate", "worse_than_base_rate",
                "calibration_scale", "calibration_shift", "gradient_size",
                "gradient_size_reduction", "steps", "stopped_at_budget", "validation_auc",
                "validation_log_loss"],
    "public": ["settings", "noise multipliers",
               "train_rows, eval_rows and validation_rows (N, assumed public)",
               "users and bounded_rows (U and N_k = the sum over users of min(rows, k): "
               "assumed public; N_k sets --user-sampling rows' q and, by default, "
               "--user-sampling users' B and T)",
               "dense_embedding_size", "sharded_tables", "timings",
               "resumed_from_step, rerun_steps and fault_epsilon (where faults stopped the run)"],
    "held_out_evaluation": "auc, eval_loss, eval_base_rate (its click rate) and base_rate_log_loss "
                           "(the constant predictor's log loss at that rate) are computed on the "
                           "last day, not training data of this run (that day is not protected); "
                           "validation_auc and validation_log_loss on held-out training rows",
    "not_covered": "diagnostics_nonprivate (only with --diagnostics): exact training loss/AUC",
}


def default_batch_size(num_examples: int) -> int:
  """B when none is given: `poisson.data_sized_batch_size` (N / `STEPS_PER_EPOCH` as a power of
  two within `BATCH_SIZE_RANGE`, at most N/8)."""
  return poisson.data_sized_batch_size(num_examples)


class SmallDataWarning(UserWarning):
  """A DP run with too few training rows for its ε to train a useful model."""


class WorseThanBaseRateWarning(UserWarning):
  """A model whose held-out log loss is worse than the constant predictor's at the held-out
  click rate."""


def base_rate_check(log_loss: float, held_out_rate: float) -> dict:
  """The yardstick of a held-out log loss: the held-out click rate, the log loss of the constant
  predictor at that rate, and whether `log_loss` is worse (the summary fields
  `warn_if_worse_than_base_rate` reads)."""
  constant = ctr.log_loss_of_constant([held_out_rate], held_out_rate)
  return {"eval_base_rate": held_out_rate, "base_rate_log_loss": constant,
          "worse_than_base_rate": bool(log_loss > constant)}


def warn_if_worse_than_base_rate(summary: dict) -> None:
  """Warns (one line) when `summary`'s held-out log loss exceeds `base_rate_log_loss`."""
  if summary["worse_than_base_rate"]:
    warnings.warn(
        f"held-out log loss {summary['eval_log_loss']:.4f} is worse than "
        f"{summary['base_rate_log_loss']:.4f}, the constant predictor's at the held-out click "
        f"rate {summary['eval_base_rate']:.4f}: always predicting that rate would do better "
        "(docs/guide/train_ctr.md, 'Reading the result')",
        WorseThanBaseRateWarning)


def warn_on_small_data(options: CTRTrainOptions, num_examples: int) -> None:
  """Warns when a DP run has fewer than `SMALL_DATA` training rows per unit of ε."""
  if options.private and num_examples * options.epsilon < SMALL_DATA:
    warnings.warn(
        f"{num_examples:,} training rows at ε = {options.epsilon:g}: DP pCTR models with fewer "
        f"than {SMALL_DATA:,} rows per unit of ε measured near chance (`dprec demo --rows 20000`, "
        "13,334 training rows at ε = 1: held-out AUC 0.48; 100,000 rows: 0.69); expect little "
        "better than the base rate, or use more rows or a larger ε", SmallDataWarning)


def sized_for(options: CTRTrainOptions, num_examples: int,
              bounded_rows: Optional[int] = None) -> CTRTrainOptions:
  """`options` with the batch size and steps the user left out filled in from the number of
  training rows N (public, like δ = 1/N): `default_batch_size`, then one epoch ⌈N/B⌉.

  Under ULS `num_examples` is U and `bounded_rows` N_k = Σ_u min(n_u, k) (public, as N is):
  ULS takes ELS's plan on the same data with users as the units, B users = ELS's B rows (at
  most U/8) and T = ELS's T, or one epoch of the users if that is more (sized on U alone, B sat
  at its floor and T = U/B was short: docs/experiments/user_level_ctr.md)."""
  if bounded_rows is None:
    batch_size = options.batch_size or default_batch_size(num_examples)
    steps = max(1, math.ceil(num_examples / batch_size))
  else:
    rows_batch = default_batch_size(bounded_rows)
    batch_size = options.batch_size or poisson.default_batch_size(num_examples, rows_batch)
    steps = max(math.ceil(num_examples / batch_size), math.ceil(bounded_rows / rows_batch))
  return dataclasses.replace(options, batch_size=batch_size, steps=options.steps or steps)


def plan_privacy(options: CTRTrainOptions, num_examples: int, run=None,
                 num_users: Optional[int] = None) -> plan_lib.PrivacyPlan:
  """σ from the target ε (Ghazi et al. 2023, §2.2): DP-SGD's σ at (ε − ε_select, δ, q, T),
  composed with the DP base rate's Gaussian mechanism (σ_b alone at `base_rate_share`·ε), DP
  Platt scaling's (σ_c alone at `calibration_share`·ε; none at 0) and what `run`'s ledger spent
  on the data before (δ: the ledger's, else 1/N; `run_budget.plan_prior`). `num_examples`: what a
  batch samples (N rows; U users under ULS; N_k bounded rows under ELS); at the user level
  (`num_users` U) ε and δ (default 1/U) are per user, on a user-level ledger, and ELS's plan
  accounts a user as a group of k rows (module docstring)."""
  poisson.BatchSampling(options.batch_size).sampling_rate(num_examples)  # refuses B > N
  if not options.private:
    return plan_lib.plan_privacy(math.inf, None, num_examples, options.batch_size, options.steps,
                                 poisson=not options.fixed_batches,
                                 max_batch_size=options.max_batch_size)
  unit = options.privacy_unit if options.user_level else None
  delta, spent = run_budget.plan_prior(run and run.budget, options.epsilon, options.delta,
                                       options.accountant,
                                       default_delta=1.0 / (num_users or num_examples), unit=unit)
  selection = options.top_k_epsilon if options.algorithm in FEST_ALGORITHMS else 0.0
  group = options.user_sampling == "rows" and options.user_level
  plan = plan_lib.plan_privacy(
      options.epsilon, delta, num_examples, options.batch_size, options.steps,
      selection_epsilon=selection,
      mechanisms=[(BASE_RATE_LABEL, options.base_rate_share)]
      + [(CALIBRATION_LABEL, options.calibration_share)] * bool(options.calibration_share),
      accountant=options.accountant, poisson=not options.fixed_batches, spent=spent,
      max_batch_size=options.max_batch_size,
      group_size=options.rows_per_user if group else 1)
  if not options.user_level:
    return plan
  # ULS: the plan's σ are per user; its releases read <= k rows of a user at k·σ.
  return dataclasses.replace(plan, privacy_unit=unit,
                             max_rows_per_user=None if group else options.rows_per_user)


def release_noise_multiplier(plan, label) -> Optional[float]:
  """The noise multiplier, on a row's sensitivity, of the one-off release `label` (None: not
  planned): the plan's, times k under ULS (`PrivacyPlan.release_noise_multiplier`)."""
  sigma = plan.mechanisms.get(label)
  return None if sigma is None else plan.release_noise_multiplier(sigma)


def noise_multipliers(options, noise_multiplier) -> Tuple[Optional[float], Optional[float]]:
  """(σ1, σ2) of a step at composed σ: DP-AdaFEST's split σ1 = r·σ2 (Ghazi et al. 2023, §3.3),
  (None, σ) for the other DP algorithms, (None, None) without DP (`split_noise`)."""
  return config_lib.ALGORITHMS[options.algorithm].split_noise(noise_multiplier, options.ratio)


def base_rate(labels, noise_multiplier, rng) -> float:
  """The training click rate: exact without a `noise_multiplier` (a non-private run); else the
  DP mean of the 0/1 labels (`dprec.privacy.dp_mean`: the Gaussian mechanism on the centred
  label sum, sensitivity 1/2, σ_b = `noise_multiplier`, noise from the run's secret `rng`) over
  the public row count, clipped to [1/N, 1 − 1/N]."""
  return base_rate_of_sum(float(np.sum(labels)), len(labels), noise_multiplier, rng)


def base_rate_of_sum(total, n, noise_multiplier, rng) -> float:
  """`base_rate` from the label sum `total` of n rows (a streaming pass out of core)."""
  rate = privacy.dp_mean_of_sum(total, n, (0.0, 1.0), noise_multiplier or 0.0, rng)
  return float(np.clip(rate, 1.0 / n, 1.0 - 1.0 / n))


def calibration_rows(train, rng):
  """At most `CALIBRATION_ROWS` training rows, drawn uniformly without replacement by `rng`:
  two parameters need no more, and predicting every row of a large set takes minutes. The
  mechanism's sensitivity is per example, so its guarantee does not depend on the count
  (public: min(N, cap))."""
  rows = calibration_indices(len(train["label"]), rng)
  return train if rows is None else {key: values[rows] for key, values in train.items()}


def calibration_indices(n, rng) -> Optional[np.ndarray]:
  """The sorted indices of `calibration_rows` among n rows; None: all of them."""
  if n <= CALIBRATION_ROWS:
    return None
  return np.sort(rng.choice(n, CALIBRATION_ROWS, replace=False))


def recalibrate(model, train, plan, rate, rng, batch_size=8192,
                num_rows=None) -> Tuple[Optional[float], Optional[float]]:
  """Makes `model`'s logits z into a·z + b by DP Platt scaling fitted on the training examples
  `train` from the DP base rate `rate` (`dprec.training.output_layer.recalibrate`, shared with
  `make_private`: `dprec.privacy.dp_platt_scaling` folded into the logit layer), with σ_c from
  the plan (paid with its other one-off releases) and noise from the secret `rng`; returns
  (a, b), or (None, None) when the plan has none. Out of core, `train` is a function of (model,
  sorted row indices or None for all) giving the logits and labels of those of the `num_rows`
  rows in one streaming pass (`out_of_core.Data.logits_and_labels`)."""
  sigma = release_noise_multiplier(plan, CALIBRATION_LABEL)
  if sigma is None:
    return None, None
  if num_rows is None:
    train = calibration_rows(train, rng)
    logits, labels = ctr.predict_logits(model, train, batch_size), train["label"]
  else:
    logits, labels = train(model, calibration_indices(num_rows, rng))
  return output_layer.recalibrate(model.logit, output_layer.BCE, logits, labels, sigma, rng,
                                  prior=rate, logits=True)


def algorithm_config(options, noise_multiplier, selected=None):
  """The `dprec.optimizers.config` object of `options.algorithm` at composed σ (its
  `from_plan`; `selected`: the DP-FEST rows of a preselecting algorithm)."""
  return config_lib.ALGORITHMS[options.algorithm].from_plan(noise_multiplier, options, selected)


def learning_rate(options):
  """`options.learning_rate`, or the default for a private or a non-private run."""
  if options.learning_rate is not None:
    return options.learning_rate
  return DEFAULT_LEARNING_RATES["private" if options.private else "non_private"]


def table_learning_rate(options):
  """`options.table_learning_rate`, or for a private run η = B·(1 − μ)/(80·C2): each example moves
  the rows it reads by 1/80 of its clipped gradient (after momentum's 1/(1 − μ)), whatever B and
  C2 (chosen on validation AUC: docs/experiments/lazy_noise.md)."""
  if options.table_learning_rate is not None:
    return options.table_learning_rate
  if not options.private:
    return NON_PRIVATE_TABLE_LEARNING_RATE
  return options.batch_size * (1.0 - options.momentum) / (80.0 * options.l2_norm_clip)


def make_optimizer(options, model):
  """The row-sparse optimizer of `options.optimizer` at `learning_rate(options)`; `--optimizer
  table_sgd` runs SGD on `model`'s DP table variables (Adam on the rest)."""
  if options.optimizer == "adambc":
    return sparse_optimizers.AdamBC(learning_rate(options), floor=options.adambc_floor)
  if options.optimizer == "table_sgd":
    if not hasattr(options, "table_learning_rate"):
      raise DprecError("--optimizer table_sgd is for train ctr only")
    optimizer = sparse_optimizers.TableSGD(learning_rate(options), table_learning_rate(options),
                                           options.momentum)
    optimizer.train_tables([t.embeddings for t in model.dp_step_tables])
    return optimizer
  return OPTIMIZERS[options.optimizer](learning_rate(options))


def build_model(options, data, plan, run, releases=None):
  """(the compiled pCTR model, the base rate): the logit bias starts at the (DP) base rate (of
  the rows `releases`, default the training rows; out of core an `out_of_core.Data`) and
  DP-FEST's rows are drawn (from every training row's ids), both from the run's key and paid
  once; noise from the run's key."""
  sigma, rng = release_noise_multiplier(plan, BASE_RATE_LABEL), run.key.numpy_rng("base rate")
  if _out_of_core(data):  # `releases`: out_of_core.Data
    releases = data if releases is None else releases
    rate = base_rate_of_sum(releases.label_sum(), releases.train_rows, sigma, rng)
  else:
    rate = base_rate((data.train if releases is None else releases)["label"], sigma, rng)
  tf.keras.utils.set_random_seed(options.seed)
  model = ctr.build_ctr_model(
      data.vocab_sizes, hidden_units=options.hidden_units,
      stack_tables=options.stack_tables or False,
      logit_bias=float(np.log(rate / (1 - rate))) if options.logit_init == "base_rate" else None)
  selection = None
  if options.algorithm in FEST_ALGORITHMS:
    top_k = (options.top_k, options.top_k_epsilon or None, run.key.numpy_rng("dp top-k"))
    selection = (fest.rows_from_counts(dict(zip(model.config.table_names, data.id_counts())),
                                       *top_k) if _out_of_core(data)
                 else fest.rows_from_ids(data.train[ctr.CAT_FEATURES], model.config.table_names,
                                         model.config.vocab_sizes, *top_k))
  config = algorithm_config(options, plan.noise_multiplier, selection and selection.rows)
  model.compile(optimizer=DPOptimizer(config, make_optimizer(options, model),
                                      expected_batch_size=options.batch_size,
                                      noise_key=run.key,
                                      secure_noise=options.secure_noise))
  if options.algorithm == "dp_sgd_lazy":
    model.refuse_what_lazy_noise_cannot_run()  # the step's own refusal, before the ledger is paid
  if run.budget.ledger is not None:  # paid once, before anything they shape is released
    run.budget.pay_once(plan, selection and {SELECTION_LABEL: (selection.epsilon, selection.delta)})
  model.optimizer.build(model.trainable_variables)  # slots now: restorable, traced once
  return model, rate


def run(options: CTRTrainOptions, data: Optional[CTRData] = None) -> dict:
  """Trains (or resumes) and evaluates the pCTR model; returns the JSON summary (also written
  to `options.summary_json` if set). `options.strategy` "mirrored" or "multi_worker": under
  that `tf.distribute` strategy (`dprec.distribute`; every worker runs this with its TF_CONFIG,
  the chief alone charges the ledger and writes checkpoints and the summary);
  `options.local_workers`: starts them on localhost (`run_local_cluster`). "parameter_server":
  the chief trains, scheduling steps on the workers (`dprec.distribute.parameter_server`); a
  worker or ps task of TF_CONFIG serves until the cluster stops; `options.local_workers` and
  `local_ps`: an in-process localhost cluster."""
  if options.strategy == "parameter_server" and cluster.task().get("type") in ("worker", "ps"):
    parameter_server.serve()  # until the cluster is stopped; the chief holds the options
  options.validate()
  options = _out_of_core_by_size(options, data)
  coordinator = None
  if options.strategy == "parameter_server":
    strategy, coordinator = parameter_server.make_strategy(
        parameter_server.in_process_cluster(options.local_workers, options.local_ps)
        if options.local_workers else None, options.min_shard_rows)
  elif options.local_workers:
    return run_local_cluster(options)
  else:
    strategy = cluster.make_strategy(options.strategy)
  if options.out_of_core:
    with out_of_core.workspace(options.run_dir) as base:
      return _train(options, out_of_core.prepare(options.data, base, options.vocab_min_count,
                                                 _beam_args(options), options.user_level),
                    strategy, coordinator, base)
  data = data or load_data(options.data, options.vocab, options.vocab_min_count,
                           user_ids=options.user_level)
  if options.select_on_validation:
    data = hold_out_validation(data, max(1, round(options.select_on_validation
                                                  * len(data.train["label"]))))
  return _train(options, data, strategy, coordinator)


def _out_of_core_by_size(options, data):
  """`options`, out of core if the training rows exceed `out_of_core_above` (estimated without
  reading them) and nothing asked for is in-memory only."""
  if options.out_of_core or data is not None:
    return options
  candidate = dataclasses.replace(options, out_of_core=True)
  try:
    candidate.validate()
  except DprecError:
    return options
  rows = out_of_core.estimated_train_rows(options.data) if os.path.isdir(options.data) else 0
  return candidate if rows > options.out_of_core_above else options


def _out_of_core(data) -> bool:
  return isinstance(data, out_of_core.Data)


def _beam_args(options):
  return out_of_core.beam_args(options.runner, options.dask_workers, options.beam_options)


def _train_rows(data) -> int:
  return data.train_rows if _out_of_core(data) else len(data.train["label"])


def _train(options, data, strategy, coordinator, base=None):
  """`run` on loaded (or, out of core, prepared) data."""
  chief = cluster.is_chief()
  chosen = {"batch_size_chosen": options.batch_size is None, "steps_chosen": options.steps is None}
  users = ctr_users.users(options, data)
  units = ctr_users.sampled_units(options, users, _train_rows(data))
  uls = users is not None and options.user_sampling == "users"
  options = sized_for(options, units, users.bounded_rows if uls else None)
  warn_on_small_data(options, _train_rows(data))
  label = f"{COMMAND} {options.algorithm}"
  with run_lib.Run(COMMAND, options.run_dir, options.ledger, options.insecure_noise_seed,
                   options.secure_noise, options.data, chief=chief) as run:
    plan = plan_privacy(options, units, run, users and users.num_users)
    if run.budget.open_plan_ledger(plan) is not None:
      run.checkpoints.check_ledger_covers(label)
      run.budget.check(plan, label, options.steps, {SELECTION_LABEL: plan.selection_epsilon})
    if _out_of_core(data):  # before anything is paid: another run's batches are refused
      batches, manifest, batch_job, releases = ctr_users.write_batches(
          options, data, base, run, users, _beam_args(options))
    else:
      train, releases = ctr_users.in_memory_rows(options, data, users, run)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
      model, rate = build_model(options, data, plan, run, releases)
    resume = run.checkpoints.resume(model, options, options.keep_checkpoints,
                                    train_rows=_train_rows(data), vocab_sizes=data.vocab_sizes)
    budget = (run.budget.callback(plan, label, resume.step, options.charge_every, options.log_dir)
              if run.budget.ledger is not None else None)
    # Workers of a multi-worker run stop together when the chief stops at the budget.
    extra = [callbacks_lib.SharedStop(strategy)] if options.strategy == "multi_worker" else []
    chooser = None
    if options.select_on_validation:  # non-private: validation log loss every 1/20 of the run
      chooser = callbacks_lib.BestOnValidation(
          lambda m: validation_log_loss(m, data.validation, options.eval_batch_size),
          max(1, options.steps // SELECTION_POINTS))
      extra.append(chooser)
    if options.log_dir and options.diagnostics and chief:  # Keras' scalars: exact loss/AUC
      extra.append(tf.keras.callbacks.TensorBoard(
          os.path.join(options.log_dir, "diagnostics_nonprivate"), update_freq=100))
    # Parameter servers: each scheduled step resets its worker's generator itself.
    timer, callbacks = run.trainer.callbacks(
        {} if coordinator else {NOISE_PURPOSE: model.dp_optimizer.generator}, resume, budget,
        options.checkpoint_interval(options.steps),
        extra, options.progress and chief and f"{COMMAND} {options.algorithm}",
        options.diagnostics)
    if chooser is not None:
      chooser.timer = timer  # training steps/s, without the validation passes
    if _out_of_core(data):
      history = out_of_core.fit(run, model, batches, manifest, options.steps, resume, callbacks,
                                coordinator)
    else:
      features = {key: train[key] for key in (ctr.CAT_FEATURES, ctr.INT_FEATURES)}
      history = run.trainer.fit(model, features, train["label"], options.batch_size,
                                plan.private and plan.poisson, options.steps, resume, callbacks,
                                coordinator, batches=ctr_users.in_memory_batches(
                                    options, features, train, run, resume.step),
                                max_batch_size=options.max_batch_size)
    if chooser is not None:
      chooser.restore(model)
    replicas = (parameter_server.num_workers(strategy) if coordinator
                else model.distribute_strategy.num_replicas_in_sync)
    # Public: the number of tables split over parameter servers (by their public sizes).
    layout = {"sharded_tables": sum(hasattr(t.embeddings, "variables") for t in model.dp_tables)}
    if strategy is not None:  # predict and evaluate on one device: the same on every worker
      model = _local_copy(model)
    if _out_of_core(data):
      calibration = recalibrate(model, releases.logits_and_labels, plan, rate,
                                run.key.numpy_rng("calibration"),
                                options.eval_batch_size, num_rows=releases.train_rows)
      evaluation = model.evaluate(data.eval_dataset(options.eval_batch_size), verbose=0,
                                  return_dict=True)
      held_out = data.eval_label_stats()
    else:
      calibration = recalibrate(model, releases, plan, rate, run.key.numpy_rng("calibration"),
                                options.eval_batch_size)
      evaluation = ctr.evaluate(model, data.eval, data.eval["label"], options.eval_batch_size)
      held_out = len(data.eval["label"]), float(np.mean(data.eval["label"]))
    summary = _summary(options, data, model, plan, history, evaluation, timer, budget, run,
                       resume, rate, calibration, replicas, held_out)
    summary.update(ctr_users.summary_fields(options, users))
    if _out_of_core(data):
      summary.update(out_of_core.summary_fields(batches, manifest, batch_job))
    if data.validation is not None:
      validation = ctr.evaluate(model, data.validation, data.validation["label"],
                                options.eval_batch_size)
      summary.update(validation_auc=float(validation["auc"]),
                     validation_log_loss=float(validation["loss"]),
                     validation_rows=int(len(data.validation["label"])))
    if chooser is not None:
      summary["model_selection"] = {
          "on": "validation log loss (held-out training rows, never the evaluation day)",
          "validation_rows": int(len(data.validation["label"])), "every": chooser.every,
          "best_step": chooser.best_step,
          "validation_log_loss_by_step": {str(s): v for s, v in chooser.scores.items()}}
    summary.update(chosen, **layout if coordinator else {})
  if chief:
    run_summary.write_summary(summary, run_summary.summary_path(options))
    warn_if_worse_than_base_rate(summary)
  return summary


def validation_log_loss(model, validation, batch_size) -> float:
  """The mean log loss (nats) of `model` on the `validation` rows."""
  logits = ctr.predict_logits(model, validation, batch_size)
  labels = validation["label"].astype(np.float64)
  return float(np.mean(np.logaddexp(0.0, logits) - labels * logits))


def _local_copy(model):
  """A copy of a model trained under `tf.distribute`, outside it, compiled for evaluation
  (sharded tables gathered whole)."""
  local = ctr.model_from_config(model.config)
  for target, source in zip(local.dp_tables, model.dp_tables):
    target.embeddings.assign(tf.convert_to_tensor(source.embeddings))
  tables = {id(v) for m in (local, model) for t in m.dp_tables
            for v in [t.embeddings, *getattr(t.embeddings, "variables", [])]}
  for target, source in zip([v for v in local.trainable_variables if id(v) not in tables],
                            [v for v in model.trainable_variables if id(v) not in tables]):
    target.assign(source.numpy())
  local.compile()
  return local


def run_local_cluster(options: CTRTrainOptions) -> dict:
  """`run` on a localhost cluster of `options.local_workers` processes
  (MultiWorkerMirroredStrategy, each told its role by TF_CONFIG; worker 0 is the chief);
  returns the chief's summary. A worker that fails stops the others."""
  with tempfile.TemporaryDirectory(prefix="dprec-workers-") as scratch:
    summary_json = run_summary.summary_path(options)
    if summary_json in (None, run_summary.STDOUT):
      summary_json = os.path.join(scratch, run_summary.SUMMARY_FILE)
    worker = dataclasses.replace(options, local_workers=0, summary_json=summary_json)
    workers = cluster.start_local_workers(
        ["-c", "import sys; from dprec import cli; cli.import_tensorflow_quietly(); "
               "from dprec.workflows import ctr; ctr.run_from_json(sys.argv[1])",
         json.dumps(dataclasses.asdict(worker))], options.local_workers)
    codes = cluster.wait_for_workers(workers)
    if any(codes):
      raise DprecError(f"local workers exited with codes {codes} (worker 0 is the chief); see "
                       "their messages above")
    with open(summary_json, encoding="utf-8") as f:
      return json.load(f)


def run_from_json(text: str) -> dict:
  """`run` with the options of a JSON object (a worker of `run_local_cluster`)."""
  fields = json.loads(text)
  return run(CTRTrainOptions(**dict(fields, hidden_units=tuple(fields["hidden_units"]))))


def _summary(options, data, model, plan, history, evaluation, timer, budget, run, resume, rate,
             calibration, replicas, held_out):
  last = {key: float(values[-1]) for key, values in history.items()}
  sigma1, sigma2 = noise_multipliers(options, plan.noise_multiplier)
  summary = {
      "algorithm": options.algorithm, "auc": float(evaluation["auc"]),
      "eval_loss": float(evaluation["loss"]), "eval_log_loss": float(evaluation["loss"]),
      # held_out: (rows, click rate). The yardstick: the constant predictor at the held-out
      # click rate, on the rows the AUC and log loss are measured on (their status).
      "base_rate": rate, **base_rate_check(float(evaluation["loss"]), held_out[1]),
      "base_rate_noise_multiplier": plan.mechanisms.get(BASE_RATE_LABEL),
      "calibration_scale": calibration[0], "calibration_shift": calibration[1],
      "calibration_noise_multiplier": plan.mechanisms.get(CALIBRATION_LABEL),
      "epsilon_budget": options.epsilon if run.budget.ledger is not None else None,
      "noise_multiplier": plan.noise_multiplier, "sigma1": sigma1, "sigma2": sigma2,
      "selection_epsilon": plan.selection_epsilon, "sampling_rate": plan.sampling_rate,
      "gradient_size": last.get("gradient_size"),
      "gradient_size_reduction": last.get("gradient_size_reduction"),
      "dense_embedding_size": model.config.embedding_parameters,
      "steps": resume.step + timer.steps, "steps_requested": options.steps,
      "resumed_from_step": resume.step,
      # A fault costs no ε: re-run steps were paid once (docs/guide/train_ctr.md, "Faults").
      "rerun_steps": budget.rerun_steps if budget else 0, "fault_epsilon": 0.0,
      "stopped_at_budget": bool(budget and budget.stopped_at_budget),
      "steps_per_second": timer.steps_per_second, "train_seconds": timer.seconds,
      "batch_size": options.batch_size, "max_batch_size": options.max_batch_size,
      "truncation_delta": plan.truncation_delta, "strategy": options.strategy, "replicas": replicas,
      "learning_rate": learning_rate(options), "hidden_units": list(options.hidden_units),
      "table_learning_rate": (table_learning_rate(options) if options.optimizer == "table_sgd"
                              else None),
      "train_rows": _train_rows(data), "eval_rows": int(held_out[0]), "data_source": data.source,
      "run_dir": options.run_dir,
      "note": "; ".join([VOCABULARY_NOTE] + plan.notes),
      **run.summary.privacy(plan, dict(EPSILON_COVERS, epsilon=ctr_users.USER_EPSILON)
                          if options.user_level else EPSILON_COVERS),
  }
  if options.diagnostics:
    summary["diagnostics_nonprivate"] = {
        "train_loss": last.get("loss"), "train_auc": last.get("auc"),
        "note": "NOT covered by ε: exact (unclipped) training loss and AUC of the last steps"}
  return summary
