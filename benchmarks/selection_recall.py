"""What DP-AdaFEST's per-batch selection lets through: the share of a batch's
embedding lookups whose row is kept, by row frequency, from the training data's own counts.

Every example touches one row of each of the F tables, so its contribution map, clipped to C1,
gives each of its rows C1/√F; a row looked up by n examples of the batch is kept when
n·C1/√F + N(0, (σ1·C1)²) ≥ τ (Ghazi et al., "Sparsity-Preserving Differentially Private Training of
Large Embedding Models", arXiv:2311.08357, Algorithm 1 lines 5–6). For a row of training frequency
p, the other lookups in a Poisson batch of expected size B are m ~ Poisson(B·p), so a lookup of it
is kept with probability E_m Ψ((τ − (m + 1)·C1/√F)/(σ1·C1)). Rows that are never kept get no
gradient at all (only false positives' noise): DP-SGD's noisy update still carries their signal. The
expectation is exact (a sum over m); nothing is trained. Defaults: `train ctr`'s DP-AdaFEST point on
the 5M-row frontier data (B = 8192, r = 2, τ = 7, C1 = 1: σ1 = 1.756 at ε = 1).

    PYTHONPATH=. .venv/bin/python benchmarks/selection_recall.py --data DATA \\
        --batch-sizes 8192 32768 131072 --thresholds 15 5
"""
import argparse
import math

import numpy as np
from scipy import special, stats

from dprec.models import ctr as ctr_model
from dprec.workflows import ctr as ctr_workflow

# Row-frequency buckets (share of training examples that look the row up).
BUCKETS = ((1e-2, "≥ 1%"), (1e-3, "0.1–1%"), (1e-4, "0.01–0.1%"), (1e-5, "0.001–0.01%"),
           (0.0, "< 0.001%"))


def kept_probability(frequency, batch_size, threshold, sigma1, contribution_clip, tables):
  """P(a lookup of a row of training frequency `frequency` is kept in its batch): the sum over
  m ~ Poisson(B·p) within 12 standard deviations of its mean (the rest weighs < 1e-30)."""
  share = contribution_clip / math.sqrt(tables)
  kept = []
  for mean in batch_size * np.asarray(frequency, np.float64):
    spread = 12 * math.sqrt(mean) + 20
    others = np.arange(max(0, int(mean - spread)), int(mean + spread) + 1)
    margin = ((others + 1) * share - threshold) / (sigma1 * contribution_clip)
    kept.append(stats.poisson.pmf(others, mean) @ (0.5 * special.erfc(-margin / math.sqrt(2.0))))
  return np.asarray(kept)


def recall_table(ids, batch_size, threshold, sigma1, contribution_clip):
  """[(bucket label, share of lookups, share of rows, P(kept) per lookup)] over all tables."""
  n, tables = ids.shape
  frequencies, lookups = [], []
  for f in range(tables):
    counts = np.bincount(ids[:, f])
    counts = counts[counts > 0]
    frequencies.append(counts / n)
    lookups.append(counts)
  frequency, lookups = np.concatenate(frequencies), np.concatenate(lookups)
  unique, inverse = np.unique(frequency, return_inverse=True)  # few distinct counts
  kept = kept_probability(unique, batch_size, threshold, sigma1, contribution_clip,
                          tables)[inverse]
  rows = []
  upper = np.inf
  for lower, name in BUCKETS:
    inside = (frequency >= lower) & (frequency < upper)
    share = lookups[inside].sum() / lookups.sum()
    recall = (lookups[inside] * kept[inside]).sum() / max(lookups[inside].sum(), 1)
    rows.append((name, share, inside.sum(), recall))
    upper = lower
  rows.append(("all", 1.0, frequency.size, (lookups * kept).sum() / lookups.sum()))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", required=True, help="Criteo TSV day_N directory (last day: test)")
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8192])
  parser.add_argument("--thresholds", type=float, nargs="+", default=[7.0])
  parser.add_argument("--sigma1", type=float, default=1.756,
                      help="σ1 (default: the 5M frontier's DP-AdaFEST runs at ε = 1)")
  parser.add_argument("--contribution-clip", type=float, default=1.0)
  args = parser.parse_args(argv)
  ids = ctr_workflow.load_data(args.data).train[ctr_model.CAT_FEATURES]
  print(f"{ids.shape[0]:,} training rows × {ids.shape[1]} tables; σ1 = {args.sigma1}, "
        f"C1 = {args.contribution_clip}\n")
  print("| B | τ | row frequency | lookups | rows | P(kept) per lookup |")
  print("|---:|---:|---|---:|---:|---:|")
  for batch_size in args.batch_sizes:
    for threshold in args.thresholds:
      for name, share, rows, recall in recall_table(ids, batch_size, threshold, args.sigma1,
                                                    args.contribution_clip):
        print(f"| {batch_size} | {threshold:g} | {name} | {share:.1%} | {rows:,} | {recall:.3f} |")


if __name__ == "__main__":
  main()
