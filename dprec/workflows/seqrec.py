"""`train seqrec`: DPFormer (Ding et al. 2023) on a `dprec preprocess sequences` output directory.

One example per user (user-level DP, Ding et al. 2023): the user's training sequence predicts the
next item at every position; the validation item (if the data has one) is held out and ranked
from the training items (model selection: `selected_on: "validation"`), the test item from the
full history, each against all M items (`hold_out_validation=False` trains on the validation
item too). σ is calibrated from ε (δ = 1/N by default) for
Poisson sampling at q = B/N over the planned steps, composed with Re-Attention's p_i when they come
from a DP histogram of users per item (its `item_frequency_share` of ε; else a public file), and
charged to the run's ledger; ε = inf trains without privacy. Adam (decoupled weight decay 1e-5),
20% linear warm-up then linear decay, as in the paper. The noise, batches and the histogram's
noise come from the run's secret key; `seed` seeds only initialisation and dropout. With a run
directory the run checkpoints every `checkpoint_every` steps and the same options resume a killed
run on the very batches and noise an uninterrupted run would have used, paying no step twice.
`dp_forward` trains DP-Forward instead (Du et al., "DP-Forward: Fine-tuning and Inference on
Language Models with Differential Privacy in Forward Pass", arXiv:2309.06746,
`dprec.workflows.dp_forward`): SeqLDP. `model="item2item"` releases DP item-to-item statistics once
instead of training a transformer (`dprec.workflows.item2item`; measured best on Amazon Games'
validation items: docs/experiments/seqrec_item2item.md). `model="auto"`, the default, releases
item2item at a share of the budget, tests it against most popular on the validation items (a
paid, noisy test) and then tops item2item up or trains the transformer with the rest, the run
accounted as a union over the two branches (`dprec.workflows.model_choice`).
`model="hybrid"` releases item2item's statistics too, as a mechanism of the plan beside
training (`pair_share` of ε), and initialises the transformer's item rows from their truncated
SVD (post-processing; `pair_init`) before DP training with the rest of ε, and can add their
item-to-item score to the trained transformer's logits as a fixed prior (`prior_weight`,
`dprec.models.logit_prior`; post-processing too). `model="dpformer-frozen"`
takes the same releases and fixes the transformer's item table to their truncated SVD (and its
logit offset to the log of the DP histogram's counts): post-processing, frozen, so DP-SGD's
norms, clipping and noise cover the blocks alone, tens of thousands of dense weights every
user feeds, instead of M item rows most users never touch. Re-Attention is off
there: without trained item rows every token's σ_eff is the blocks' σ_dp/B, the same
correction on every key, which cancels in the softmax (Ding et al. 2023, Eq. 5).
Its `train_prior_weight` w > 0 trains it with w times the pair prior in its logits, its
output zero-initialised (`SeqRecConfig.training_prior`): the blocks learn the residual of the
item-to-item score. `select_epochs` evaluates the validation items before training and after
every epoch and keeps the best weights (0 steps included): every candidate is a function of
the paid steps, the choice one on held-out data.
"""
import dataclasses
import functools
import math
import os
import time

import numpy as np
import tensorflow as tf

from dprec.data import public_users as public_users_lib
from dprec.data.sequences import SeqRecExamples, load_sequences, make_examples
from dprec.errors import DprecError
from dprec.models import ranking_metrics
from dprec.models.logit_prior import LogitPrior, packed_pairs
from dprec.models.seqrec import SeqRecModel, warmup_linear_decay
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import AdamBC
from dprec.privacy.noise_key import NoiseKey
from dprec.training import poisson
from dprec.workflows import dp_forward as dp_forward_lib
from dprec.workflows import item2item as item2item_lib
from dprec.workflows import item_frequencies as frequencies_lib
from dprec.workflows import model_choice
from dprec.workflows import plan as plan_lib
from dprec.workflows import resume as resume_lib
from dprec.workflows import run as run_lib
from dprec.workflows import run_budget
from dprec.workflows import run_summary
# The options and the names the command line offers, without TensorFlow (`seqrec_options`).
from dprec.workflows.seqrec_options import FROZEN, MODELS, PAIR_MODELS, PRIOR_WEIGHTS  # noqa: F401
from dprec.workflows.seqrec_options import SeqRecTrainOptions

