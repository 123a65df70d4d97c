"""Re-Attention's item frequencies p_i for `train seqrec` (note 000 §3): they end up in the model
(through its error variances), so they are never the exact counts. Either a public file
(`--item-frequencies`, charged nothing) or, by default, a DP histogram of users per item
(`dprec.privacy.user_histogram`), one Gaussian mechanism calibrated for its share of ε, released
once before training, charged to the run's ledger under `LABEL` and composed with training."""
from dprec.data.sequences import read_item_frequencies
from dprec.errors import DprecError
from dprec.privacy import user_histogram

LABEL = "train seqrec item frequencies"


def mechanisms(options):
  """[(ledger label, ε share)] of the plan: the DP histogram, unless p_i are public or unused."""
  if options.reattention and options.item_frequencies is None:
    return [(LABEL, options.item_frequency_share)]
  return []


def frequencies(options, data, examples, plan, rng):
  """p_i (None without DP or Re-Attention): the public file, else the DP histogram over the
  training rows (σ from the plan, noise from the run's secret `rng`)."""
  if not (options.private and options.reattention) or options.dp_forward is not None:
    return None
  if options.item_frequencies is not None:
    if data.item_ids is None:
      raise DprecError("--item-frequencies needs the data set's item ids (item_ids.txt)")
    return read_item_frequencies(options.item_frequencies, data.item_ids)
  return user_histogram.dp_item_frequencies(examples.items, examples.num_items,
                                            plan.mechanisms[LABEL], rng)


def source(options, plan, p_i):
  """Where the p_i came from, for the summary."""
  if p_i is None:
    return None
  if options.item_frequencies is not None:
    return {"source": "public file", "path": options.item_frequencies, "public": True}
  return {"source": "dp histogram", "epsilon_share": options.item_frequency_share,
          "noise_multiplier": plan.mechanisms[LABEL], "max_items_per_user": options.max_len,
          "ledger_label": LABEL}
