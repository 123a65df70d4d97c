"""`dprec audit`: an empirical ε lower bound for a `train ctr` configuration, from canaries.

    dprec audit --data DIR --algorithm dp_adafest --epsilon 2                 # black box
    dprec audit --data DIR --algorithm dp_sgd --epsilon 2 --threat-model white_box

--threat-model black_box (the final model): per run, m fresh-row canaries (`canaries.py`), a
random half inserted into the training days, the pCTR model trained with the real DP step
(`DPModel` + `DPOptimizer`, planned from --epsilon as `train ctr` plans it), every canary scored
on the final model (`scores.py`: alignment, movement and loss drop of its rows). DP-AdaFEST is
audited as it runs: a canary row moves only if its noisy count passes τ or it is drawn as a
false positive, and then by its clipped gradient plus noise.

--threat-model white_box (every step's release, Nasr et al. 2023): Dirac gradient canaries on
rows only they touch go through the same DP step at the configuration's q, T, σ, clip,
threshold and normaliser, and the adversary reads every released update (`white_box.py`).

--privacy-unit user [--max-rows-per-user k] audits user-level DP (user-level sampling): canaries
are users of k rows (default 16). Black box: canary user j is k copies of canary j's row under a
fresh user id, added to the training data's users (which need their `user_id` column), and
training samples users at q = B/U (B the expected users per batch, U the users, public as N is),
each bringing at most k rows, through the real DP step, which clips each user's summed gradient
as one. White box: canary user j's k rows are Dirac canaries on its one coordinate, sampled over
users at q by the same sampler, clipped as one user (`white_box.py`). ε is planned as `train ctr`
plans it with U users in place of N rows (δ = 1/U by default), and the summary states the unit.

Either way the canaries of all runs are guessed on together and the guesses turned into the
one-run ε lower bound of Mahloujifar et al. 2024 (f-DP against Gaussian DP), with Steinke, Nasr &
Jagielski 2023's as a second line (`bounds.py`), at --confidence; the summary gives the ceiling,
the largest bound the guesses allow.

The data, model and privacy options are `train ctr`'s, but for those of its ledger, logs,
evaluation and run directory: the audit writes none of them.
The scores file says which canaries were inserted; it is a private artefact of the audit.
"""
import argparse
import dataclasses
import os
import sys
import time
import types
from typing import Optional

import numpy as np
import tensorflow as tf

from dprec import cli_help
from dprec import privacy
from dprec.audit import bounds
from dprec.audit import canaries as canaries_lib
from dprec.audit import runner
from dprec.audit import scores as scores_lib
from dprec.audit import white_box
from dprec.errors import DprecError
from dprec.progress import phase_lines
from dprec.models import ctr
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.privacy import accounting
from dprec.privacy_unit import PRIVACY_UNITS, UNIT_KEY, USER_KEY
from dprec.sparse import fest
from dprec.training import poisson
from dprec.training import user_sampling
# `train ctr`'s options, data loading, privacy plan, algorithm configuration and parser, reused.
from dprec.workflows import ctr as train_ctr
from dprec.workflows import ctr_cli as train_ctr_cli
from dprec.workflows import ctr_options


THREAT_MODELS = ("black_box", "white_box")
# Black box: canaries are rows of the training data; white box: coordinates of one small table
# (200,000: at data-sized batches, q ≈ 1/150, the family fit of 100,000 reached only about half
# of ε = 2; docs/experiments/audit.md).
DEFAULT_CANARIES = {"black_box": 1000, "white_box": 200_000}