COMMAND = LEDGER_LABEL = "train seqrec"
FORWARD_NOISE = "forward noise"
EPSILON_COVERS = {
    "epsilon": "(epsilon, delta)-DP for adding or removing one user (all of their training "
               "sequence), covering the model (weights and Re-Attention's p_i; for item2item "
               "the released item pairs and the DP histogram; for hybrid and dpformer-frozen "
               "all three, composed; with --model auto also its first-stage item2item "
               "releases and the noisy validation difference that chose the model: the run "
               "is one (epsilon, delta) ledger charge, the union over both branches, "
               "model_choice)",
    "public": ["settings", "noise multipliers", "train_examples (N) and items (M), assumed "
               "public", "steps_per_second"],
    "held_out_evaluation": "ndcg_at_10, hit_at_10, by_popularity, test_users, validation and "
                           "the top-10 diversity (distinct_top10_items, overlaps) rank each "
                           "user's held-out item given their history, which IS training data of "
                           "this run: these metrics are not covered by ε; nor is the logit "
                           "prior's weight that --prior-weight auto picks on the validation "
                           "items (with a given weight the prior reads released pairs only), "
                           "nor the epoch --select-epochs keeps on them, nor a setting (e.g. "
                           "--pair-share, the release's split with training) chosen by "
                           "comparing runs on them",
    "public_users": "with --public-users F (item2item): the users the public rule picks "
                    "(public_user_selection) opted in as public data; their rows are used "
                    "exactly and charged nothing, and ε covers the other users only (the "
                    "metrics are the private users')",
    "not_covered": "diagnostics_nonprivate (only with --diagnostics): the exact training loss",
}


# Only the transformer writes checkpoints: a fingerprint from before `model` existed is dpformer's.
options_from_checkpoint = functools.partial(resume_lib.options_from_checkpoint,
                                            SeqRecTrainOptions, missing={"model": "dpformer"})


def plan_privacy(options, num_examples, run=None) -> plan_lib.PrivacyPlan:
  """Steps = epochs·N/B; σ calibrated so the run spends exactly ε at δ (default: the ledger's,
  else 1/N), composed with the DP histogram of p_i and with what `run`'s ledger spent on the
  data before (`run_budget.plan_prior`); DP-Forward: σ of its E epoch releases, composed with that
  too (`dp_forward.plan_run`); item2item: the pair release's σ (`item2item.plan_privacy`)."""
  if options.model == model_choice.AUTO:
    raise DprecError("model 'auto' is resolved before planning (seqrec.choose_model)")
  delta, spent = run_budget.plan_prior(run and run.budget, options.epsilon, options.delta,
                                       options.accountant, default_delta=1.0 / num_examples)
  return plan_model(options, num_examples, delta, spent)


def plan_model(options, num_examples, delta, spent) -> plan_lib.PrivacyPlan:
  """`plan_privacy` of a named model at `delta` after `spent` (a `privacy.Spent`)."""
  if options.model == "item2item":
    return item2item_lib.plan_privacy(options, num_examples, delta, spent)
  check_batch_size(options, num_examples)
  if options.dp_forward is not None:
    return dp_forward_lib.plan_run(options, delta, num_examples, spent)
  steps = max(1, int(round(options.epochs * num_examples / options.batch_size)))
  if not options.private:
    return plan_lib.plan_privacy(math.inf, None, num_examples, options.batch_size, steps)
  mechanisms = (item2item_lib.mechanisms(options) if options.model in PAIR_MODELS
                else frequencies_lib.mechanisms(options))
  return plan_lib.plan_privacy(options.epsilon, delta, num_examples, options.batch_size, steps,
                               mechanisms=mechanisms,
                               accountant=options.accountant, poisson=not options.fixed_batches,
                               spent=spent)


def check_batch_size(options, num_examples):
  """Refuses a given B above the N training users."""
  if options.batch_size is not None and options.batch_size > num_examples:
    raise DprecError(f"--batch-size {options.batch_size} exceeds the {num_examples} training "
                     "users; give a smaller one or none (then it is chosen from N)")


