"""`dprec train seqrec`: DPFormer (seed 000) on a `dprec preprocess sequences` output directory.

    dprec train seqrec --data DIR --epsilon 5 [--no-reattention] [--untied] --epochs N

One example per user (user-level DP, note 000 §4): the user's training sequence, with the
validation item appended when the job held one out, predicts the next item at every position.
The test item is ranked against all M items from the full history (train + validation items).
σ is calibrated from ε (δ = 1/N by default) for Poisson sampling at q = B/N over the planned steps
(`dprec.privacy`), charged to a ledger as training runs; `--epsilon inf` trains without privacy.
Re-Attention's p_i come from a public file (`--item-frequencies`) or, by default, from a DP
histogram of users per item (`dprec.privacy.user_histogram`) drawn once before training, charged
to the same ledger and composed with training by the accountant: it gets `--item-frequency-share`
of ε and training's σ is calibrated for the rest.
Adam (decoupled weight decay 1e-5) with 20% linear warm-up then linear decay, as in the paper.

The noise, the Poisson batches and the histogram's noise come from the run's secret key
(`dprec.workflows.run.Run`); `--seed` seeds only initialisation and dropout;
`--insecure-noise-seed N` makes the noise reproducible and the run not private.

With `--run-dir DIR` the run checkpoints atomically every `--checkpoint-every` steps (model,
Adam slots, data position) and keeps its ledger and secret key there; the same command resumes
a killed run from its last checkpoint on the very batches and noise an uninterrupted run would
have used (a step's noise is derived from the key and the step), paying no step twice (the
100-epoch paper schedule takes hours on a CPU).

`--dp-forward` trains DP-Forward instead (seed 003, `dprec.models.dp_forward`): noise on each
user's representation, SeqLDP (local, per user), non-private steps on the service's side.
"""
import argparse
import dataclasses
import json
import math
import os
from typing import Optional

import numpy as np
import tensorflow as tf

from dprec.errors import BudgetExceededError, DprecError
from dprec.layers.reattention import ReAttentionConfig
from dprec.models import dp_forward as dp_forward_lib
from dprec.models import ranking_metrics
from dprec.models.seqrec import SeqRecConfig, SeqRecModel, warmup_linear_decay
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import ADAMBC_FLOOR, AdamBC
from dprec.progress import progress_bar
from dprec.training import callbacks as callbacks_lib
from dprec.training import checkpoint as ckpt_lib
from dprec.training import poisson
from dprec.workflows.run import Run

LEDGER_LABEL = "train seqrec"
FREQUENCIES_LABEL = f"{LEDGER_LABEL} item frequencies"
EPSILON_COVERS = {
    "epsilon": "(epsilon, delta)-DP for adding or removing one user (all of their training "
               "sequence), covering the model (weights and Re-Attention's p_i)",
    "public": ["settings", "noise multipliers", "train_examples (N) and items (M), assumed "
               "public", "steps_per_second"],
    "held_out_evaluation": "ndcg_at_10, hit_at_10, by_popularity and test_users rank each test "
                           "user's held-out last item given their history, which IS training "
                           "data of this run: these metrics are not covered by ε",
    "not_covered": "diagnostics_nonprivate (only with --diagnostics): the exact training loss",
}


