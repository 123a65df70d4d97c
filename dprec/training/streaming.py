"""Streaming online training: train period by period as days arrive, one ledger for the run.

The third way in (Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large
Embedding Models", arXiv:2311.08357, §4.3 and Table 5). `StreamingTrainer` tails a
`PeriodSource` (the streaming Beam job's output), and for every complete period p:
  1. evaluates the model trained on periods < p on period p (train on day t, evaluate on t+1);
  2. pays the privacy ledger for the whole period *before* training on it (its steps, its
     per-period mechanisms such as DP Platt scaling, the first period's once-only ones such as a
     DP base rate; for a row-level plan as reading the period's days, so periods compose in
     parallel), and stops cleanly instead when that would exceed the budget fixed up front
     (`dprec.workflows.plan`); a user-level plan first checks every row has its user's id;
  3. grows the embedding tables for ids first seen in p (learned rows stay where they are) and,
     for DP-FEST / DP-AdaFEST+, refreshes the top-k rows from the running counts (DP top-k when
     the selection must be private), rows that stay selected keeping what they learned;
  4. trains its Poisson-sampled steps (a user-level plan samples users, each sampled user
     bringing at most k rows clipped as one: `dprec.training.user_sampling`; the plan's T,
     scaled down for a period of fewer days than planned, e.g. the last of 18 days cut into
     4-day periods: a public count, never the exact number of rows), checkpointing atomically
     every `checkpoint_every` steps and at the end of the period; the model's `before_training`
     (first period) and `after_training` (every period) hooks make the plan's other releases on
     the period's training rows (a user-level plan's: on at most k of each user's, drawn by the
     run's key, `user_sampling.rows_per_user`, at k times the plan's σ,
     `PrivacyPlan.release_noise_multiplier`).

The run (`dprec.workflows.run.Run`: directory, secret key, ledger, the charges it has paid) is
given by the workflow (`dprec.workflows.stream`). Secret randomness: the batch of step (p, s), its
noise and the DP top-k draws of period p come from the run's secret key (kept in
`run_dir/secret/`) and (p, s) only; the model's seed seeds only the initialisation of new rows.

Crash safety: the batch of step (p, s) and every random draw depend only on (key, p, s) and on
state inside the checkpoint (model, optimizer slots; no generator state), so a `kill -9` and a
restart replay the uncommitted steps exactly: no period is trained twice or skipped, the final
model and ledger equal an uninterrupted run's, and the budget paid before the crash is never
paid again nor forgotten (the ledger file is never rolled back; a period counts as paid once
this run's charge is in it, whatever other runs sharing the ledger paid). A journal
(`steps.jsonl`) lists the committed (period, step) pairs. Checkpoints record the model's shapes
(`PeriodModel.shapes`: widths fixed when the tables were first built), which a restart builds
before restoring. A rerun looks again at why the last invocation stopped: an idle stream goes
on with the periods that arrived since; one that trained its `train_periods`, or whose next
period the budget cannot pay, trains and charges nothing (`trained_now` false).

The trainer's parts, each in its module: what a model provides (`period_model`), how the run
proceeds (`stream_config`), a period's rows, batches and release rows (`period_rows`), what a
period costs and the ledger charges (`period_charges`), the checkpoint's JSON state and the
journal (`stream_state`), and the summary (`stream_summary`).

Released outputs hold no exact private quantity by default: per-period rows report the plan's
sizes, ε, and AUC; the exact row counts, Poisson batch sizes and unclipped training losses are
non-private diagnostics, kept only with `diagnostics=True` under `diagnostics_nonprivate`.
"""
import collections
import math
import os
import time

import numpy as np
import tensorflow as tf

from dprec.data.criteo import ID_DOMAIN
from dprec.sparse import fest
from dprec.training import checkpoint as ckpt_lib
from dprec.training import stream_metrics
from dprec.training import stream_state
from dprec.training import stream_summary
from dprec.training.period_charges import PeriodCharges
from dprec.training.period_model import PeriodModel
from dprec.training.period_rows import PeriodRows
from dprec.training.period_source import CATEGORICAL_KEY, Period, PeriodSource
from dprec.training.stream_config import StreamConfig

MIN_SPARE_ROWS = 8  # tiny tables (e.g. 3 buckets) would otherwise need a rebuild per new id