def build_model(options, examples, plan, frequencies=None, noise_key=None, vocabulary=None,
                row_weights=None):
  """A compiled `SeqRecModel`; Re-Attention's error model is set from the plan and `frequencies`
  (`dprec.workflows.item_frequencies`; None leaves it to a checkpoint restored into the model),
  its item table from `vocabulary` (`item_frequencies.vocabulary`; None: a row per item) and
  its popularity weights from `row_weights` (`item_frequencies.row_weights`; None: left to a
  checkpoint).
  The DP and DP-Forward noise generators are keyed from `noise_key` (a run's; None: a fresh
  secret one)."""
  noise_key = noise_key or NoiseKey.fresh()
  config = options.model_config(examples.num_items, vocabulary and vocabulary.num_rows)
  if plan.forward is not None:
    config = dataclasses.replace(
        config, dp_forward=options.dp_forward.model_config(plan.noise_multiplier))
  model = SeqRecModel(config, forward_noise_generator=noise_key.tf_generator(FORWARD_NOISE))
  model({"items": examples.items[:1]})
  if vocabulary is not None:
    model.set_item_vocabulary(vocabulary)
  if row_weights is not None:
    model.set_popularity_weights(row_weights)
  if frequencies is not None:
    model.set_error_model(frequencies, plan.noise_multiplier, options.l2_norm_clip,
                          options.batch_size, len(examples.items), options.variance_scale)
  algorithm = (config_lib.DPSGD(options.l2_norm_clip, plan.noise_multiplier,
                                normalization_offset=options.normalization_offset)
               if options.private and plan.forward is None else config_lib.NonPrivate())
  schedule = warmup_linear_decay(options.learning_rate, plan.steps)
  if options.optimizer == "adambc":
    adam = AdamBC(schedule, floor=options.adambc_floor, weight_decay=options.weight_decay)
  else:
    adam = tf.keras.optimizers.AdamW(learning_rate=schedule, weight_decay=options.weight_decay)
  adam.build(model.trainable_variables)  # slots exist before a checkpoint is restored into them
  model.compile(optimizer=DPOptimizer(algorithm, adam, expected_batch_size=options.batch_size,
                                      noise_key=noise_key, secure_noise=options.secure_noise))
  return model


def initialise_item_rows(model, rows):
  """Sets the item table's rows where `rows` [M + 1, d] (released values) is nonzero, scaled
  so their mean norm is that of the random rows they replace; the others stay random."""
  table = model.item_embedding.embeddings
  values = table.numpy()
  if rows.shape != values.shape:
    raise DprecError(f"item rows {rows.shape} do not fit the item table {values.shape}")
  given = np.linalg.norm(rows, axis=1) > 0
  if given.any():
    scale = (np.linalg.norm(values[given], axis=1).mean()
             / np.linalg.norm(rows[given], axis=1).mean())
    values[given] = rows[given] * scale
    table.assign(values)


def set_frozen_items(model, prior, counts):
  """`--model dpformer-frozen`'s fixed table and offset from the released `prior`
  (`Item2ItemModel`) and DP histogram `counts` [M + 1]: rows U_d·√Σ_d of the pairs' truncated
  SVD (`item_factors`), scaled to largest norm 1 (items no released pair touches, and padding,
  0), and offset log max(n̂_j, 1) of the DP counts. The untrained blocks' h (norm ≈ √d after
  the final LayerNorm) then moves a logit by about ‖E_j‖ ≤ 1 against the offset's spread of
  several units: training starts from a popularity ranking, as item2item orders the items no
  pair reaches (a mean norm of 1 let a few large rows outrank it: 14 distinct items in the
  top-10s on Amazon Games). Post-processing of the two releases."""
  rows = prior.item_factors(model.config.dim)
  largest = np.linalg.norm(rows, axis=1).max()
  if largest > 0:
    rows = rows / largest
  model.set_frozen_items(rows, np.log(np.maximum(counts[1:], 1.0)))
  if model.config.training_prior is not None:
    model.set_training_prior(*packed_pairs(prior.matrix, model.config.training_prior.items))


