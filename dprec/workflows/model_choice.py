"""`train seqrec --model auto`: item2item or the transformer, from the data's shape.

The rule reads three numbers. N (training users) and M (items) are public in dprec's privacy
model (README, "Privacy model": N sets δ and q; the item vocabulary is built from the data and
assumed public). The third, the mean number of scored positions per user p (each user's
next-item targets in training, between 0 and the maximum length L), is released under DP:
the sum of the users' counts, centred on L/2, has sensitivity L/2 for adding or removing a user,
and gets Gaussian noise at σ calibrated alone for `model_choice_share` of ε
(`dprec.privacy.label_stats.dp_mean`; the noise comes from the run's secret key). It is a
mechanism of the run's plan beside the chosen model's releases, composed with them, and
charged to the ledger under its own label `LABEL`. The scored positions per item r = N·p/M are
post-processing of it.

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


def mechanisms(options):
  """[(ledger label, ε share)]: the release of p when `--model auto` chose the model (and the
  run is private), else none."""
  if options.auto_model and options.private:
    return [(LABEL, options.model_choice_share)]
  return []


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
  σ calibrated alone for `model_choice_share`·ε at `delta` (ε = inf: the exact mean, charged
  nothing); `rng` is the run's secret generator for `LABEL`."""
  num_users, num_items, max_len = len(examples.items), examples.num_items, options.max_len
  sigma = None
  if options.private:
    sigma = privacy.calibrate_gaussian_mechanism(options.model_choice_share * options.epsilon,
                                                 delta, options.accountant)
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
      "noise_multiplier": sigma, "sensitivity": max_len / 2,
      "ledger_label": LABEL if sigma else None, "settings_applied": applied}


def given(options):
  """The choice's summary when `--model` named the model: nothing released, nothing charged."""
  return {"model": options.model, "by": "--model", "epsilon_share": 0.0}