@dataclasses.dataclass
class SeqRecTrainOptions:
  """Everything one `train seqrec` run needs (defaults: the paper's Amazon setting, note 000 §5–7)."""
  data: Optional[str] = None
  epsilon: float = 5.0
  delta: Optional[float] = None
  epochs: float = 100.0
  batch_size: Optional[int] = None  # None: chosen from N (poisson.default_batch_size)
  learning_rate: float = 5e-3
  optimizer: str = "adamw"
  adambc_floor: float = ADAMBC_FLOOR
  weight_decay: float = 1e-5
  l2_norm_clip: float = 1.0
  normalization_offset: Optional[float] = None
  max_len: int = 50
  dim: int = 64
  item_rank: Optional[int] = None
  num_blocks: int = 2
  num_heads: int = 1
  dropout: float = 0.5
  reattention: bool = True
  tied: bool = True
  loss_positions: str = "all"
  score_padding: bool = False
  reattention_scale_by_dim: bool = True
  reattention_at_eval: bool = True
  variance_scale: float = 1.0
  item_frequencies: Optional[str] = None  # public p_i file; None: DP histogram
  item_frequency_share: float = 0.05
  fixed_batches: bool = False
  accountant: str = "pld"
  ledger: Optional[str] = None
  charge_every: int = 100
  run_dir: Optional[str] = None
  checkpoint_every: int = 100
  keep_checkpoints: Optional[int] = 2  # None or 0: keep all
  exclude_history: bool = False
  eval_batch_size: int = 256
  seed: int = 0
  insecure_noise_seed: Optional[int] = None
  diagnostics: bool = False
  progress: bool = True
  summary_json: Optional[str] = None
  dp_forward: Optional[dp_forward_lib.DPForwardOptions] = None

  def __post_init__(self):
    if isinstance(self.dp_forward, dict):  # from a checkpoint's fingerprint
      self.dp_forward = dp_forward_lib.DPForwardOptions(**self.dp_forward)

  @property
  def private(self):
    return math.isfinite(self.epsilon)

  def validate(self):
    if not self.epsilon > 0:
      raise DprecError(f"--epsilon must be positive (or inf), got {self.epsilon}")
    if not self.epochs > 0 or (self.batch_size is not None and self.batch_size < 1):
      raise DprecError(f"--epochs and --batch-size must be positive, got {self.epochs}, "
                       f"{self.batch_size}")
    if self.dim % self.num_heads:
      raise DprecError(f"--dim {self.dim} must be divisible by --heads {self.num_heads}")
    if self.item_rank is not None and not 1 <= self.item_rank <= self.dim:
      raise DprecError(f"--item-rank must be in [1, --dim {self.dim}], got {self.item_rank}")
    if self.item_rank is not None and self.dp_forward is not None:
      raise DprecError("--item-rank does not combine with --dp-forward")
    if not 0 < self.item_frequency_share < 1:
      raise DprecError(f"--item-frequency-share must be in (0, 1), got "
                       f"{self.item_frequency_share}")
    if self.optimizer not in ("adamw", "adambc") or not self.adambc_floor > 0:
      raise DprecError(f"--optimizer must be adamw or adambc and --adambc-floor positive, got "
                       f"{self.optimizer}, {self.adambc_floor}")
    if self.checkpoint_every < 1:
      raise DprecError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
    if self.keep_checkpoints is not None and self.keep_checkpoints < 0:
      raise DprecError(f"--keep-checkpoints must be >= 0, got {self.keep_checkpoints}")
    if self.dp_forward is not None and (not self.private or self.loss_positions != "last"):
      raise DprecError("--dp-forward needs a finite --epsilon and --loss-positions last")

  def run_fingerprint(self):
    """The options a resumed run must share with the run it continues (not where files go,
    how it reports, or how it evaluates)."""
    ignored = {"data", "ledger", "run_dir", "checkpoint_every", "keep_checkpoints",
               "exclude_history", "eval_batch_size", "progress", "summary_json",
               "reattention_at_eval", "diagnostics"}
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}

  def model_config(self, num_items):
    return SeqRecConfig(
        num_items=num_items, max_len=self.max_len, dim=self.dim, num_blocks=self.num_blocks,
        num_heads=self.num_heads, ffn_dim=self.dim, dropout=self.dropout, tied=self.tied,
        item_rank=self.item_rank, loss_positions=self.loss_positions, score_padding=self.score_padding,
        reattention=ReAttentionConfig(enabled=self.reattention,
                                      scale_by_dim=self.reattention_scale_by_dim,
                                      at_eval=self.reattention_at_eval))


