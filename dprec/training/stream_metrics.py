"""Per-period metrics of a streaming run: TensorBoard scalars, a CSV, a PNG plot, the summary.

Rows come from the trainer's committed state, so after a crash and restart the CSV is rewritten
from the checkpoint (never a duplicated or half-written line) and TensorBoard gets the committed
periods again (same step, same value: TensorBoard shows one point).
"""
import csv
import io
import math
import os

import tensorflow as tf

from dprec import atomic_io


CSV_NAME = "metrics.csv"
PLOT_NAME = "auc_epsilon.png"
SUMMARY_NAME = "summary.json"
# ε-covered or public fields only (`stream_summary.EPSILON_COVERS`); the exact sizes and losses are
# in a row's `diagnostics_nonprivate` (only with diagnostics on), shown under that name.
COLUMNS = ("period", "eval_period", "auc", "log_loss", "base_rate_log_loss", "epsilon_so_far",
           "gradient_size_reduction", "steps", "new_ids", "vocab_size", "noise_multiplier",
           "sampling_rate", "calibration_scale", "calibration_shift", "train_seconds")
SCALARS = ("auc", "log_loss", "base_rate_log_loss", "epsilon_so_far", "gradient_size_reduction")
DIAGNOSTICS = "diagnostics_nonprivate"


class MetricsWriter:
  """Writes the committed rows of a run under `run_dir`."""

  def __init__(self, run_dir):
    self.run_dir = run_dir
    self._writer = tf.summary.create_file_writer(os.path.join(run_dir, "tensorboard"))
    self._emitted = set()

  def write(self, rows):
    """Rewrites the CSV and emits TensorBoard scalars of rows not yet emitted by this process."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})
    atomic_io.write_text(os.path.join(self.run_dir, CSV_NAME), buffer.getvalue())
    with self._writer.as_default():
      for row in rows:
        key = (row["period"], row.get("auc") is not None)
        if key in self._emitted:
          continue
        self._emitted.add(key)
        scalars = [(f"stream/{name}", row.get(name)) for name in SCALARS]
        scalars += [(f"{DIAGNOSTICS}/{name}", value)
                    for name, value in (row.get(DIAGNOSTICS) or {}).items()]
        for name, value in scalars:
          if value is not None and math.isfinite(value):
            tf.summary.scalar(name, value, step=row["period"])
    self._writer.flush()

  def finish(self, rows, summary):
    """Final CSV, TensorBoard flush, the AUC/ε plot and summary.json."""
    self.write(rows)
    if rows:
      plot_auc_epsilon(rows, os.path.join(self.run_dir, PLOT_NAME))
    atomic_io.write_json(os.path.join(self.run_dir, SUMMARY_NAME), summary, sort_keys=True)


def _values(rows, key):
  return [row[key] if row.get(key) is not None else float("nan") for row in rows]


def plot_auc_epsilon(rows, path, reference=None):
  """Two panels against the training period: the AUC on the next period with the chance line
  (and ε spent so far on a right axis), and the log loss on the next period with the base
  rate's; `reference`: the rows of a non-private stream on the same periods, dashed."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot
  from matplotlib import ticker
  periods = [row["period"] for row in rows]
  figure, (auc_axis, loss_axis) = pyplot.subplots(1, 2, figsize=(10, 3.8))
  auc_axis.plot(periods, _values(rows, "auc"), "o-", color="tab:blue", label="this run")
  loss_axis.plot(periods, _values(rows, "log_loss"), "o-", color="tab:blue", label="this run")
  if reference:
    ref_periods = [row["period"] for row in reference]
    auc_axis.plot(ref_periods, _values(reference, "auc"), "s--", color="tab:gray",
                  label="non-private stream")
    loss_axis.plot(ref_periods, _values(reference, "log_loss"), "s--", color="tab:gray",
                   label="non-private stream")
  auc_axis.axhline(0.5, color="black", linewidth=0.8, linestyle=":", label="chance (0.5)")
  loss_axis.plot(periods, _values(rows, "base_rate_log_loss"), ":", color="black",
                 label="base rate (constant)")
  for axis, name in ((auc_axis, "AUC"), (loss_axis, "log loss")):
    axis.set_xlabel("training period (evaluated on the next)")
    axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    axis.set_ylabel(f"{name} on the next period")
    axis.legend(loc="best", fontsize="small")
  epsilon = [row.get("epsilon_so_far") for row in rows]
  if all(e is not None and math.isfinite(e) for e in epsilon):
    eps_axis = auc_axis.twinx()
    eps_axis.step(periods, epsilon, where="post", color="tab:red", alpha=0.6)
    eps_axis.set_ylim(0, 1.1 * max(epsilon + [1e-9]))  # from 0: a flat ε (rows) reads flat
    eps_axis.set_ylabel("ε spent so far", color="tab:red")
  figure.suptitle("streaming run: utility and privacy per period")
  figure.tight_layout()
  image = io.BytesIO()
  figure.savefig(image, format="png", dpi=100)
  pyplot.close(figure)
  atomic_io.write_bytes(path, image.getvalue())