class StreamingTrainer:
  """Trains a `PeriodModel` on the periods of a `PeriodSource` under one privacy plan."""

  def __init__(self, model: PeriodModel, source: PeriodSource, plan, config: StreamConfig, run,
               progress=None, log=None):
    """Args:
      model, source, config: see the classes.
      plan: the run's `dprec.workflows.plan.PrivacyPlan` (`plan_stream`).
      run: its `dprec.workflows.run.Run`, with a run directory (checkpoints, ledger, journal,
        metrics CSV, TensorBoard logs and the plot).
      progress: optional callable(period, step, logs) called after every step (progress bars).
      log: optional callable(line) told of every period trained and every wait for one.
    """
    self.model, self.source, self.plan, self.config = model, source, plan, config
    self.progress, self.log = progress, log or (lambda line: None)
    self.run_state = run
    self.charges = PeriodCharges(plan, run, source)
    self.rows = PeriodRows(plan, run)
    self.checkpoints = ckpt_lib.CheckpointManager(run.checkpoints.directory)
    self.journal_path = os.path.join(run.run_dir, stream_state.JOURNAL)
    self.metrics = stream_metrics.MetricsWriter(run.run_dir)
    self.state = stream_state.fresh_state()
    self._tf_checkpoint = None

  def epsilon_spent(self):
    """ε charged so far (None for a non-private run)."""
    return self.charges.epsilon_spent()

  # ---- state and checkpoints ----------------------------------------------------------------

  def _ordered(self, by_name):
    """{table: value} in column order (JSON state does not keep key order)."""
    return {name: by_name[name] for name in self.state["table_names"]}

  def _build(self, table_rows):
    self.model.build(self._ordered(table_rows))
    self._tf_checkpoint = tf.train.Checkpoint(**self.model.trackables())
    self.state["table_rows"] = dict(table_rows)
    self.state["model_shapes"] = self.model.shapes()

  def _restore(self):
    path = self.checkpoints.latest()
    if path is None:
      return False
    self.state = self.checkpoints.read_state(path)
    prefix = os.path.join(path, ckpt_lib.MODEL_PREFIX)
    if self.state["table_rows"] is not None:  # the checkpoint's shapes, then its values
      shapes = self.state.get("model_shapes")
      if shapes is None:  # a checkpoint written before they were recorded
        shapes = self.model.shapes_in_checkpoint(prefix, self._ordered(self.state["table_rows"]))
      self.model.set_shapes(shapes)
      self._build(self.state["table_rows"])
      self.model.set_selected_rows(stream_state.rows_from_json(self.state["selected_rows"]))
      self._tf_checkpoint.read(prefix).assert_consumed()
    stream_state.truncate_journal(self.journal_path, self.state["journal_lines"])
    return True

  def _commit(self):
    files = {}
    ledger = self.charges.ledger
    if ledger is not None and os.path.exists(ledger.path):
      files["ledger.json"] = ledger.path  # an audit copy; the live ledger is never rolled back
    write = (self._tf_checkpoint.write if self._tf_checkpoint is not None
             else lambda prefix: None)
    self.checkpoints.commit(self.state, write, files)

  def _journal(self, period, step, batch_size):
    stream_state.append_journal(self.journal_path, period, step,
                                batch_size if self.config.diagnostics else None)
    self.state["journal_lines"] += 1

  # ---- the loop ---------------------------------------------------------------------------

  def _next_period(self, index):
    """Waits (up to idle_timeout) for complete period `index`; None when the stream is idle."""
    deadline = time.monotonic() + self.config.idle_timeout
    waiting = False
    while True:
      period = self.source.period(index)
      if period is not None:
        return period
      if time.monotonic() >= deadline:
        return None
      if not waiting:
        waiting = True
        self.log(f"waiting up to {self.config.idle_timeout:g} s for period {index}")
      time.sleep(min(self.config.poll_interval, max(0.0, deadline - time.monotonic())))

  def _evaluate_row(self, period: Period):
    """Evaluates the model trained through period p-1 on period p and finishes p-1's row (with
    p's click rate, `eval_base_rate`: the constant predictor a model must beat on it)."""
    features, labels = self.rows.load(period)
    metrics = self.model.evaluate(self._known_ids(features), labels)
    row = self.state["rows"][-1]
    constant = metrics.get("base_rate_log_loss")
    row.update(eval_period=period.index, auc=float(metrics["auc"]),
               eval_loss=float(metrics["loss"]), log_loss=float(metrics["loss"]),
               base_rate_log_loss=None if constant is None else float(constant),
               eval_base_rate=float(np.mean(labels)))

  def _known_ids(self, features):
    """Ids the model has no row for yet (first seen after its last training period) → OOV 0."""
    sizes = np.asarray(list(self._ordered(self.state["vocab_sizes"]).values()))
    ids = features[CATEGORICAL_KEY]
    return dict(features, **{CATEGORICAL_KEY: np.where(ids < sizes, ids, 0).astype(ids.dtype)})

  def _refresh(self, period: Period):
    """Grows tables for new ids and refreshes the top-k set (Ghazi et al. 2023, §4.3 streaming
    counts)."""
    old = self.state["vocab_sizes"] or {}
    if self.state["table_names"] is None:
      self.state["table_names"] = list(period.vocab_sizes)
    sizes = {name: max(int(size), old.get(name, 0)) for name, size in period.vocab_sizes.items()}
    rows = self.state["table_rows"]
    if rows is None or any(sizes[n] > rows[n] for n in sizes):
      # Every table gets fresh headroom at once, so the next rebuild is many periods away.
      self._build({n: math.ceil(sizes[n] * self.config.headroom) + MIN_SPARE_ROWS for n in sizes})
    self.state["vocab_sizes"] = sizes
    selected = None
    if self.config.top_k:
      epsilon = self.plan.selection_epsilon_per_period or None  # paid in PeriodCharges.pay
      # DP: candidates are every id of the domain (and the OOV row), not the rows the data made.
      selected = fest.fest_rows(period.counts(), self.config.top_k, epsilon=epsilon,
                                rng=self.run_state.key.numpy_rng("dp top-k", period.index),
                                domain=ID_DOMAIN + 1).rows
    self.model.set_selected_rows(selected)
    self.state["selected_rows"] = stream_state.rows_to_json(selected)
    return sum(sizes[n] - old.get(n, 0) for n in sizes) if old else 0

  def _key_noise(self, period, step):
    """Puts the model's noise generators on their states for step (p, s) of the run's key."""
    for purpose, generator in self.model.noise_generators().items():
      self.run_state.key.reset(generator, purpose, period, step)

  def _train_period(self, period: Period):
    """Trains the rest of period p in chunks that end at checkpoints."""
    features, labels = self.rows.load(period)
    running = self.state["running"]
    total, every = running["total"], self.config.checkpoint_every

    def on_step(logs):
      step = self.state["step"]
      batch_size = sizes.popleft()
      running["loss"] += float(logs.get("loss", 0.0))
      running["reduction"] += float(logs.get("gradient_size_reduction", 1.0))
      running["batch"] += batch_size
      running["steps"] += 1
      self._journal(period.index, step, batch_size)
      self.state["step"] = step + 1
      self._key_noise(period.index, step + 1)
      if self.progress is not None:
        self.progress(period.index, step, logs)

    while self.state["step"] < total:
      start = self.state["step"]
      stop = min(total, (start // every + 1) * every)
      sizes = collections.deque()
      self._key_noise(period.index, start)
      self.model.train_steps(self.rows.batches(period, features, labels, start, stop, sizes),
                             stop - start, on_step)
      if stop < total:
        self._commit()
    return running, len(labels)

  def run(self):
    """Runs until the stream is idle, the training periods are done or the budget is spent.

    Returns the JSON summary (see `summary`).
    """
    resumed = self._restore()
    # Why the last invocation stopped is looked at again (new days, a budget still too small).
    self.state["stopped"] = None
    self.metrics.write(self.state["rows"])
    train_periods = self.config.train_periods
    start = (self.state["period"], self.state["step"])
    while self.state["stopped"] is None:
      index = self.state["period"]
      if (train_periods is not None and index >= train_periods
          and (index == 0 or self.state["evaluated"])):
        self.state["stopped"] = f"trained the {train_periods} training periods"
        break
      period = self._next_period(index)
      if period is None:
        self.state["stopped"] = (f"no complete period {index} appeared within "
                                 f"{self.config.idle_timeout:g} s; the stream is idle")
        break
      if index > 0 and not self.state["evaluated"]:
        self._evaluate_row(period)
        self.state["evaluated"] = True
        self._commit()
        self.metrics.write(self.state["rows"])
      if train_periods is not None and index >= train_periods:
        continue  # evaluated the last training period's model: stops above
      if self.state["step"] == 0 and self.state["running"] is None:
        if self.plan.privacy_unit == "user":
          self.rows.users(period)  # refuses rows without user ids before anything is charged
        steps = self.charges.period_steps(period)
        unaffordable = self.charges.pay(period, steps)
        if unaffordable is not None:
          self.state["stopped"] = (
              f"privacy budget: training period {index} would bring ε to {unaffordable:.4g} > "
              f"--epsilon {self.plan.epsilon_total:g} (spent {self.epsilon_spent():.4g} "
              f"on periods 0..{index - 1}); stopped before it")
          break
        new_ids = self._refresh(period)
        released = {}
        if index == 0:
          released = self.model.before_training(
              *self.rows.release_rows(period),
              self.charges.releases(self.plan.mechanisms, "stream", 0))
        self.state["running"] = {"loss": 0.0, "reduction": 0.0, "batch": 0, "steps": 0,
                                 "total": steps, "new_ids": new_ids, "released": released}
        self._commit()
      started = time.monotonic()
      running, n = self._train_period(period)
      released = dict(running.get("released") or {}, **self.model.after_training(
          *self.rows.release_rows(period),
          self.charges.releases(self.plan.period_mechanisms, self.charges.label(index), index)))
      steps = max(1, running["steps"])
      row = {
          "period": index, "days": list(period.days),
          "steps": running["steps"],
          "gradient_size_reduction": running["reduction"] / steps,
          "epsilon_so_far": self.epsilon_spent(), "new_ids": running.get("new_ids", 0),
          "vocab_size": int(sum(self.state["vocab_sizes"].values())),
          "noise_multiplier": self.plan.noise_multiplier,
          "sampling_rate": self.plan.sampling_rate,
          "train_seconds": time.monotonic() - started, **released,
          "auc": None, "eval_loss": None, "log_loss": None, "base_rate_log_loss": None,
          "eval_base_rate": None, "eval_period": None}
      if self.config.diagnostics:
        row["diagnostics_nonprivate"] = {"examples": n, "train_loss": running["loss"] / steps,
                                         "mean_batch_size": running["batch"] / steps}
      self.state["rows"].append(row)
      self.state.update(period=index + 1, step=0, evaluated=False, running=None)
      self._commit()
      self.metrics.write(self.state["rows"])
      self.log(stream_summary.period_line(self.state["rows"]))
    trained = self.state["table_rows"] is not None
    if trained and train_periods is not None and self.state.get("holdout") is None:
      self.state["holdout"] = self._evaluate_holdout(train_periods)
    self._commit()
    summary = self.summary(resumed)
    summary["trained_now"] = start != (self.state["period"], self.state["step"])
    self.metrics.finish(self.state["rows"], summary)
    return summary

  def _evaluate_holdout(self, first):
    """Pooled metrics of the final model on the complete hold-out periods (Ghazi et al. 2023: days
    19–24)."""
    periods, index = [], first
    while (period := self.source.period(index)) is not None:
      periods.append(period)
      index += 1
    if not periods:
      return None
    loaded = [p.load() for p in periods]
    features = {k: np.concatenate([f[k] for f, _ in loaded]) for k in loaded[0][0]}
    metrics = self.model.evaluate(self._known_ids(features),
                                  np.concatenate([y for _, y in loaded]))
    constant = metrics.get("base_rate_log_loss")
    return {"days": [d for p in periods for d in p.days], "auc": float(metrics["auc"]),
            "loss": float(metrics["loss"]), "log_loss": float(metrics["loss"]),
            "base_rate_log_loss": None if constant is None else float(constant)}

  def summary(self, resumed=False):
    """The run's JSON summary (`stream_summary.summary`)."""
    return stream_summary.summary(self.state, self.plan, self.run_state, self.charges, resumed)