class EpochSelection(tf.keras.callbacks.Callback):
  """`select_epochs`: `score()` (validation NDCG@10) before the first step (from `start`, a
  resumed run's step) and at the end of each of `epochs` over `steps`; `restore()` sets the
  best weights (the earliest of equals)."""

  def __init__(self, score, epochs, steps, start=0):
    super().__init__()
    self.score, self.step = score, start
    self.at = {min(steps, round(e * steps / epochs)) for e in range(1, math.ceil(epochs) + 1)}
    self.scores, self.best = {}, None

  def _evaluate(self):
    value = float(self.score())
    if self.best is None or value > self.scores[self.best[0]]:
      self.best = (self.step, [v.numpy() for v in self.model.weights])
    self.scores[self.step] = value

  def on_train_begin(self, logs=None):
    self._evaluate()

  def on_train_batch_end(self, batch, logs=None):
    self.step += 1
    if self.step in self.at:
      self._evaluate()

  def restore(self):
    if self.best is not None:  # None: no step was left to train
      for variable, value in zip(self.model.weights, self.best[1]):
        variable.assign(value)

  def summary(self):
    """{validation NDCG@10 by step, the step kept}."""
    if self.best is None:
      return None
    return {"validation_ndcg_by_step": {str(s): v for s, v in self.scores.items()},
            "selected_step": self.best[0], "selected_on": "validation"}


def noise_generators(model):
  """{purpose: generator} of the model's secret noise, re-keyed at every step."""
  generators = {"dp step": model.dp_optimizer.generator}
  if model.forward_noise is not None:
    generators[FORWARD_NOISE] = model.forward_noise.generator
  return generators


def evaluate(model, examples: SeqRecExamples, options, histories=None, targets=None):
  """Full-ranking NDCG@10 / HIT@10, overall and per popularity bucket (in [0, 1]), of the test
  items (or of `targets` after `histories`)."""
  return ranking_metrics.evaluate_model(
      model, examples.test_histories if histories is None else histories,
      examples.test_items if targets is None else targets, examples.item_frequencies,
      options.eval_batch_size, options.exclude_history, options.progress)


def evaluate_all(model, examples: SeqRecExamples, options):
  """`evaluate` on the test items, plus the held-out validation items (`validation`) and the
  top-10 diversity of 2,000 test users (`ranking_metrics.top_k_diversity`)."""
  metrics = evaluate(model, examples, options)
  if examples.valid_histories is not None:
    metrics["validation"] = evaluate(model, examples, options, examples.valid_histories,
                                     examples.valid_items)
  return _with_diversity(metrics, model.score_items, examples)


def _with_diversity(metrics, score_fn, examples):
  return dict(metrics, **ranking_metrics.top_k_diversity(score_fn, examples.test_histories,
                                                         examples.item_frequencies))


# --prior-weight auto's candidates: 0 is the transformer alone; from 10 on a released pair
# outranks any logit gap on Amazon Games (docs/experiments/seqrec_item2item.md).


def evaluate_with_prior(model, prior, examples: SeqRecExamples, options):
  """(`evaluate_all`'s metrics of the transformer plus the released pairs' prior at
  `options.prior_weight` (None: the `PRIOR_WEIGHTS` weight of best validation NDCG@10, the
  smallest of equals), the prior's summary: the weight, the validation metrics of every
  candidate and the metrics without the prior)."""
  scorer = LogitPrior(model, prior)
  buckets = ranking_metrics.popularity_buckets(examples.item_frequencies)

  def at_weights(weights, histories, targets):
    return dict(zip(weights, ranking_metrics.evaluate_scorings(
        lambda history: scorer.score_weights(history, weights), histories, targets, buckets,
        batch_size=options.eval_batch_size, exclude_history=options.exclude_history,
        progress=ranking_metrics.ranking_progress(options.progress))))

  candidates = sorted(set(PRIOR_WEIGHTS) | {options.prior_weight or 0.0})
  validation = None
  if examples.valid_histories is not None and len(examples.valid_items):
    validation = at_weights(candidates, examples.valid_histories, examples.valid_items)
  elif options.prior_weight is None:
    raise DprecError("--prior-weight auto selects the weight on the validation items, and the "
                     "data has none (preprocess with a validation item, or give a weight)")
  weight = options.prior_weight
  if weight is None:
    weight = max(candidates, key=lambda w: (validation[w]["ndcg_at_10"], -w))
  test = at_weights([weight, 0.0], examples.test_histories, examples.test_items)

  def metrics_at(w):
    return _with_diversity(dict(test[w], validation=validation and validation[w]),
                           LogitPrior(model, prior, w).score_items, examples)

  without = metrics_at(0.0)
  chosen = without if weight == 0 else metrics_at(weight)
  summary = {
      "weight": weight,
      "selected_on": "validation" if options.prior_weight is None else "--prior-weight",
      "validation_by_weight": validation and {
          str(w): {key: m[key] for key in ("ndcg_at_10", "hit_at_10", "by_popularity")}
          for w, m in validation.items()},
      "without_prior": {key: without[key] for key in (
          "ndcg_at_10", "hit_at_10", "by_popularity", "validation", "distinct_top10_items",
          "top10_popularity_overlap", "top10_between_users_overlap")}}
  return chosen, summary


