"""DP-FEST row sets (Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large
Embedding Models", arXiv:2311.08357, §3.1): the top-k rows of each table by frequency, from public
counts or by DP top-k selection on the training data.

DP selection is `dprec.privacy.select_top_k_per_feature` (Gumbel top-k per table within a total
budget, charging k draws per table, not one: Ghazi et al. 2023, §3.1); its cost is charged to the
ledger before the rows are returned.
"""
import dataclasses
from typing import Dict, Mapping, Optional, Union

import numpy as np


@dataclasses.dataclass
class FestRows:
  """`rows`: {table name: sorted local row ids} for `DPFEST`/`DPAdaFESTPlus(selected_rows=)`;
  `epsilon`, `delta`: what choosing them cost (0 for public counts)."""
  rows: Dict[str, np.ndarray]
  epsilon: float = 0.0
  delta: float = 0.0


def public_top_k(counts, k):
  """The `k` most frequent local row ids (ties broken by lower id), sorted by id."""
  counts = np.asarray(counts)
  k = min(int(k), counts.size)
  order = np.lexsort((np.arange(counts.size), -counts))
  return np.sort(order[:k]).astype(np.int64)


def fest_rows(counts_by_table: Mapping[str, np.ndarray], k: Union[int, Mapping[str, int]],
              epsilon: Optional[float] = None, delta: float = 0.0, rng=None, ledger=None,
              label="dp-fest top-k", domain: Optional[int] = None):
  """Top-`k` rows per table (`k` an int for every table, or per table name).

  `epsilon` None: `counts_by_table` are public counts, nothing is charged. Otherwise they are
  private and the rows are chosen with (`epsilon`, `delta`)-DP in total; `ledger` (a
  `dprec.privacy.PrivacyLedger`) is charged that cost, and refuses it beyond its budget.
  `domain`: every table's candidates are that many ids, those without a row counting 0 (a
  candidate set that does not depend on which ids the data brought); slots they win select no
  row, so a table may get fewer than k rows.
  """
  names = list(counts_by_table)
  ks = [int(k[name] if isinstance(k, Mapping) else k) for name in names]
  if epsilon is None:
    return FestRows({name: public_top_k(counts_by_table[name], kf)
                     for name, kf in zip(names, ks)})
  from dprec.privacy import select_top_k_per_feature
  selection = select_top_k_per_feature(
      [np.asarray(counts_by_table[name]) for name in names], ks, epsilon,
      rng if rng is not None else np.random.default_rng(), delta, domain)
  if ledger is not None:
    ledger.charge_approximate(selection.epsilon, selection.delta, label=label)
  return FestRows({name: np.sort(rows[rows >= 0]).astype(np.int64)
                   for name, rows in zip(names, selection.indices)},
                  selection.epsilon, selection.delta)


def rows_from_ids(ids, table_names, vocab_sizes, top_k: int, epsilon: Optional[float] = None,
                  rng=None) -> FestRows:
  """`top_k` rows over all tables, int(k/F) per table, by the counts of the categorical `ids`
  [n, F] of the training data (column f: table f of `table_names` with `vocab_sizes[f]` rows);
  by DP top-k at `epsilon` (Gumbel noise from the secret `rng`), from the exact counts (public)
  when `epsilon` is None. Nothing is charged: the caller pays `epsilon` and `delta`."""
  return rows_from_counts({name: np.bincount(ids[:, f], minlength=size)
                           for f, (name, size) in enumerate(zip(table_names, vocab_sizes))},
                          top_k, epsilon, rng)


def rows_from_counts(counts, top_k: int, epsilon: Optional[float] = None, rng=None) -> FestRows:
  """`rows_from_ids` from each table's row counts {name: int[rows]} (e.g. summed over a stream
  of the training data that does not fit in memory)."""
  per_table = max(1, top_k // len(counts))
  return fest_rows(counts, {name: min(per_table, len(c)) for name, c in counts.items()},
                   epsilon=epsilon, rng=rng)


@dataclasses.dataclass
class SharedRowVocabulary:
  """A DP-FEST item vocabulary by threshold: items 1..M whose DP count reaches the threshold keep
  a row of their own (rows 1..K, in item order), the others share row K + 1; row 0 is padding.
  `row_of` int64[M + 1] maps items to rows (row_of[0] = 0); `log_share` float64[M + 1] is each
  item's log share of its row's DP count (0 for an item with its own row): a shared row's score
  plus it ranks every item (log P(item) = log P(row) + log P(item | row))."""
  row_of: np.ndarray
  log_share: np.ndarray
  own_rows: int

  @property
  def num_rows(self) -> int:
    """Non-padding rows of the table (K, plus 1 if some items share a row)."""
    return int(self.row_of.max())


def threshold_vocabulary(counts, threshold) -> SharedRowVocabulary:
  """The vocabulary of items whose count (`counts` float[M + 1], DP or public; index 0 unused)
  is at least `threshold`. The within-row shares use the counts floored at 1 (a DP count may be
  ≤ 0). Post-processing of the counts: costs nothing beyond them."""
  counts = np.asarray(counts, np.float64)
  kept = counts[1:] >= threshold
  row_of = np.zeros(len(counts), np.int64)
  row_of[1:][kept] = np.arange(1, kept.sum() + 1)
  row_of[1:][~kept] = kept.sum() + 1
  floored = np.maximum(counts, 1.0)
  row_totals = np.bincount(row_of[1:], weights=floored[1:], minlength=kept.sum() + 2)
  log_share = np.zeros(len(counts))
  log_share[1:] = np.where(kept, 0.0, np.log(floored[1:] / row_totals[row_of[1:]]))
  return SharedRowVocabulary(row_of, log_share, int(kept.sum()))
