"""Item frequencies p_i for `train seqrec`: Re-Attention's error model (note 000 §3) and the
DP-FEST item vocabulary (`--item-vocab-threshold`, items whose count p_i·N falls under it share
one row; `dprec.sparse.fest.threshold_vocabulary`). They end up in the model, so they are never
the exact counts. Either a public file (`--item-frequencies`, charged nothing) or, by default, a
DP histogram of users per item (`dprec.privacy.user_histogram`), one Gaussian mechanism
calibrated for its share of ε, released once before training, charged to the run's ledger under
`LABEL` and composed with training; both uses share that one release."""
import numpy as np

from dprec.data.sequences import read_item_frequencies
from dprec.errors import DprecError
from dprec.privacy import user_histogram
from dprec.sparse import fest

LABEL = "train seqrec item frequencies"


def _used(options):
  return options.reattention or options.item_vocab_threshold is not None


def mechanisms(options):
  """[(ledger label, ε share)] of the plan: the DP histogram, unless p_i are public or unused."""
  if _used(options) and options.item_frequencies is None:
    return [(LABEL, options.item_frequency_share)]
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
  """K: the items per user the DP histogram counts (sensitivity √K)."""
  return options.item_histogram_items or options.max_len


def source(options, plan, p_i):
  """Where the p_i came from, for the summary."""
  if p_i is None:
    return None
  if options.item_frequencies is not None:
    return {"source": "public file", "path": options.item_frequencies, "public": True}
  return {"source": "dp histogram", "epsilon_share": options.item_frequency_share,
          "noise_multiplier": plan.mechanisms[LABEL], "max_items_per_user": histogram_items(options),
          "ledger_label": LABEL}


def vocabulary(options, examples, p_i):
  """The DP-FEST vocabulary of `--item-vocab-threshold` (None without it) from the counts p_i·N
  (the DP histogram or the public file); a non-private run uses the exact counts."""
  if options.item_vocab_threshold is None:
    return None
  if p_i is None:
    counts = user_histogram.users_per_item(examples.items, examples.num_items)
  else:
    counts = np.asarray(p_i) * len(examples.items)
  return fest.threshold_vocabulary(counts, options.item_vocab_threshold)


def vocabulary_summary(options, vocabulary_):
  """The vocabulary's size for the summary (released: post-processing of the counts)."""
  if vocabulary_ is None:
    return None
  return {"threshold": options.item_vocab_threshold, "own_rows": vocabulary_.own_rows,
          "table_rows": vocabulary_.num_rows, "items": len(vocabulary_.row_of) - 1}
