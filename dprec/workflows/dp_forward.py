"""DP-Forward training of the sequential recommender (Du et al., "DP-Forward: Fine-tuning and
Inference on Language Models with Differential Privacy in Forward Pass", arXiv:2309.06746): labels,
plan, releases, summary.

The user's side (encoder up to the `ForwardNoise` layer, `SeqRecConfig.dp_forward`) releases one
noised representation per user per epoch, with its next-item label; the service trains the rest
with ordinary steps. Each epoch is one pass over the users in fixed-size shuffled batches, so
every user is released at most once per epoch (the remainder of N/B waits for the next epoch),
and E epochs cost the E-fold Gaussian composition (`dprec.privacy.forward`). The ledger is
charged one release at the start of each epoch (`EpochReleaseCallback`; plus ε2 once, paid by the
`train seqrec` workflow, if labels go through randomized response). Only the last label of each
sequence is kept: the earlier ones are its own items.

The guarantee is SeqLDP, per user and local, not central DP: it must never be read as DP-SGD's.
"""
import io
import os

import numpy as np
import tensorflow as tf

from dprec import atomic_io
from dprec import privacy
from dprec.data.sequences import read_item_frequencies
from dprec.errors import DprecError
from dprec.privacy import forward as forward_privacy
from dprec.privacy import label_rr
from dprec.workflows import plan as plan_lib
from dprec.workflows.seqrec_options import DPForwardOptions  # noqa: F401

PRIOR_NOTE = ("label prior: the training item frequencies, treated as public as Re-Attention "
              "treats them (Ding et al. 2023, arXiv:2305.17633, Remark A.2); a private prior is "
              "not covered by epsilon2")


def steps_per_epoch(num_examples, batch_size):
  if batch_size > num_examples:
    raise DprecError(f"--batch-size {batch_size} exceeds the {num_examples} training users")
  return num_examples // batch_size


def plan(target_epsilon, delta, epochs, options: DPForwardOptions, accountant="pld",
         spent=privacy.Spent()):
  """σ for E epoch releases after deducting ε2 and what the ledger spent before (`spent`;
  `dprec.privacy.forward.plan_forward`)."""
  try:
    options.model_config(1.0)
  except ValueError as error:
    raise DprecError(str(error)) from error
  return forward_privacy.plan_forward(target_epsilon, delta, epochs, options.norm_bound,
                                      options.label_epsilon, accountant, spent)


def plan_run(options, delta, num_examples, spent=privacy.Spent()) -> plan_lib.PrivacyPlan:
  """The `train seqrec --dp-forward` plan: `plan`'s σ for the E epoch releases, composed with
  what the run's ledger `spent` on the data before, T = E·⌊N/B⌋ service steps (`options`: the
  run's `SeqRecTrainOptions`)."""
  forward = plan(options.epsilon, delta, options.epochs, options.dp_forward, options.accountant,
                 spent)
  return plan_lib.PrivacyPlan(
      options.epsilon, delta, options.batch_size / num_examples,
      forward.epochs * steps_per_epoch(num_examples, options.batch_size),
      forward.noise_multiplier, examples_per_period=num_examples, batch_size=options.batch_size,
      accountant=options.accountant, poisson=not options.fixed_batches, forward=forward)


def label_prior(item_frequencies, item_ids, num_items):
  """RR-with-prior's prior over items (Du et al. 2023): it must not come from the private labels,
  so the public item frequency file `item_frequencies` (None: uniform)."""
  if item_frequencies is not None:
    return read_item_frequencies(item_frequencies, item_ids)
  return np.full(num_items + 1, 1.0 / num_items)