@dataclasses.dataclass
class SeqRecExamples:
  """Training examples (one per user with a next-item target) and the test users."""
  items: np.ndarray  # int32 [N, L] inputs, left-padded
  labels: np.ndarray  # int32 [N, L] next items (0 = none)
  test_histories: np.ndarray  # int32 [U', L]
  test_items: np.ndarray  # int64 [U']
  item_frequencies: np.ndarray  # float64 [M + 1]

  @property
  def num_items(self):
    return len(self.item_frequencies) - 1


def make_examples(data, max_len):
  """Builds `SeqRecExamples` from a `dprec.data.sequences.SequenceData`."""
  histories = [np.append(train, valid) if valid > 0 else np.asarray(train)
               for train, valid in zip(data.train, data.valid_items)]
  trainable = [h for h in histories if len(h) >= 2]
  if not trainable:
    raise DprecError("no user has two or more training items: nothing to train on")
  items = np.zeros((len(trainable), max_len), np.int32)
  labels = np.zeros((len(trainable), max_len), np.int32)
  for row, history in enumerate(trainable):
    inputs, targets = history[:-1][-max_len:], history[1:][-max_len:]
    items[row, max_len - len(inputs):] = inputs
    labels[row, max_len - len(targets):] = targets
  tested = np.flatnonzero(data.test_items > 0)
  test_histories = np.zeros((len(tested), max_len), np.int32)
  for row, user in enumerate(tested):
    tail = histories[user][-max_len:]
    test_histories[row, max_len - len(tail):] = tail
  return SeqRecExamples(items, labels, test_histories, data.test_items[tested],
                        np.asarray(data.item_frequencies, np.float64))


@dataclasses.dataclass
class PrivacyPlan:
  noise_multiplier: Optional[float]
  delta: Optional[float]
  sampling_rate: float
  steps: int
  frequency_noise_multiplier: Optional[float] = None  # of the DP histogram of p_i, if any
  forward: Optional[object] = None  # DP-Forward's `dprec.privacy.ForwardPlan`


def plan_privacy(options, num_examples, ledger=None, spent=None):
  """Steps = epochs·N/B; σ calibrated so the run spends exactly ε at δ (default: the `ledger`'s,
  else 1/N), composed with what the ledger spent before the run (`spent`)."""
  from dprec import privacy  # pylint: disable=import-outside-toplevel
  if options.batch_size > num_examples:
    raise DprecError(f"--batch-size {options.batch_size} exceeds the {num_examples} training "
                     "users; give a smaller one or none (then it is chosen from N)")
  delta = (ledger.delta if ledger is not None else
           options.delta if options.delta is not None else 1.0 / num_examples)
  if options.dp_forward is not None:
    forward = dp_forward_lib.plan(options.epsilon, delta, options.epochs, options.dp_forward,
                                  options.accountant)
    steps = forward.epochs * dp_forward_lib.steps_per_epoch(num_examples, options.batch_size)
    return PrivacyPlan(forward.noise_multiplier, delta, options.batch_size / num_examples, steps,
                       forward=forward)
  q = poisson.BatchSampling(options.batch_size).sampling_rate(num_examples)
  steps = max(1, int(round(options.epochs * num_examples / options.batch_size)))
  if not options.private:
    return PrivacyPlan(None, None, q, steps)
  histogram = []
  if options.reattention and options.item_frequencies is None:
    histogram = [privacy.calibrate_gaussian_mechanism(
        options.item_frequency_share * options.epsilon, delta, options.accountant)]
  plan = privacy.plan_training(options.epsilon, delta, [(q, steps)],
                               accountant=options.accountant, poisson=not options.fixed_batches,
                               gaussian_mechanisms=histogram, spent=spent or privacy.Spent())
  return PrivacyPlan(plan.noise_multiplier, delta, q, steps, *histogram)