def _check_and_pay_once(plan, run, label):
  """Refuses a run whose unpaid part (`label`'s steps, the one-off releases) the ledger cannot
  afford, then pays the one-off releases: the plan's Gaussian mechanisms."""
  run.budget.check(plan, label, plan.steps)
  run.budget.pay_once(plan)


def _pay_before_training(options, plan, run, resume, num_examples):
  """Opens the ledger, refuses a run whose unpaid part it cannot afford, pays the one-off
  releases (the DP histogram; DP-Forward's label ε2) and returns the callback paying the steps
  (DP-Forward: one release per epoch); None for a non-private run."""
  if run.budget.open_plan_ledger(plan) is None or options.auto_model:
    return None  # --model auto: the run was paid as a whole (`model_choice.pay`)
  if plan.forward is not None:
    return dp_forward_lib.pay_before_training(
        run, plan, LEDGER_LABEL, resume.step,
        dp_forward_lib.steps_per_epoch(num_examples, options.batch_size))
  run.checkpoints.check_ledger_covers(LEDGER_LABEL)
  _check_and_pay_once(plan, run, LEDGER_LABEL)
  return run.budget.callback(plan, LEDGER_LABEL, resume.step, options.charge_every)


def run(options: SeqRecTrainOptions, data=None) -> dict:
  """Trains (or resumes, see the module docstring) and evaluates; returns the JSON summary (also
  written to `options.summary_json`)."""
  options.validate()
  data, public_data = public_users_lib.split(data or load_sequences(options.data),
                                             options.public_users, options.public_users_salt)
  # Training, the DP releases and the evaluation see the private users only.
  examples = make_examples(data, options.max_len, options.hold_out_validation)
  public = None if public_data is None else make_examples(public_data, options.max_len,
                                                          options.hold_out_validation)
  batch_size_chosen = options.batch_size is None
  if batch_size_chosen:
    options = dataclasses.replace(
        options, batch_size=poisson.default_batch_size(len(examples.items)))
  tf.keras.utils.set_random_seed(options.seed)
  with run_lib.Run(COMMAND, options.run_dir, options.ledger, options.insecure_noise_seed,
                   options.secure_noise, options.data) as run:
    options, plan, choice, chosen = choose_model(options, examples, run)
    if plan.forward is not None:
      prior = dp_forward_lib.label_prior(options.item_frequencies, data.item_ids,
                                         examples.num_items)
      examples = dataclasses.replace(examples, labels=dp_forward_lib.training_labels(
          examples.labels, prior, plan.forward.label_epsilon, rng=run.key.numpy_rng("label rr"),
          saved=options.run_dir and os.path.join(options.run_dir, "rr_labels.npy")))
    # The histogram's noise comes from the run's key, so a resumed run draws the same p_i.
    frequencies = chosen and chosen["frequencies"]
    if chosen is None:
      frequencies = frequencies_lib.frequencies(options, data, examples, plan,
                                                run.key.numpy_rng("item histogram"))
    if options.model == "item2item":
      summary = _run_item2item(options, examples, plan, run, frequencies, public, chosen)
      summary["public_user_selection"] = public_users_lib.summary(
          options.public_users, options.public_users_salt, public_data, data)
      summary["model_choice"] = choice
      run_summary.write_summary(summary, run_summary.summary_path(options))
      return summary
    vocabulary = frequencies_lib.vocabulary(options, examples, frequencies)
    if vocabulary is not None:  # labels index the table's rows
      examples = dataclasses.replace(examples, labels=vocabulary.row_of[examples.labels])
    weights, floor = frequencies_lib.row_weights(options, plan, examples, frequencies, vocabulary)
    model = build_model(options, examples, plan, frequencies, run.key, vocabulary, weights)
    prior = release = None
    if options.model in PAIR_MODELS:  # before a checkpoint is restored over the rows
      prior, release = item2item_lib.build_model(options, examples, plan, frequencies,
                                                 run.key.numpy_rng("item pairs"))
      if options.model == FROZEN:
        set_frozen_items(model, prior, item2item_lib.popularity(options, examples,
                                                                frequencies))
      elif options.pair_init:
        initialise_item_rows(model, prior.item_factors(options.dim))
    resume = run.checkpoints.resume(model, options, options.keep_checkpoints,
                                    train_examples=len(examples.items), items=examples.num_items)
    # Paid (the histogram charged) before the first checkpoint holds p_i.
    charges = _pay_before_training(options, plan, run, resume, len(examples.items))
    selection = None
    if options.select_epochs:
      selection = EpochSelection(
          lambda: evaluate(model, examples, options, examples.valid_histories,
                           examples.valid_items)["ndcg_at_10"],
          options.epochs, plan.steps, resume.step)
    timer, callbacks = run.trainer.callbacks(noise_generators(model), resume, charges,
                                           options.checkpoint_interval(plan.steps),
                                           extra=[selection] if selection else (),
                                           progress=options.progress and COMMAND,
                                           diagnostics=options.diagnostics)
    history = run.trainer.fit(model, {"items": examples.items}, examples.labels,
                              options.batch_size,
                              plan.private and plan.poisson and plan.forward is None, plan.steps,
                              resume, callbacks)
    if selection is not None:
      selection.restore()
    if prior is None:
      metrics, prior_summary = evaluate_all(model, examples, options), None
    else:
      metrics, prior_summary = evaluate_with_prior(model, prior, examples, options)
    summary = _summary(options, examples, plan, history, metrics, timer, run, resume)
    summary.update(batch_size_chosen=batch_size_chosen,
                   item_frequencies=frequencies_lib.source(options, plan, frequencies),
                   item_vocabulary=frequencies_lib.vocabulary_summary(options, vocabulary),
                   popularity_weights=frequencies_lib.weights_summary(weights, floor),
                   epoch_selection=selection and selection.summary(),
                   train_prior_weight=options.train_prior_weight, model_choice=choice)
    if options.auto_model and plan.private:  # the run's δ, not branch B's plan's
      summary["delta"] = run.budget.ledger.delta
    if release is not None:
      summary.update(model=options.model, reattention=model.config.reattention.enabled,
                     item_pairs=dict(
          release, noise_multiplier=plan.mechanisms.get(item2item_lib.LABEL),
          epsilon_share=item2item_lib.mechanisms(options)[-1][1], init=options.pair_init,
          **item2item_lib.settings(options)), logit_prior=prior_summary)
  run_summary.write_summary(summary, run_summary.summary_path(options))
  return summary


