"""Item frequencies p_i for `train seqrec`: Re-Attention's error model (Ding et al., "DPFormer:
Learning Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633), the DP-FEST
item vocabulary (`--item-vocab-threshold`, items whose count p_i·N falls under it share one row;
`dprec.sparse.fest.threshold_vocabulary`) and the popularity weights of the item rows
(`--popularity-weights`, `popularity_weights`). They end up in the model, so they are never the
exact counts. Either a public file (`--item-frequencies`, charged nothing) or, by default, a DP
histogram of users per item (`dprec.privacy.user_histogram`), one Gaussian mechanism calibrated for
its share of ε, released once before training, charged to the run's ledger under
`LABEL` and composed with training; both uses share that one release."""
import numpy as np

from dprec.data.sequences import read_item_frequencies
from dprec.errors import DprecError
from dprec.privacy import user_histogram
from dprec.sparse import fest

LABEL = "train seqrec item frequencies"
DPFORMER_SHARE, ITEM2ITEM_SHARE, HYBRID_SHARE, ITEM2ITEM_HISTOGRAM_ITEMS = 0.05, 0.3, 0.1, 10
# The models built on the pair release: their histogram also picks its item set.
PAIR_RELEASES = {"item2item": ITEM2ITEM_SHARE, "hybrid": HYBRID_SHARE,
                 "dpformer-frozen": ITEM2ITEM_SHARE}


def _used(options):
  return (options.model in PAIR_RELEASES or options.reattention
          or options.item_vocab_threshold is not None or options.popularity_weights)


def mechanisms(options):
  """[(ledger label, ε share)] of the plan: the DP histogram, unless p_i are public or unused."""
  if _used(options) and options.item_frequencies is None:
    return [(LABEL, share(options))]
  return []


def frequencies(options, data, examples, plan, rng):
  """p_i (None without DP, or without Re-Attention and vocabulary): the public file, else the
  DP histogram over the training rows (σ from the plan, noise from the run's secret `rng`)."""
  if not (options.private and _used(options)) or options.dp_forward is not None:
    return None
  if options.item_frequencies is not None:
    if data.item_ids is None:
      raise DprecError("--item-frequencies needs the data set's item ids (item_ids.txt)")
    return read_item_frequencies(options.item_frequencies, data.item_ids)
  # Each user's last K items only (the rows are left-padded): sensitivity √K instead of √L.
  return user_histogram.dp_item_frequencies(examples.items[:, -histogram_items(options):],
                                            examples.num_items, plan.mechanisms[LABEL], rng)


def histogram_items(options):
  """K: the items per user the DP histogram counts (sensitivity √K); default L for the
  transformer, 10 for item2item, hybrid and dpformer-frozen (whose item set needs counts
  accurate around rank 1,000)."""
  if options.item_histogram_items:
    return options.item_histogram_items
  return min(ITEM2ITEM_HISTOGRAM_ITEMS, options.max_len) \
      if options.model in PAIR_RELEASES else options.max_len


def share(options):
  """The histogram's share of ε: default 0.05 for the transformer (Re-Attention's p_i), 0.3 for
  item2item (its popularity and item set; the pair release gets the rest), 0.1 for hybrid (the
  pair release's item set and Re-Attention's p_i; not tuned), 0.3 for dpformer-frozen (item2item's
  item set and popularity, here the logit offset)."""
  if options.item_frequency_share is not None:
    return options.item_frequency_share
  return PAIR_RELEASES.get(options.model, DPFORMER_SHARE)


def source(options, plan, p_i):
  """Where the p_i came from, for the summary."""
  if p_i is None:
    return None
  if options.item_frequencies is not None:
    return {"source": "public file", "path": options.item_frequencies, "public": True}
  return {"source": "dp histogram", "epsilon_share": share(options),
          "noise_multiplier": plan.mechanisms[LABEL],
          "max_items_per_user": histogram_items(options),
          "ledger_label": LABEL}


def _counts(examples, p_i):
  """Users per item: p_i·N (the DP histogram or the public file), exact without DP."""
  if p_i is None:
    return user_histogram.users_per_item(examples.items, examples.num_items)
  return np.asarray(p_i) * len(examples.items)


def vocabulary(options, examples, p_i):
  """The DP-FEST vocabulary of `--item-vocab-threshold` (None without it) from the counts p_i·N
  (the DP histogram or the public file); a non-private run uses the exact counts."""
  if options.item_vocab_threshold is None:
    return None
  return fest.threshold_vocabulary(_counts(examples, p_i), options.item_vocab_threshold)


def popularity_weights(counts, floor):
  """w [R + 1] of the table rows from their counts n̂ [R + 1] (index 0, padding: w = 1):
  w_j ∝ max(n̂_j, floor)^(−1/2), scaled so Σ_j n_j·w_j² = Σ_j n_j (n = the floored counts).
  A user's gradient on row j is scaled by w_j, so head rows cede share of each user's norm to
  rarer ones while the item table's share stays the same on average; the floor (the count's
  noise std for a DP count) clips the weights where the count says nothing. Post-processing
  of the counts: costs nothing beyond them."""
  floored = np.maximum(np.asarray(counts, np.float64)[1:], floor)
  return np.concatenate([[1.0], np.sqrt(floored.mean() / floored)])


def row_weights(options, plan, examples, p_i, vocabulary_):
  """(w, floor) of `--popularity-weights` ((None, None) without) from the same counts as the
  vocabulary (summed over the items of a shared row), floored at the DP histogram's noise
  std σ·√K (1 for exact or public counts)."""
  if not options.popularity_weights:
    return None, None
  counts = _counts(examples, p_i)
  if vocabulary_ is not None:
    counts = np.bincount(vocabulary_.row_of, weights=counts, minlength=vocabulary_.num_rows + 1)
  floor = 1.0
  if p_i is not None and options.item_frequencies is None:
    floor = max(floor, plan.mechanisms[LABEL] * user_histogram.sensitivity(
        histogram_items(options)))
  return popularity_weights(counts, floor), floor


def weights_summary(weights, floor):
  """The popularity weights' range for the summary (post-processing of the counts)."""
  if weights is None:
    return None
  return {"count_floor": floor, "min": float(weights[1:].min()),
          "max": float(weights[1:].max())}


def vocabulary_summary(options, vocabulary_):
  """The vocabulary's size for the summary (released: post-processing of the counts)."""
  if vocabulary_ is None:
    return None
  return {"threshold": options.item_vocab_threshold, "own_rows": vocabulary_.own_rows,
          "table_rows": vocabulary_.num_rows, "items": len(vocabulary_.row_of) - 1}