def item_frequencies(options, data, examples, plan, generator):
  """Re-Attention's p_i (None without DP or Re-Attention): the public `--item-frequencies` file,
  else a DP histogram of users per item over the training rows (noise from `generator`)."""
  from dprec.data import sequences  # pylint: disable=import-outside-toplevel
  from dprec.privacy import user_histogram  # pylint: disable=import-outside-toplevel
  if not (options.private and options.reattention) or options.dp_forward is not None:
    return None
  if options.item_frequencies is not None:
    if data.item_ids is None:
      raise DprecError("--item-frequencies needs the data set's item ids (item_ids.txt)")
    return sequences.read_item_frequencies(options.item_frequencies, data.item_ids)
  return user_histogram.dp_item_frequencies(examples.items, examples.num_items,
                                            plan.frequency_noise_multiplier, generator)


def _label_prior(options, data, examples):
  """RR-with-prior's prior over items (note 003 §3.4): it must not come from the private labels,
  so the public `--item-frequencies` file, else uniform."""
  from dprec.data import sequences  # pylint: disable=import-outside-toplevel
  if options.item_frequencies is not None:
    return sequences.read_item_frequencies(options.item_frequencies, data.item_ids)
  return np.full(examples.num_items + 1, 1.0 / examples.num_items)


def build_model(options, examples, plan, frequencies=None, noise_key=None):
  """A compiled `SeqRecModel`; Re-Attention's error model is set from the plan and `frequencies`
  (`item_frequencies`; None leaves it to a checkpoint restored into the model). The DP and
  DP-Forward noise generators are keyed from `noise_key` (a run's; None: a fresh secret one)."""
  from dprec.privacy.noise_key import NoiseKey  # pylint: disable=import-outside-toplevel
  noise_key = noise_key or NoiseKey.fresh()
  config = options.model_config(examples.num_items)
  if plan.forward is not None:
    config = dataclasses.replace(
        config, dp_forward=options.dp_forward.model_config(plan.noise_multiplier))
  model = SeqRecModel(config, forward_noise_generator=noise_key.tf_generator(FORWARD_NOISE))
  model({"items": examples.items[:1]})
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
                                      noise_key=noise_key))
  return model


FORWARD_NOISE = "forward noise"


def noise_generators(model):
  """{purpose: generator} of the model's secret noise, re-keyed at every step."""
  generators = {"dp step": model.dp_optimizer.generator}
  if model.forward_noise is not None:
    generators[FORWARD_NOISE] = model.forward_noise.generator
  return generators


def evaluate(model, examples, options):
  """Full-ranking NDCG@10 / HIT@10, overall and per popularity bucket (in [0, 1])."""
  buckets = ranking_metrics.popularity_buckets(examples.item_frequencies)
  progress = None
  if options.progress:
    progress = lambda it: progress_bar(it, desc="full ranking", unit="batch")
  score = tf.function(model.score_items, reduce_retracing=True)
  return ranking_metrics.evaluate_full_ranking(
      lambda h: score(tf.constant(h)), examples.test_histories, examples.test_items, buckets,
      batch_size=options.eval_batch_size, exclude_history=options.exclude_history,
      progress=progress)