@dataclasses.dataclass
class CTRAuditOptions:
  """`train ctr`'s options plus the audit's own; those made by `cli_help.option` are the
  options of the command's "audit" group (`register`), with their help."""
  train: train_ctr.CTRTrainOptions
  threat_model: str = cli_help.option(
      "black_box", group="audit", choices=THREAT_MODELS,
      help="black_box: the adversary sees the final model; white_box: every step's released "
           "noisy update, with Dirac gradient canaries in the DP step")
  canaries: Optional[int] = cli_help.option(
      None, group="audit", help="canaries per run m (default: "
      + ", ".join(f"{k} {v}" for k, v in DEFAULT_CANARIES.items()) + ")")
  runs: int = cli_help.option(1, group="audit", help="training runs R (canaries pooled)")
  confidence: float = cli_help.option(0.95, group="audit", help="confidence of the lower bound")
  score: str = cli_help.option(
      "all", group="audit", choices=scores_lib.SCORES + ("all",), advanced=True,
      help="black-box canary score: alignment of its rows' movement with its gradient, their "
           "movement, its loss drop, or all (the best, Bonferroni-corrected)")
  scores_file: Optional[str] = cli_help.option(
      None, group="audit",
      help="write every canary's score and membership here (JSON lines; default: beside "
           "--summary-json, else none)")
  summary_json: Optional[str] = None
  progress: bool = True  # a line on stderr per phase
  # `train ctr`'s --privacy-unit and --max-rows-per-user, read for the audit (not its training).
  privacy_unit: str = "row"  # "user": canary users of k rows, user-level sampling
  max_rows_per_user: Optional[int] = None  # k at the user level (None: 16)

  @property
  def canary_count(self) -> int:
    return self.canaries or DEFAULT_CANARIES[self.threat_model]

  @property
  def rows_per_user(self) -> Optional[int]:
    """k at the user level, None at the row level."""
    if self.privacy_unit != "user":
      return None
    return self.max_rows_per_user or user_sampling.DEFAULT_MAX_ROWS_PER_USER

  def validate(self):
    self.train.validate()
    if self.threat_model not in THREAT_MODELS:
      raise DprecError(f"--threat-model must be one of {', '.join(THREAT_MODELS)}")
    if self.canary_count < 4 or self.runs < 1:
      raise DprecError("--canaries must be >= 4 and --runs >= 1")
    if not 0 < self.confidence < 1:
      raise DprecError(f"--confidence must be in (0, 1), got {self.confidence}")
    if self.score not in scores_lib.SCORES + ("all",):
      raise DprecError(f"--score must be one of {', '.join(scores_lib.SCORES)} or all")
    if self.train.stack_tables:
      raise DprecError("--stack-tables is a layout of train ctr's checkpoints that the audit "
                       "does not read (its canary scores take one table per column); the "
                       "stacked DP step equals the unstacked one with the same key "
                       "(tests/dp_core/test_stacked_tables.py): audit without it")
    if self.threat_model == "white_box" and self.score != "all":
      raise DprecError("--score chooses among the black-box scores; white_box uses "
                       f"{', '.join(white_box.SCORES)}")
    self._validate_unit()

  def _validate_unit(self):
    if self.privacy_unit not in PRIVACY_UNITS:
      raise DprecError(f"--privacy-unit must be one of {', '.join(PRIVACY_UNITS)}, got "
                       f"{self.privacy_unit!r}")
    if self.max_rows_per_user is not None and self.privacy_unit != "user":
      raise DprecError("--max-rows-per-user goes with --privacy-unit user (at the row level a "
                       "canary is one row)")
    if self.privacy_unit == "row":
      return
    if self.max_rows_per_user is not None:
      accounting.check_group_size(self.max_rows_per_user)
    train = self.train
    if train.fixed_batches or train.max_batch_size is not None:
      raise DprecError("--privacy-unit user samples users by Poisson, untruncated: drop "
                       "--fixed-batches and --max-batch-size")
    if (train.algorithm in train_ctr.FEST_ALGORITHMS and train.top_k_epsilon > 0
        and self.threat_model == "black_box"):
      raise DprecError("--privacy-unit user cannot audit a DP top-k set drawn from row counts "
                       "(a user's rows all count): use --top-k-epsilon 0 (counts public), "
                       "--algorithm dp_adafest, or --threat-model white_box (the set taken as "
                       "given)")


def _train_with_canaries(options, data, canaries):
  """One training run of `train ctr`'s configuration on data + included canaries (canary users
  of k rows at the user level); returns the canary scores and the plan."""
  train_options = options.train
  k = options.rows_per_user
  train = canaries_lib.with_canaries(data.train, canaries, k)
  units = len(train["label"]) if k is None else _count_users(train)
  plan = train_ctr.plan_privacy(train_options, units)
  model = ctr.build_ctr_model(canaries.vocab_sizes, hidden_units=train_options.hidden_units)
  selected = None
  if train_options.algorithm in train_ctr.FEST_ALGORITHMS:
    # Selection charged by the plan (ε_select); no ledger: the audit releases only its bound.
    selected = fest.rows_from_ids(
        train[ctr.CAT_FEATURES], model.config.table_names, model.config.vocab_sizes,
        train_options.top_k, train_options.top_k_epsilon or None,
        np.random.default_rng()).rows  # OS entropy
  config = train_ctr.algorithm_config(train_options, plan.noise_multiplier, selected)
  private = train_options.algorithm != "non_private"
  model.compile(optimizer=DPOptimizer(config, train_ctr.make_optimizer(train_options, model),
                                      expected_batch_size=train_options.batch_size,
                                      secure_noise=train_options.secure_noise))
  model.optimizer.build(model.trainable_variables)
  scorer = scores_lib.CanaryScorer(
      model, canaries, scores_lib.SCORES if options.score == "all" else (options.score,))
  # Fresh secret randomness per run (the runs' noise and batches must be independent): the
  # DPOptimizer's default key and BatchSampling's default entropy both come from the OS CSPRNG.
  features = {key: train[key] for key in (ctr.CAT_FEATURES, ctr.INT_FEATURES)}
  if k is None:
    sampling = poisson.BatchSampling(train_options.batch_size,
                                     private and not train_options.fixed_batches)
    dataset = poisson.sampled_dataset(features, train["label"], sampling, train_options.steps)
  else:
    dataset = _user_dataset(features, train["label"], train[USER_KEY],
                            user_sampling.UserSampling(train_options.batch_size, k),
                            train_options.steps)
  model.fit(dataset, epochs=1, steps_per_epoch=train_options.steps, verbose=0)
  return scorer.scores(model), plan