def choose_model(options, examples, run):
  """(options, plan, the choice's summary, branch A's item2item or None). A named model: its
  plan. `--model auto` (`dprec.workflows.model_choice`): both branches planned, the run paid as
  one charge, stage 1 released from the run's key and the model chosen; item2item comes with
  its combined releases {"model", "release", "frequencies", "noise"}, the transformer with
  branch B's plan. Without DP the choice is exact and the chosen model's plan follows."""
  num_examples = len(examples.items)
  if options.model != model_choice.AUTO:
    return options, plan_privacy(options, num_examples, run), model_choice.given(options), None
  model_choice.check_data(examples)  # refusals before anything is paid
  check_batch_size(options, num_examples)
  auto = None
  if options.private:
    delta, spent = run_budget.plan_prior(run.budget, options.epsilon, options.delta,
                                         options.accountant, default_delta=1.0 / num_examples)
    auto = model_choice.plan(options, num_examples, delta, spent, plan_model)
    run.budget.open_plan_ledger(auto.transformer)
    model_choice.pay(run.budget, auto)
  resolved, stage, choice = model_choice.resolve(options, examples, auto, run.key.numpy_rng)
  if auto is None:
    return resolved, plan_privacy(resolved, num_examples, run), choice, None
  if resolved.model == "dpformer":
    return resolved, auto.transformer, choice, None
  model, release, frequencies, noise = model_choice.top_up(resolved, examples, auto, stage,
                                                           run.key.numpy_rng)
  plan = plan_lib.plan_privacy(auto.epsilon, run.budget.ledger.delta, num_examples,
                               num_examples, 1, noise_multiplier=noise["pairs"],
                               accountant=auto.accountant)
  return resolved, plan, choice, {"model": model, "release": release,
                                  "frequencies": frequencies, "noise": noise}


