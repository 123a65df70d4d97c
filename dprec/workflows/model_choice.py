"""`train seqrec --model auto`: item2item or the transformer, from the data's shape.

The rule reads three numbers. N (training users) and M (items) are public in dprec's privacy
model (README, "Privacy model": N sets δ and q; the item vocabulary is built from the data and
assumed public). The third, the mean number of scored positions per user p (each user's
next-item targets in training, between 0 and the maximum length L), is released under DP:
the sum of the users' counts, centred on L/2, has sensitivity L/2 for adding or removing a user,
and gets Gaussian noise calibrated for (ε0, δ0) = `model_choice_share`·(ε, δ)
(`dprec.privacy.label_stats.dp_mean`; the noise comes from the run's secret key). The scored
positions per item r = N·p/M are post-processing of it.

Accounting. Which model trains, and so which releases follow with which parameters, depends on
p: an adaptive choice of mechanism. Composing the release of p with each model's releases in
the accountant (PLD) would bound each fixed branch, not the adaptive mixture. So p is an
(ε0, δ0)-DP release composed by basic composition, which holds for adaptively chosen
mechanisms (Dwork, Rothblum & Vadhan, "Boosting and Differential Privacy", 2010): every branch
is planned as if the ledger had spent (ε0, δ0) before it (`with_choice`, the plan's `spent`),
so each is (ε − ε0, δ − δ0)-DP and the run (ε, δ)-DP, whichever model p picks. The ledger
records p as an (ε0, δ0) charge under its own label `LABEL` and composes it the same way.

The transformer is chosen when p ≥ `MIN_POSITIONS_PER_USER` and r ≥ `MIN_POSITIONS_PER_ITEM`
(long histories over few items: the next-item loss has signal at many positions, and every
item row is trained by many users), item2item otherwise. The thresholds sit between the two
shapes measured at ε = 5 (docs/guide/seqrec.md, "Which model"): Amazon Games (p ≈ 6.9,
r ≈ 9), where item2item beats the transformer, and MovieLens-100k after 5-core (943 users,
1,349 items, p near the cap L = 50, r ≈ 30), where the transformer trained as in DPFormer
(Ding et al., "DPFormer: Learning Differentially Private Transformer on Long-Tailed Data",
arXiv:2305.17633, §5 and App. A.9) beats item2item and the popularity list; each is near the
geometric midpoint of those values. When the transformer is chosen, its options still at their
defaults take the paper's MovieLens schedule (`TRANSFORMER_SETTINGS`: 100 epochs, the
learning rate warmed up over the first 20% of steps then linearly decayed, per-user gradient
normalisation C/(‖g‖ + 0.01), dropout 0.2); B stays min(1024, N/8).
"""
import dataclasses

import numpy as np

from dprec import privacy
from dprec.privacy import label_stats

AUTO = "auto"
LABEL = "train seqrec model choice"
CANDIDATES = ("item2item", "dpformer")
MIN_POSITIONS_PER_USER = 16.0
MIN_POSITIONS_PER_ITEM = 16.0
# Ding et al. 2023, App. A.9 (MovieLens): 100 epochs, normalised gradients at C = 1, dropout
# 0.2; the learning rate is 5e-3 from the paper's grid (the warm-up and decay are
# `dprec.models.seqrec.warmup_linear_decay`'s).
TRANSFORMER_SETTINGS = {"epochs": 100.0, "learning_rate": 5e-3, "dropout": 0.2,
                        "normalization_offset": 0.01}


def candidates(options):
  """The options `--model auto` may resolve to (each must be valid before anything is
  released, so that a refusal never depends on the release)."""
  return [_resolved(options, model) for model in CANDIDATES]


def _resolved(options, model):
  changes = {"model": model, "auto_model": True}
  if model == "dpformer":
    defaults = type(options)()
    changes.update({key: value for key, value in TRANSFORMER_SETTINGS.items()
                    if getattr(options, key) == getattr(defaults, key)})
  return dataclasses.replace(options, **changes)


