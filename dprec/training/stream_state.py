"""The state a streaming run's checkpoint holds besides the TensorFlow objects (JSON), and its
journal of committed steps (`steps.jsonl`), cut back to the checkpoint on a restart."""
import json
import os

import numpy as np

from dprec import atomic_io

JOURNAL = "steps.jsonl"


def fresh_state():
  """The trainer state of a run that has not started (JSON)."""
  return {
      "period": 0, "step": 0,  # data position: the next (period, step) to train
      "evaluated": False,  # has period `period` evaluated the model trained before it?
      "running": None,  # sums over the steps of the period in progress (None: not started)
      "table_names": None, "vocab_sizes": None, "table_rows": None, "selected_rows": None,
      "model_shapes": None,  # `PeriodModel.shapes` of the model built for `table_rows`
      "journal_lines": 0, "rows": [], "stopped": None, "holdout": None}


def rows_to_json(rows):
  """{table: selected rows} as JSON lists (None stays None)."""
  return None if rows is None else {k: np.asarray(v).tolist() for k, v in rows.items()}


def rows_from_json(rows):
  """`rows_to_json`'s inverse: {table: int64 array}."""
  return None if rows is None else {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}


def append_journal(path, period, step, batch_size=None):
  """Appends committed step (period, step) to the journal; `batch_size` (exact, non-private)
  only when given (diagnostics)."""
  entry = {"period": period, "step": step}
  if batch_size is not None:
    entry["diagnostics_nonprivate"] = {"batch_size": batch_size}
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(entry) + "\n")


def truncate_journal(path, lines):
  """Drops journal lines of steps that were trained after the last checkpoint (to be replayed)."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    kept = f.readlines()[:lines]
  atomic_io.write_text(path, "".join(kept))