def _run_item2item(options, examples, plan, run, frequencies, public=None, chosen=None):
  """Pays the histogram and the pair release, releases the pairs from the run's key, adds the
  `public` users' exact statistics, evaluates and returns the summary
  (`dprec.workflows.item2item`); `chosen`: `--model auto`'s item2item, paid and released
  (`choose_model`)."""
  if chosen is None and run.budget.open_plan_ledger(plan) is not None:
    _check_and_pay_once(plan, run, item2item_lib.LABEL)
    run.budget.pay_steps(plan, item2item_lib.LABEL, plan.steps)
  timer = time.perf_counter()
  if chosen is None:
    model, release = item2item_lib.build_model(options, examples, plan, frequencies,
                                               run.key.numpy_rng("item pairs"), public)
    source = frequencies_lib.source(options, plan, frequencies)
  else:
    model, release = chosen["model"], chosen["release"]
    source = {"source": "dp histogram, stage 1 and top-up combined",
              "noise_multiplier": chosen["noise"]["histogram"],
              "max_items_per_user": frequencies_lib.histogram_items(options),
              "ledger_label": model_choice.LABEL}
  metrics = evaluate_all(model, examples, options)
  summary = {
      "model": "item2item", "ndcg_at_10": metrics["ndcg_at_10"],
      "hit_at_10": metrics["hit_at_10"], "test_users": metrics["users"],
      "by_popularity": metrics["by_popularity"], "validation": metrics.get("validation"),
      "selected_on": "validation" if "validation" in metrics else None,
      **{key: metrics[key] for key in ("distinct_top10_items", "top10_popularity_overlap",
                                       "top10_between_users_overlap")},
      **run.summary.privacy(plan, EPSILON_COVERS, options.private),
      "epsilon_budget": options.epsilon, "noise_multiplier": plan.noise_multiplier,
      "item_pairs": dict(release, **item2item_lib.settings(options)),
      "item_frequencies": source,
      "train_examples": int(len(examples.items)), "items": examples.num_items,
      "public_users": options.public_users, "seed": options.seed, "run_dir": options.run_dir,
      "seconds": time.perf_counter() - timer}
  return summary


def _summary(options, examples, plan, history, metrics, timer, run, resume):
  losses = history.get("loss") or [resume.loss if resume.loss is not None else float("nan")]
  notes, forward = [], None
  if plan.forward is not None:
    forward = dp_forward_lib.summary(plan.forward, options.dp_forward)
    notes.append(forward["privacy_note"])
  summary = {
      "model": "dpformer" if options.reattention else "vanilla", "public_users": 0.0,
      "tied": options.tied, "reattention": options.reattention,
      "ndcg_at_10": metrics["ndcg_at_10"], "hit_at_10": metrics["hit_at_10"],
      "test_users": metrics["users"], "by_popularity": metrics["by_popularity"],
      "validation": metrics.get("validation"),
      "selected_on": "validation" if "validation" in metrics else None,
      **{key: metrics[key] for key in ("distinct_top10_items", "top10_popularity_overlap",
                                       "top10_between_users_overlap")},
      **run.summary.privacy(plan, EPSILON_COVERS, options.private, notes),
      "epsilon_budget": options.epsilon, "noise_multiplier": plan.noise_multiplier,
      "sampling_rate": plan.sampling_rate, "steps": plan.steps, "epochs": options.epochs,
      "batch_size": options.batch_size, "learning_rate": options.learning_rate,
      "l2_norm_clip": options.l2_norm_clip, "normalization_offset": options.normalization_offset,
      "item_rank": options.item_rank, "item_norm_share": options.item_norm_share,
      "loss_positions": options.loss_positions, "train_examples": int(len(examples.items)),
      "items": examples.num_items, "steps_per_second": timer.steps_per_second,
      "seed": options.seed, "run_dir": options.run_dir, "resumed_from_step": resume.step,
  }
  if forward is not None:
    summary.update(model="dp-forward", poisson=False, dp_forward=forward,
                   privacy_notion=forward["privacy_notion"])
  if options.diagnostics:
    summary["diagnostics_nonprivate"] = {
        "final_loss": float(losses[-1]),
        "note": "NOT covered by ε: the exact (unclipped) training loss of the last step"}
  return summary
