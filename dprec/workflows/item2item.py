"""`train seqrec --model item2item`: next-item recommendation from DP item-to-item statistics.

One release, user-level DP (the unit `train seqrec` protects):
1. the DP histogram of users per item (`item_frequencies`, its `item_frequency_share` of ε): the
   items' popularity, and the item set, its `pair_item_set` most counted items (post-processing);
2. the pair statistics over that item set (`dprec.privacy.item_pairs`: each user's (item, later
   item) pairs scaled to norm 1, sensitivity 1), Gaussian noise on every cell, released where the
   noisy value reaches `pair_threshold`·σ: one Gaussian mechanism, σ calibrated so that it and the
   histogram compose (PLD) to ε at δ (the plan's one step at q = 1).
Both are charged to the run's ledger and drawn from the run's key; the model
(`dprec.models.item2item`) reads only them. ε = inf: the exact statistics over every item (the
non-private item-kNN baseline).

Public users (`--public-users`, `dprec.data.public_users`): both releases cover the private
users only (N, δ = 1/N and the sensitivities are theirs); the public users' exact counts and
pair statistics (over every item) are added to the released ones afterwards, public data added
to a release: post-processing, charged nothing.
"""
import dataclasses

import numpy as np
import scipy.sparse

from dprec.models.item2item import Item2ItemConfig, Item2ItemModel
from dprec.privacy import item_pairs
from dprec.privacy import user_histogram
from dprec.workflows import item_frequencies as frequencies_lib
from dprec.workflows import plan as plan_lib

LABEL = "train seqrec item pairs"


PAIR_SHARES = {"hybrid": 0.3, "dpformer-frozen": 0.88}


def mechanisms(options):
  """[(ledger label, ε share)] of `--model hybrid`'s and `dpformer-frozen`'s one-off releases
  beside training: the DP histogram and the pair release (`pair_share`, default 0.3 and 0.88),
  each calibrated alone (shares of ε alone may add up to more than 1: the plan composes them)."""
  share = PAIR_SHARES[options.model] if options.pair_share is None else options.pair_share
  return frequencies_lib.mechanisms(options) + [(LABEL, share)]


def noise_multiplier(plan):
  """σ of the pair release: its own mechanism beside training (hybrid), else the plan's one
  step."""
  return plan.mechanisms.get(LABEL, plan.noise_multiplier)


def plan_privacy(options, num_examples, delta, spent) -> plan_lib.PrivacyPlan:
  """The pair release as the plan's one step at q = 1 (a Gaussian mechanism), its σ calibrated
  for what the histogram (a mechanism of the plan) leaves of ε."""
  return plan_lib.plan_privacy(
      options.epsilon, delta, num_examples, num_examples, 1,
      mechanisms=frequencies_lib.mechanisms(options), accountant=options.accountant,
      spent=spent)


def training_sequences(examples):
  """Each training user's items in order, as `train seqrec` trains on them (the inputs, then
  the last target: at most L + 1 items)."""
  last = examples.labels[:, -1:]
  rows = np.concatenate([examples.items, last], axis=1)
  return [row[row > 0] for row in rows]


def item_set(options, popularity):
  """Sorted ids of the `pair_item_set` items with the largest (DP) counts (None: every item)."""
  if options.pair_item_set is None or options.pair_item_set >= len(popularity) - 1:
    return None
  order = np.argsort(-popularity[1:], kind="stable")[:options.pair_item_set] + 1
  return np.sort(order)


def item_ids(options, popularity, num_items):
  """The ids the pair release covers: 0 (padding), then `item_set`'s (every item without)."""
  items = item_set(options, popularity)
  return np.arange(num_items + 1) if items is None else np.concatenate([[0], items])


def on_items(matrix, ids, num_items):
  """csr [M + 1, M + 1] of `matrix` over `ids` (its row and column k is item ids[k])."""
  cells = matrix.tocoo()
  return scipy.sparse.csr_matrix((cells.data, (ids[cells.row], ids[cells.col])),
                                 shape=(num_items + 1, num_items + 1))


def pair_statistics(options, examples):
  """The exact pair statistics of `examples`' users (`item_pairs.pair_statistics`)."""
  return item_pairs.pair_statistics(training_sequences(examples), examples.num_items,
                                    options.pair_window, options.pair_decay,
                                    options.pair_max_items)


def released_pairs(options, examples, plan, ids, rng):
  """(csr [M + 1, M + 1] of released values, release summary): the pair statistics restricted
  to `ids` (`item_ids`), released with the plan's σ (exact without DP)."""
  statistics = pair_statistics(options, examples)
  if not options.private:
    return statistics, {"released_pairs": int(statistics.nnz), "private": False}
  sigma = noise_multiplier(plan)
  released = item_pairs.release(statistics[ids][:, ids], sigma, options.pair_threshold * sigma
                                * item_pairs.SENSITIVITY, rng)
  return (on_items(released.matrix, ids, examples.num_items),
          dict(released.summary(), item_set=len(ids) - 1, ledger_label=LABEL))


def popularity(options, examples, p_i, public=None):
  """Users per item: the DP histogram's p_i·N (exact without DP), plus the `public` users'
  exact counts over the same items per user."""
  if p_i is None:
    counts = user_histogram.users_per_item(examples.items, examples.num_items)
  else:
    counts = np.asarray(p_i) * len(examples.items)
  if public is not None:
    counted = public.items if p_i is None else \
        public.items[:, -frequencies_lib.histogram_items(options):]
    counts = counts + user_histogram.users_per_item(counted, public.num_items)
  return np.asarray(counts, np.float64)


def build_model(options, examples, plan, p_i, rng, public=None):
  """(`Item2ItemModel`, release summary) from the released histogram `p_i` and pairs of the
  private users `examples`, plus the exact ones of the `public` users (None: none)."""
  counts = popularity(options, examples, p_i, public)
  matrix, summary = released_pairs(options, examples, plan,
                                   item_ids(options, counts, examples.num_items), rng)
  if public is not None:
    public_pairs = pair_statistics(options, public)
    matrix = matrix + public_pairs
    summary = dict(summary, public_pairs=int(public_pairs.nnz))
  return Item2ItemModel(matrix, counts, scoring_config(options)), summary


def scoring_config(options):
  return Item2ItemConfig(recent=options.pair_recent, recent_decay=options.pair_recent_decay,
                         popularity_exponent=options.pair_popularity_exponent,
                         popularity_weight=options.pair_popularity_weight)


def settings(options):
  """The model's settings for the summary (public)."""
  return {"window": options.pair_window, "decay": options.pair_decay,
          "max_items": options.pair_max_items, "item_set": options.pair_item_set,
          "threshold_sigmas": options.pair_threshold,
          **dataclasses.asdict(scoring_config(options))}