def train_seqrec(options, data=None):
  """Trains and evaluates; returns the JSON summary (also written to `options.summary_json`).

  With `options.run_dir`, resumes from the newest checkpoint there (see the module docstring).
  """
  from dprec.data.sequences import load_sequences  # pylint: disable=import-outside-toplevel
  options.validate()
  data = data or load_sequences(options.data)
  examples = make_examples(data, options.max_len)
  batch_size_chosen = options.batch_size is None
  if batch_size_chosen:
    options = dataclasses.replace(
        options, batch_size=poisson.default_batch_size(len(examples.items)))
  tf.keras.utils.set_random_seed(options.seed)
  with Run("train seqrec", options.run_dir, options.ledger, options.insecure_noise_seed,
           options.data) as run:
    ledger = run.open_ledger(options.epsilon, options.delta, options.accountant,
                             default_delta=1.0 / len(examples.items)) if options.private else None
    plan = plan_privacy(options, len(examples.items), ledger, run.spent_before(ledger))
    if plan.forward is not None:
      examples = dataclasses.replace(examples, labels=dp_forward_lib.training_labels(
          examples.labels, _label_prior(options, data, examples), plan.forward.label_epsilon,
          rng=run.numpy_rng("label rr"),
          saved=options.run_dir and os.path.join(options.run_dir, "rr_labels.npy")))
    # The histogram's noise comes from the run's key, so a resumed run draws the same p_i.
    frequencies = item_frequencies(options, data, examples, plan,
                                   run.numpy_rng("item histogram"))
    model = build_model(options, examples, plan, frequencies, run.noise_key)
    state = _RunState(options, examples, model)
    remaining = plan.steps - state.step
    timer = callbacks_lib.StepTimer()
    callbacks = [timer, run.noise_callback(noise_generators(model), start_step=state.step)]
    # The ledger is charged (the histogram too) before the first checkpoint holds p_i.
    if plan.forward is not None:
      release_charges = _prepare_forward_ledger(ledger, options, plan, run, state,
                                                len(examples.items))
      callbacks.append(release_charges)
    elif options.private:
      _prepare_ledger(ledger, options, plan, run)
      callbacks.append(callbacks_lib.PrivacyBudgetCallback(
          ledger, plan.noise_multiplier, plan.sampling_rate, poisson=not options.fixed_batches,
          charge_every=options.charge_every, label=LEDGER_LABEL, steps_taken=state.step,
          steps_charged=run.steps_paid(ledger, LEDGER_LABEL)))
    sampling = poisson.BatchSampling(options.batch_size, options.private and not
                                     options.fixed_batches and plan.forward is None,
                                     run.entropy("poisson"))
    dataset = poisson.sampled_dataset({"items": examples.items}, examples.labels, sampling,
                                      plan.steps, start=state.step)
    if state.checkpoints is not None:
      callbacks.append(state.checkpoint_callback(options.checkpoint_every))
    if options.progress:
      callbacks.append(callbacks_lib.ProgressBar(desc="train seqrec", initial=state.step,
                                                 diagnostics=options.diagnostics))
    history = {}
    if remaining > 0:
      history = model.fit(dataset, epochs=1, steps_per_epoch=remaining, callbacks=callbacks,
                          verbose=0).history
    metrics = evaluate(model, examples, options)
    summary = _summary(options, examples, plan, history, metrics, timer, ledger, run, state)
    summary["batch_size_chosen"] = batch_size_chosen
    summary["item_frequencies"] = _frequency_source(options, plan, frequencies)
  if options.summary_json:
    with open(options.summary_json, "w", encoding="utf-8") as out:
      json.dump(summary, out, indent=2, sort_keys=True)
  return summary


def checkpoint_objects(model):
  """What a run's checkpoint holds: the model, its Adam slots and step (no generator state: the
  noise is re-derived from the run's secret key and the step)."""
  return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def options_from_checkpoint(path, **overrides):
  """The `SeqRecTrainOptions` of the run that wrote checkpoint directory `path` (`--run-dir`'s
  `checkpoints/ckpt-<n>`), e.g. to evaluate it: `overrides` set what the fingerprint omits."""
  fingerprint = ckpt_lib.CheckpointManager.read_state(path)["fingerprint"]
  fields = {f.name for f in dataclasses.fields(SeqRecTrainOptions)}
  return SeqRecTrainOptions(**{k: v for k, v in fingerprint.items() if k in fields}, **overrides)