def _user_dataset(features, labels, user_ids, sampling, steps) -> tf.data.Dataset:
  """`user_sampling.user_batches` of the training rows as a dataset: each step's sampled users'
  rows (at most k each) with `UNIT_KEY`."""
  specs = {key: tf.TensorSpec((None,) + value.shape[1:], tf.as_dtype(value.dtype))
           for key, value in features.items()}
  specs[UNIT_KEY] = tf.TensorSpec((None,), tf.int32)
  return tf.data.Dataset.from_generator(
      lambda: user_sampling.user_batches(features, labels, user_ids, sampling, steps),
      output_signature=(specs, tf.TensorSpec((None,), tf.as_dtype(labels.dtype)))).prefetch(2)


def _count_users(train) -> int:
  """U, the distinct users of the training rows (`USER_KEY`; refused in one line when absent or
  not integers)."""
  return user_sampling.UserRows.group(train.get(USER_KEY), len(train["label"])).num_users


def _white_box_run(options, num_examples):
  """One white-box run (`white_box.run_canaries`) of the configuration planned as `train ctr`
  plans it on N = `num_examples` rows (U users at the user level)."""
  train_options = options.train
  plan = train_ctr.plan_privacy(train_options, num_examples)
  selected = ({white_box.CANARY_TABLE: [0]}  # replaced by the canary rows
              if train_options.algorithm in train_ctr.FEST_ALGORITHMS else None)
  config = train_ctr.algorithm_config(train_options, plan.noise_multiplier, selected)

  def train_and_score(rng):
    scores, included = white_box.run_canaries(
        config, options.canary_count, train_options.batch_size / num_examples,
        train_options.steps, train_options.batch_size, rng, train_options.secure_noise,
        options.rows_per_user)
    return scores, included, plan

  return train_and_score


def _accounted_claim(train_options, num_examples):
  """The mechanism the plan accounts, T Poisson-subsampled Gaussian steps at q over rows (over
  users at the user level: N = U) (None for a non-private run or fixed-size batches)."""
  if train_options.algorithm == "non_private" or train_options.fixed_batches:
    return None
  plan = train_ctr.plan_privacy(train_options, num_examples)
  return bounds.SubsampledGaussian(train_options.batch_size / plan.examples_per_period,
                                   train_options.steps, plan.noise_multiplier)