def budget(options, delta):
  """(ε0, δ0) of the release of p when `--model auto` chose the model in a private run at δ,
  else None."""
  if options.auto_model and options.private:
    return options.model_choice_share * options.epsilon, options.model_choice_share * delta
  return None


def with_choice(options, spent, delta):
  """`spent` (a `dprec.privacy.Spent`) with the choice's (ε0, δ0) added, by basic composition."""
  charge = budget(options, delta)
  if charge is None:
    return spent
  return dataclasses.replace(spent, selections=spent.selections + (charge,))


def selections(options, delta):
  """{LABEL: (ε0, δ0)}: the ledger charge of the choice (empty when nothing was released)."""
  charge = budget(options, delta)
  return {} if charge is None else {LABEL: charge}


def scored_positions(examples):
  """Each training user's scored positions: their next-item targets, in [1, L]."""
  return np.count_nonzero(examples.labels, axis=1)


def release(examples, max_len, sigma, rng):
  """p, the mean scored positions per user: their sum centred on L/2 (sensitivity L/2) plus
  N(0, (σ·L/2)²), over the public N (`label_stats.dp_mean`; σ 0: exact)."""
  return label_stats.dp_mean(scored_positions(examples), (0, max_len), sigma, rng)


def choose(mean_positions, num_users, num_items):
  """(model, reason): the rule of the module docstring on p, N and M."""
  per_item = num_users * mean_positions / num_items
  if mean_positions >= MIN_POSITIONS_PER_USER and per_item >= MIN_POSITIONS_PER_ITEM:
    return "dpformer", (
        f"long histories over few items: {mean_positions:.1f} scored positions per user "
        f"(>= {MIN_POSITIONS_PER_USER:g}) and {per_item:.1f} per item (>= "
        f"{MIN_POSITIONS_PER_ITEM:g})")
  return "item2item", (
      f"short or sparse histories: {mean_positions:.1f} scored positions per user (transformer "
      f"from {MIN_POSITIONS_PER_USER:g}) and {per_item:.1f} per item (from "
      f"{MIN_POSITIONS_PER_ITEM:g})")


def resolve(options, examples, delta, rng):
  """(options with the chosen model and `auto_model` set, the choice's summary). Releases p at
  σ calibrated for (ε0, δ0) = `model_choice_share`·(ε, `delta`) (ε = inf: the exact mean,
  charged nothing); `rng` is the run's secret generator for `LABEL`."""
  num_users, num_items, max_len = len(examples.items), examples.num_items, options.max_len
  charge = budget(dataclasses.replace(options, auto_model=True), delta)
  sigma = charge and privacy.calibrate_gaussian_mechanism(*charge, options.accountant)
  mean = release(examples, max_len, sigma or 0.0, rng)
  model, reason = choose(mean, num_users, num_items)
  resolved = _resolved(options, model)
  applied = {key: getattr(resolved, key) for key in TRANSFORMER_SETTINGS
             if model == "dpformer" and getattr(resolved, key) != getattr(options, key)}
  return resolved, {
      "model": model, "by": "--model auto", "reason": reason,
      "mean_scored_positions": mean, "scored_positions_per_item": num_users * mean / num_items,
      "rule": {"min_positions_per_user": MIN_POSITIONS_PER_USER,
               "min_positions_per_item": MIN_POSITIONS_PER_ITEM},
      "public": {"train_examples": num_users, "items": num_items, "max_len": max_len},
      "private": options.private, "epsilon_share": options.model_choice_share if sigma else 0.0,
      "epsilon": charge and charge[0], "delta": charge and charge[1], "noise_multiplier": sigma,
      "sensitivity": max_len / 2, "composition": charge and "basic (adaptive choice)",
      "ledger_label": LABEL if sigma else None, "settings_applied": applied}


def given(options):
  """The choice's summary when `--model` named the model: nothing released, nothing charged."""
  return {"model": options.model, "by": "--model", "epsilon_share": 0.0}