class _RunState:
  """Where a run stands: a fresh start, or the newest checkpoint in `options.run_dir` restored
  into `model` (weights, Adam slots and step)."""

  def __init__(self, options, examples, model):
    self.fingerprint = dict(options.run_fingerprint(), train_examples=len(examples.items),
                            items=examples.num_items)
    self.objects = checkpoint_objects(model)
    self.checkpoints = None
    self.step, self.loss = 0, None
    if options.run_dir is None:
      return
    self.checkpoints = ckpt_lib.CheckpointManager(os.path.join(options.run_dir, "checkpoints"),
                                                  keep=options.keep_checkpoints or None)
    latest = self.checkpoints.latest()
    if latest is None:
      return
    state = self.checkpoints.read_state(latest)
    changed = {k: (state["fingerprint"].get(k), v) for k, v in self.fingerprint.items()
               if state["fingerprint"].get(k) != v}
    if changed:
      raise DprecError(
          f"{options.run_dir}: its checkpoints belong to a run with other settings ("
          + ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
          + "); resume with the same settings or use another --run-dir")
    self.objects.read(os.path.join(latest, ckpt_lib.MODEL_PREFIX)).assert_consumed()
    self.step, self.loss = state["step"], state["loss"]

  def checkpoint_callback(self, every):
    state = {"fingerprint": self.fingerprint, "loss": self.loss}
    return callbacks_lib.CheckpointCallback(self.checkpoints, self.objects, every, state,
                                            start_step=self.step)


def _prepare_forward_ledger(ledger, options, plan, run, state, num_examples):
  """DP-Forward's ledger checked and ε2 charged once; returns its per-epoch release charges."""
  epochs_paid = run.steps_paid(ledger, LEDGER_LABEL)
  label_paid = run.paid(ledger, LEDGER_LABEL + " labels")
  dp_forward_lib.prepare_ledger(ledger, plan.forward, epochs_paid, label_paid, LEDGER_LABEL)
  return dp_forward_lib.EpochReleaseCallback(
      ledger, plan.forward, dp_forward_lib.steps_per_epoch(num_examples, options.batch_size),
      LEDGER_LABEL, state.step, epochs_paid)


def _prepare_ledger(ledger, options, plan, run):
  """Charges the DP histogram to the run's ledger; raises if the steps still to pay for do not
  fit its budget. Only this run's own charges count as paid."""
  unpaid = plan.steps - run.steps_paid(ledger, LEDGER_LABEL)
  histogram = []
  if plan.frequency_noise_multiplier is not None and not run.paid(ledger, FREQUENCIES_LABEL):
    histogram = [(plan.frequency_noise_multiplier, FREQUENCIES_LABEL)]
  if unpaid <= 0 and not histogram:
    return
  planned = ledger.epsilon_if_charged(plan.noise_multiplier, plan.sampling_rate, max(unpaid, 0),
                                      poisson=not options.fixed_batches,
                                      gaussian_mechanisms=histogram)
  if planned > options.epsilon * (1 + 1e-6):
    raise BudgetExceededError(
        f"{ledger.path}: the planned run would bring the ledger to ε={planned:.4g} > budget "
        f"{options.epsilon:g} (already spent {ledger.epsilon_spent():.4g})")
  for sigma, label in histogram:  # released (into the model) before the first step
    ledger.charge_gaussian_mechanism(sigma, label)


def _frequency_source(options, plan, frequencies):
  """Where Re-Attention's p_i came from, for the summary."""
  if frequencies is None:
    return None
  if options.item_frequencies is not None:
    return {"source": "public file", "path": options.item_frequencies, "public": True}
  return {"source": "dp histogram", "epsilon_share": options.item_frequency_share,
          "noise_multiplier": plan.frequency_noise_multiplier,
          "max_items_per_user": options.max_len, "ledger_label": FREQUENCIES_LABEL}