def training_labels(labels, item_frequencies, label_epsilon=0.0, rng=None, saved=None):
  """Labels [N, L] with only the last position kept (randomised with RR-with-prior at ε2 > 0,
  once per user, from the OS CSPRNG unless `rng` is given).

  `saved` (a file in the private run directory) keeps the randomised labels, so that a resumed
  run reuses them: a second draw would be a second release of every label.
  """
  kept = np.zeros_like(labels)
  kept[:, -1] = labels[:, -1]
  if label_epsilon <= 0:
    return kept
  if saved is not None and os.path.exists(saved):
    last = np.load(saved)
    if last.shape != kept[:, -1].shape:
      raise DprecError(f"{saved}: randomised labels of another data set ({last.shape[0]} users, "
                       f"not {len(kept)})")
  else:
    last = label_rr.rr_with_prior(item_frequencies, label_epsilon).apply(kept[:, -1], rng)
    if saved is not None:
      buffer = io.BytesIO()
      np.save(buffer, last)
      atomic_io.write_bytes(saved, buffer.getvalue())
  kept[:, -1] = last
  return kept


class EpochReleaseCallback(tf.keras.callbacks.Callback):
  """Charges the ledger one Gaussian release per user at the first step of each epoch.

  `step` is where the run starts (a resumed run), `epochs_paid` the releases this run's label
  already holds; an epoch is never paid twice. Over the budget: raises before the epoch runs.
  """

  def __init__(self, ledger, forward_plan, steps_per_epoch, label, step=0, epochs_paid=0):
    super().__init__()
    self.ledger, self.plan = ledger, forward_plan
    self.per_epoch, self.label = steps_per_epoch, label
    self.step, self.epochs_paid = step, epochs_paid

  def on_train_batch_begin(self, batch, logs=None):
    if self.step // self.per_epoch >= self.epochs_paid:
      self.ledger.charge_gaussian(self.plan.noise_multiplier,
                                  forward_privacy.RELEASE_SAMPLING_RATE, 1, label=self.label)
      self.epochs_paid += 1

  def on_train_batch_end(self, batch, logs=None):
    self.step += 1
    if logs is not None:
      logs["epsilon"] = self.ledger.epsilon_spent()


def pay_before_training(run, plan, label, start_step, steps_per_epoch_):
  """Refuses (before any charge) a run whose unpaid releases and label ε2 exceed the ledger's
  budget, pays ε2 once (label `label labels`) and returns the `EpochReleaseCallback` paying one
  release per epoch under `label`; a resumed run pays nothing twice."""
  labels = {f"{label} labels": plan.forward.label_epsilon}
  run.budget.check(plan, label, plan.forward.epochs, labels,
                   sampling_rate=forward_privacy.RELEASE_SAMPLING_RATE)
  run.budget.pay_once(plan, {name: (epsilon, 0.0) for name, epsilon in labels.items()})
  return EpochReleaseCallback(run.budget.ledger, plan.forward, steps_per_epoch_, label, start_step,
                              run.budget.steps_paid(label))


def summary(forward_plan, options: DPForwardOptions):
  """What the run's JSON summary says about DP-Forward: the notion, both ε, the noise."""
  report = forward_plan.to_dict()
  report.update(
      position=options.position, bound=options.bound, encoder_updates=options.encoder_updates,
      reduced_dim=options.reduced_dim, noise_at_inference=options.at_inference,
      service_steps="non-private (the service trains on noised representations)")
  if options.encoder_updates == "trusted":
    report["encoder_note"] = (
        "encoder gradients were computed from raw sequences (the paper's experiments): SeqLDP "
        "covers the representations only; those gradients need a trusted party or secure "
        "aggregation")
  if options.label_epsilon:
    report["label_prior_note"] = PRIOR_NOTE
  if options.at_inference:
    report["inference_epsilon_per_query"] = forward_privacy.seqldp_epsilon(
        forward_plan.noise_multiplier, 1, forward_plan.delta, forward_plan.accountant)
    report["inference_note"] = ("each evaluation query releases one noised representation: "
                                "(inference_epsilon_per_query, delta)-LDP per query, on top of "
                                "training")
  return report
