"""`dprec audit`: an empirical ε lower bound for a `train ctr` configuration, from canaries.

    dprec audit --data DIR --algorithm dp_adafest --epsilon 2 --canaries 1000 --runs 2

Per run: m fresh-row canaries (`canaries.py`), a random half inserted into the training days, the
pCTR model trained with the real DP step (`DPModel` + `DPOptimizer`, planned from --epsilon as
`train ctr` plans it), every canary scored (`scores.py`), and the guesses of all runs turned into
the one-run ε lower bound of Steinke, Nasr & Jagielski 2023 (`bounds.py`) at --confidence.
DP-AdaFEST is audited as it runs: a canary row moves only if its noisy count passes τ or it is
drawn as a false positive, and then by its clipped gradient plus noise.

The data, model and privacy options are `train ctr`'s; the audit writes no ledger, logs or
evaluation, so --ledger and --log-dir are refused and --charge-every, --eval-batch-size ignored.
The scores file says which canaries were inserted; it is a private artefact of the audit.
"""
import argparse
import dataclasses
import os
from typing import Optional

import numpy as np
import tensorflow as tf

from dprec.audit import canaries as canaries_lib
from dprec.audit import runner
from dprec.audit import scores as scores_lib
from dprec.errors import DprecError
from dprec.models import ctr
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.sparse import fest
from dprec.training import poisson
# `train ctr`'s options, data loading, privacy plan, algorithm configuration and parser, reused.
from dprec.workflows import ctr as train_ctr
from dprec.workflows import ctr_cli as train_ctr_cli


@dataclasses.dataclass
class CTRAuditOptions:
  """`train ctr`'s options plus the audit's own (see `register`)."""
  train: train_ctr.CTRTrainOptions
  canaries: int = 1000
  runs: int = 1
  guesses: Optional[int] = None  # per side (in and out); default m/4
  confidence: float = 0.95
  score: str = "alignment"
  scores_file: Optional[str] = None
  summary_json: Optional[str] = None

  def validate(self):
    self.train.validate()
    if self.canaries < 4 or self.runs < 1:
      raise DprecError("--canaries must be >= 4 and --runs >= 1")
    if self.guesses is not None and not 0 < 2 * self.guesses <= self.canaries:
      raise DprecError(f"--guesses must be in [1, canaries/2], got {self.guesses}")
    if not 0 < self.confidence < 1:
      raise DprecError(f"--confidence must be in (0, 1), got {self.confidence}")
    if self.score not in scores_lib.SCORES:
      raise DprecError(f"--score must be one of {', '.join(scores_lib.SCORES)}")


def _train_with_canaries(options, data, canaries):
  """One training run of `train ctr`'s configuration on data + included canaries; returns the
  canary scores and the plan."""
  train_options = options.train
  train = canaries_lib.with_canaries(data.train, canaries)
  plan = train_ctr.plan_privacy(train_options, len(train["label"]))
  model = ctr.build_ctr_model(canaries.vocab_sizes, hidden_units=train_options.hidden_units)
  selected = None
  if train_options.algorithm in ("dp_fest", "dp_adafest_plus"):
    # Selection charged by the plan (ε_select); no ledger: the audit releases only its bound.
    selected = fest.rows_from_ids(
        train[ctr.CAT_FEATURES], model.config.table_names, model.config.vocab_sizes,
        train_options.top_k, train_options.top_k_epsilon or None,
        np.random.default_rng()).rows  # OS entropy
  config = train_ctr.algorithm_config(train_options, plan.noise_multiplier, selected)
  private = train_options.algorithm != "non_private"
  model.compile(optimizer=DPOptimizer(config, train_ctr.make_optimizer(train_options),
                                      expected_batch_size=train_options.batch_size,
                                      secure_noise=train_options.secure_noise))
  model.optimizer.build(model.trainable_variables)
  scorer = scores_lib.CanaryScorer(model, canaries, options.score)
  # Fresh secret randomness per run (the runs' noise and batches must be independent): the
  # DPOptimizer's default key and BatchSampling's default entropy both come from the OS CSPRNG.
  sampling = poisson.BatchSampling(train_options.batch_size,
                                   private and not train_options.fixed_batches)
  features = {key: train[key] for key in (ctr.CAT_FEATURES, ctr.INT_FEATURES)}
  dataset = poisson.sampled_dataset(features, train["label"], sampling, train_options.steps)
  model.fit(dataset, epochs=1, steps_per_epoch=train_options.steps, verbose=0)
  return scorer.scores(model), plan