def _summary(options, examples, plan, history, metrics, timer, ledger, run, state):
  losses = history.get("loss") or [state.loss if state.loss is not None else float("nan")]
  notes = ["fixed-size batches: not Poisson, accounted as if Poisson"] if (
      options.private and options.fixed_batches) else []
  summary = {
      "model": "dpformer" if options.reattention else "vanilla",
      "tied": options.tied, "reattention": options.reattention,
      "ndcg_at_10": metrics["ndcg_at_10"], "hit_at_10": metrics["hit_at_10"],
      "test_users": metrics["users"], "by_popularity": metrics["by_popularity"],
      "epsilon": ledger.epsilon_spent() if ledger else float("inf"),
      "epsilon_budget": options.epsilon, "delta": plan.delta,
      "noise_multiplier": plan.noise_multiplier, "sampling_rate": plan.sampling_rate,
      "steps": plan.steps, "epochs": options.epochs, "batch_size": options.batch_size,
      "learning_rate": options.learning_rate, "l2_norm_clip": options.l2_norm_clip,
      "normalization_offset": options.normalization_offset,
      "loss_positions": options.loss_positions, "train_examples": int(len(examples.items)),
      "items": examples.num_items,
      "steps_per_second": timer.steps_per_second, "seed": options.seed,
      "accountant": options.accountant if ledger else None,
      "poisson": bool(ledger is not None and not options.fixed_batches),
      "run_dir": options.run_dir, "resumed_from_step": state.step,
  }
  if plan.forward is not None:
    forward = dp_forward_lib.summary(plan.forward, options.dp_forward)
    summary.update(model="dp-forward", poisson=False, dp_forward=forward,
                   privacy_notion=forward["privacy_notion"])
    notes.append(forward["privacy_note"])
  summary.update(run.privacy_fields(options.private, EPSILON_COVERS, notes, ledger))
  if options.diagnostics:
    summary["diagnostics_nonprivate"] = {
        "final_loss": float(losses[-1]),
        "note": "NOT covered by ε: the exact (unclipped) training loss of the last step"}
  return summary


def _epsilon(text):
  try:
    return float(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"must be a number or 'inf', got {text!r}") from error


def register(subparsers):
  """Adds `seqrec` to the `train` group."""
  parser = subparsers.add_parser(
      "seqrec", help="train DPFormer (sequential recommender) with or without DP",
      description="Train the DPFormer sequential recommender (Phantom Clipping, Re-Attention) on "
      "a `dprec preprocess sequences` output; prints a JSON summary with full-ranking NDCG@10 "
      "and HIT@10 overall and by item popularity (head/torso/tail).")
  add = parser.add_argument
  add("--data", required=True, help="directory written by `dprec preprocess sequences`")
  add("--epsilon", type=_epsilon, default=5.0,
      help="privacy budget ε, the total: what --ledger spent on this data before is composed "
           "in; 'inf' trains non-privately")
  add("--delta", type=float, default=None,
      help="δ (default: the --ledger's if it exists, else 1/N training users)")
  add("--epochs", type=float, default=100.0, help="epochs (expected passes over the users)")
  add("--batch-size", type=int, default=None,
      help="expected batch size B (q = B/N); default: min(1024, N/8) for the N training users")
  add("--learning-rate", type=float, default=5e-3, help="peak Adam learning rate")
  add("--optimizer", choices=("adamw", "adambc"), default="adamw",
      help="AdamW, or DP-AdamBC (seed 002: Adam with the noise variance subtracted; same "
           "schedule and weight decay)")
  add("--adambc-floor", type=float, default=ADAMBC_FLOOR, help="γ' of --optimizer adambc")
  add("--l2-norm-clip", type=float, default=1.0, help="per-user gradient clip norm C")
  add("--normalize", type=float, nargs="?", const=0.01, default=None,
      dest="normalization_offset", metavar="GAMMA",
      help="normalise per-user gradients, C/(‖g‖+GAMMA) (automatic clipping, the paper's "
           "setting; GAMMA defaults to 0.01) instead of clipping min(1, C/‖g‖)")
  add("--max-len", type=int, default=50, help="maximum sequence length L")
  add("--dim", type=int, default=64, help="model dimension d")
  add("--item-rank", type=int, metavar="R",
      help="low-rank item table: M×R rows meeting the model through R×d projections, so the "
           "noise per item row shrinks from √d to √R (default: a full M×d table)")
  add("--blocks", type=int, default=2, dest="num_blocks", help="transformer blocks")
  add("--heads", type=int, default=1, dest="num_heads", help="attention heads")
  add("--dropout", type=float, default=0.5, help="dropout rate")
  add("--no-reattention", action="store_true", help="vanilla attention (baseline)")
  add("--untied", action="store_true", help="separate output embedding (the 'W/O PS' baseline)")
  add("--loss-positions", choices=("all", "last"), default="all",
      help="next-item loss at every position or at the last one only")
  add("--score-padding", action="store_true",
      help="score the padding positions too (fixed shapes; same loss, slower)")
  add("--variance-scale", type=float, default=1.0,
      help="multiplier of Re-Attention's effective-error variances σ_eff²")
  add("--item-frequencies", metavar="FILE",
      help="public Re-Attention frequencies p_i, lines 'ITEM_ID P' (ids as in the input logs); "
           "default: a DP histogram of users per item, charged to the ledger")
  add("--item-frequency-share", type=float, default=0.05, metavar="FRACTION",
      help="share of ε for the DP histogram of p_i (default 0.05; training's σ is calibrated "
           "for the rest)")
  add("--fixed-batches", action="store_true",
      help="fixed-size shuffled batches instead of Poisson sampling (ledger flags it)")
  add("--accountant", choices=("pld", "rdp"), default="pld", help="privacy accountant")
  add("--ledger", help="privacy ledger JSON file (default: DIR/ledger.json with --run-dir, "
      "else a temporary one)")
  add("--run-dir", metavar="DIR",
      help="checkpoint here and keep the ledger here; rerunning the same command resumes a "
           "killed run from its last checkpoint (same batches and noise, no step paid twice)")
  add("--checkpoint-every", type=int, default=100, metavar="N",
      help="steps between checkpoints with --run-dir (one is always written at the end)")
  add("--keep-checkpoints", type=int, default=2, metavar="K",
      help="keep the newest K checkpoints (0: all, e.g. for a learning curve with "
           "benchmarks/dpformer_amazon.py --curve)")
  add("--exclude-history", action="store_true", help="do not rank items already in the history")
  add("--eval-batch-size", type=int, default=256, help="users scored per evaluation batch")
  add("--seed", type=int, default=0,
      help="seed of initialisation and dropout only (public); noise and batches come from a "
           "secret key")
  add("--insecure-noise-seed", type=int, metavar="N",
      help="derive noise, batches and the histogram's noise from N: reproducible, NOT private "
           "(the summary and ledger say so)")
  add("--diagnostics", action="store_true",
      help="also report non-private diagnostics (the exact training loss), labelled so")
  dp_forward_lib.add_arguments(parser)
  add("--no-progress", action="store_true", help="no progress bars")
  add("--summary-json", help="also write the JSON summary to this file")
  parser.set_defaults(func=run)


