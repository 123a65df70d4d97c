"""DP-FEST row sets (seed 001 §3.1): the top-k rows of each table by frequency, from public
counts or by DP top-k selection on the training data.

DP selection is `dprec.privacy.select_top_k_per_feature` (Gumbel top-k per table within a total
budget, charging k draws per table, not one: note 001 §2.1); its cost is charged to the ledger
before the rows are returned.
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
  from dprec.privacy import select_top_k_per_feature  # pylint: disable=import-outside-toplevel
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
  counts = {name: np.bincount(ids[:, f], minlength=size)
            for f, (name, size) in enumerate(zip(table_names, vocab_sizes))}
  per_table = max(1, top_k // len(counts))
  return fest_rows(counts, {name: min(per_table, len(c)) for name, c in counts.items()},
                   epsilon=epsilon, rng=rng)