def audit_ctr(options: CTRAuditOptions, data: Optional[train_ctr.CTRData] = None) -> dict:
  """Runs the audit; returns (and writes to `options.summary_json`) its JSON summary."""
  options.validate()
  data = data or train_ctr.load_data(options.train.data, options.train.vocab,
                                     options.train.vocab_min_count)
  options = dataclasses.replace(options, train=train_ctr.sized_for(options.train,
                                                                   len(data.train["label"])))
  train_options = options.train
  tf.keras.utils.set_random_seed(train_options.seed)  # public: initialisation only
  num_integer_features = data.train[ctr.INT_FEATURES].shape[1]

  def train_and_score(rng):
    canaries = canaries_lib.make_ctr_canaries(data.vocab_sizes, num_integer_features,
                                              options.canaries, rng)
    scores, plan = _train_with_canaries(options, data, canaries)
    return scores, canaries.included, plan

  result = runner.run_audit(train_and_score, options.canaries, options.runs,
                            options.guesses or options.canaries // 4, options.confidence,
                            np.random.default_rng())
  plan = result.plan
  summary = {
      "algorithm": train_options.algorithm,
      "claimed_epsilon": train_options.epsilon if train_options.algorithm != "non_private"
                         else None,
      "delta": plan.delta,
      "epsilon_lower_bound": result.epsilon_lower_bound,
      "confidence": options.confidence,
      "canaries": options.canaries,
      "runs": options.runs,
      "guesses": result.guesses,
      "correct_guesses": result.correct_guesses,
      "score": options.score,
      "method": runner.METHOD,
      "noise_multiplier": plan.noise_multiplier,
      "secure_noise": train_options.secure_noise,
      "steps": train_options.steps,
      "batch_size": train_options.batch_size,
      "scores_file": options.scores_file,
      "note": runner.NOTE,
  }
  runner.write_outputs(summary, result.records, options.scores_file, options.summary_json)
  return summary


class _AuditParserAsSubparsers:
  """Lets `train ctr`'s `register` add its options to the audit parser: one definition of the
  data/model/privacy options and their defaults."""

  def __init__(self, parser):
    self.parser = parser

  def add_parser(self, *unused_args, **unused_kwargs):
    return self.parser


AUDIT_ONLY = ("canaries", "runs", "guesses", "confidence", "score", "scores_file",
              "summary_json")
NOT_USED = ("ledger", "charge_every", "log_dir", "eval_batch_size", "run_dir",
            "checkpoint_every", "keep_checkpoints")  # `train ctr`-only


def register(subparsers):
  parser = subparsers.add_parser(
      "audit", help="empirical ε lower bound of a pCTR training configuration, from canaries",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  train_ctr_cli.register(_AuditParserAsSubparsers(parser))
  defaults = CTRAuditOptions
  add = parser.add_argument
  add("--canaries", type=int, default=defaults.canaries, help="canaries per run m")
  add("--runs", type=int, default=defaults.runs, help="training runs R (guesses pooled)")
  add("--guesses", type=int, help="guesses per side and run (default m/4 'in' and m/4 'out')")
  add("--confidence", type=float, default=defaults.confidence,
      help="confidence of the lower bound")
  add("--score", choices=scores_lib.SCORES, default=defaults.score,
      help="canary score: alignment of its rows' movement with its gradient, or loss drop")
  add("--scores-file", help="write every canary's score and membership here (JSON lines)")
  parser.set_defaults(func=run)


def run(args) -> dict:
  if args.ledger or args.log_dir:
    raise DprecError("dprec audit writes no ledger or TensorBoard logs: drop --ledger/--log-dir")
  fields = {f.name for f in dataclasses.fields(train_ctr.CTRTrainOptions)}
  values = {key: value for key, value in vars(args).items()
            if key in fields and key not in AUDIT_ONLY + NOT_USED}
  train = train_ctr.CTRTrainOptions(progress=False, **values)
  audit_values = {key: getattr(args, key) for key in AUDIT_ONLY}
  if audit_values["scores_file"] is None and audit_values["summary_json"]:
    stem = os.path.splitext(audit_values["summary_json"])[0]
    audit_values["scores_file"] = stem + ".scores.jsonl"
  return audit_ctr(CTRAuditOptions(train=train, **audit_values))