def run(args):
  options = SeqRecTrainOptions(
      data=args.data, epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
      batch_size=args.batch_size, learning_rate=args.learning_rate, optimizer=args.optimizer,
      adambc_floor=args.adambc_floor,
      l2_norm_clip=args.l2_norm_clip, normalization_offset=args.normalization_offset,
      max_len=args.max_len, dim=args.dim, item_rank=args.item_rank,
      num_blocks=args.num_blocks, num_heads=args.num_heads, dropout=args.dropout,
      reattention=not args.no_reattention, tied=not args.untied,
      loss_positions=args.loss_positions, score_padding=args.score_padding,
      variance_scale=args.variance_scale, item_frequencies=args.item_frequencies,
      item_frequency_share=args.item_frequency_share,
      fixed_batches=args.fixed_batches, accountant=args.accountant, ledger=args.ledger,
      run_dir=args.run_dir, checkpoint_every=args.checkpoint_every,
      keep_checkpoints=args.keep_checkpoints,
      exclude_history=args.exclude_history, eval_batch_size=args.eval_batch_size,
      seed=args.seed, insecure_noise_seed=args.insecure_noise_seed,
      diagnostics=args.diagnostics, progress=not args.no_progress,
      summary_json=args.summary_json)
  if args.dp_forward:
    options = dataclasses.replace(options, dp_forward=dp_forward_lib.options_from_args(args),
                                  loss_positions="last", reattention=False)
  return train_seqrec(options)