def audit_ctr(options: CTRAuditOptions, data: Optional[train_ctr.CTRData] = None) -> dict:
  """Runs the audit; returns (and writes to `options.summary_json`) its JSON summary."""
  options.validate()
  report = phase_lines("audit", options.progress)
  if data is None:
    report(f"loading {options.train.data}")
    data = train_ctr.load_data(options.train.data, options.train.vocab,
                               options.train.vocab_min_count)
  user_level = options.rows_per_user is not None
  # The units ε protects: N rows, or U users (public, as N is; B is then users per batch).
  num_examples = _count_users(data.train) if user_level else len(data.train["label"])
  options = dataclasses.replace(options, train=train_ctr.sized_for(options.train, num_examples))
  train_options = options.train
  tf.keras.utils.set_random_seed(train_options.seed)  # public: initialisation only
  num_integer_features = data.train[ctr.INT_FEATURES].shape[1]

  def train_and_score(rng):
    canaries = canaries_lib.make_ctr_canaries(data.vocab_sizes, num_integer_features,
                                              options.canary_count, rng)
    scores, plan = _train_with_canaries(options, data, canaries)
    return scores, canaries.included, plan

  claim = None
  if options.threat_model == "white_box":
    train_and_score = _white_box_run(options, num_examples)
    claim = _accounted_claim(train_options, num_examples)
  delta = train_options.delta or 1.0 / num_examples  # `train ctr`'s default δ = 1/N (1/U)
  started = time.perf_counter()
  result = runner.run_audit(train_and_score, options.runs, delta, options.confidence,
                            np.random.default_rng(), options.threat_model, claim, report)
  plan = result.plan
  private = train_options.algorithm != "non_private"
  steps_epsilon = None
  if private:  # the ε of the DP steps alone (the rest of `train ctr`'s budget is not audited)
    accounted = train_options.batch_size / plan.examples_per_period
    steps_epsilon = privacy.compute_epsilon(
        plan.noise_multiplier, accounted, train_options.steps, plan.delta,
        train_options.accountant, not train_options.fixed_batches).epsilon
  summary = {
      "algorithm": train_options.algorithm,
      "threat_model": options.threat_model,
      "privacy_unit": options.privacy_unit,  # what claimed_epsilon protects
      "max_rows_per_user": options.rows_per_user,
      "units": num_examples,  # N rows or U users
      "claimed_epsilon": train_options.epsilon if private else None,
      "steps_epsilon": steps_epsilon,
      "delta": delta,
      **result.summary_fields(),
      "confidence": options.confidence,
      "canaries": options.canary_count,
      "runs": options.runs,
      "scores": (list(white_box.SCORES) if options.threat_model == "white_box" else
                 list(scores_lib.SCORES) if options.score == "all" else [options.score]),
      "noise_multiplier": plan.noise_multiplier,
      "secure_noise": train_options.secure_noise,
      "steps": train_options.steps,
      "batch_size": train_options.batch_size,
      "sampling_rate": train_options.batch_size / plan.examples_per_period,
      "seconds": round(time.perf_counter() - started, 1),
      "scores_file": options.scores_file,
      "note": runner.NOTE,
  }
  runner.write_outputs(summary, result.records, options.scores_file, options.summary_json)
  return summary


AUDIT_ONLY = ("threat_model", "canaries", "runs", "confidence", "score", "scores_file",
              "summary_json", "privacy_unit", "max_rows_per_user")
# `train ctr`'s options most audits leave at their defaults: listed by --help-all only.
LESS_USED = ("out_of_core", "strategy")


def register(subparsers):
  parser = subparsers.add_parser(
      "audit", help="empirical ε lower bound of a pCTR training configuration, from canaries",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  audit = cli_help.OptionGroup(parser.add_argument_group(
      "audit", "the canaries, the runs and the bound"))
  # One definition of `train ctr`'s data/model/privacy options and their defaults, without those
  # of its run directory, ledger, checkpoints, logs and evaluation.
  train_ctr_cli.add_options(parser, run_directory=False)
  cli_help.mark_advanced(parser, LESS_USED)
  cli_help.add_fields(types.SimpleNamespace(audit=audit), CTRAuditOptions)
  parser.set_defaults(func=run)


def run(args) -> dict:
  fields = {f.name for f in dataclasses.fields(train_ctr.CTRTrainOptions)}
  values = {key: value for key, value in vars(args).items()
            if key in fields and key not in AUDIT_ONLY}
  values["algorithm"], values["epsilon"] = ctr_options.algorithm_and_epsilon(
      args.algorithm, args.epsilon, train_ctr.CTRTrainOptions.algorithm)
  train = train_ctr.CTRTrainOptions(progress=False, **values)
  audit_values = {key: getattr(args, key) for key in AUDIT_ONLY}
  if audit_values["scores_file"] is None and audit_values["summary_json"]:
    stem = os.path.splitext(audit_values["summary_json"])[0]
    audit_values["scores_file"] = stem + ".scores.jsonl"
  summary = audit_ctr(CTRAuditOptions(train=train, progress=not args.no_progress,
                                      **audit_values))
  claimed = summary["claimed_epsilon"]
  unit = ("user, k = {}".format(summary["max_rows_per_user"])
          if summary.get("privacy_unit") == "user" else "row")
  print(f"ε lower bound {summary['epsilon_lower_bound']:.3f} at {summary['confidence']:.0%} "
        f"(ceiling {summary['ceiling']:.3f}: every guess right; Steinke et al. "
        f"{summary['epsilon_lower_bound_steinke']:.3f}, ceiling "
        f"{summary['ceiling_steinke']:.3f}); claimed ε "
        f"{'∞ (non-private)' if claimed is None else claimed} per {unit}", file=sys.stderr)
  return summary
