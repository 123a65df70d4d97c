"""DP-FEST row sets (seed 001 §3.1): the top-k rows of each table by frequency, from public
counts or by DP top-k selection on the training data.

DP selection splits ε equally over the tables, as the paper does, and runs
`dprec.privacy.gumbel_top_k` per table, whose TOTAL pure-DP cost for its k rows is its share
(k exponential-mechanism draws; note 001 §2.1 on the paper's undercount). The whole ε is
charged to the ledger before anything is selected.
"""
from typing import Mapping, Optional, Union

import numpy as np


def public_top_k(counts, k):
  """The `k` most frequent local row ids (ties broken by lower id), sorted by id."""
  counts = np.asarray(counts)
  k = min(int(k), counts.size)
  order = np.lexsort((np.arange(counts.size), -counts))
  return np.sort(order[:k]).astype(np.int64)


def fest_rows(counts_by_table: Mapping[str, np.ndarray], k: Union[int, Mapping[str, int]],
              epsilon: Optional[float] = None, rng=None, ledger=None, label="dp-fest top-k"):
  """{table name: sorted local row ids} for `DPFEST`/`DPAdaFESTPlus(selected_rows=...)`.

  `counts_by_table`: per-table bucket counts (public when `epsilon` is None, else private and
  selected with ε-DP in total). `k`: rows per table (an int for all tables, or per table).
  `ledger`: a `dprec.privacy.PrivacyLedger` charged `epsilon` (pure DP) first.
  """
  names = list(counts_by_table)
  ks = {name: int(k[name] if isinstance(k, Mapping) else k) for name in names}
  if epsilon is None:
    return {name: public_top_k(counts_by_table[name], ks[name]) for name in names}
  from dprec.privacy import gumbel_top_k  # pylint: disable=import-outside-toplevel
  if not epsilon > 0:
    raise ValueError(f"epsilon must be positive, got {epsilon}")
  rng = rng if rng is not None else np.random.default_rng()
  if ledger is not None:
    ledger.charge_pure(epsilon, label=label)
  share = epsilon / len(names)
  return {name: np.sort(np.asarray(gumbel_top_k(np.asarray(counts_by_table[name]), ks[name],
                                                share, rng), dtype=np.int64))
          for name in names}
