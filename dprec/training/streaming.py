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

Released outputs hold no exact private quantity by default: per-period rows report the plan's
sizes, ε, and AUC; the exact row counts, Poisson batch sizes and unclipped training losses are
non-private diagnostics, kept only with `diagnostics=True` under `diagnostics_nonprivate`.
"""
import abc
import collections
import dataclasses
import json
import math
import os
import time
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from dprec import atomic_io
from dprec.data.criteo import ID_DOMAIN
from dprec.errors import BudgetExceededError, DprecError
from dprec.sparse import fest
from dprec.training import checkpoint as ckpt_lib
from dprec.training import stream_metrics
from dprec.training.period_source import CATEGORICAL_KEY, Period, PeriodSource
from dprec.training.poisson import poisson_batch_indices
from dprec.training.user_sampling import UserRows, rows_per_user, user_batch
from dprec.privacy_unit import UNIT_KEY, USER_KEY

JOURNAL = "steps.jsonl"
UNITS = {
    "row": "adding or removing one training example (row) of the whole stream: each row lives "
           "in one period, so the periods compose in parallel (the costliest period's ε), "
           "composed sequentially with what reads several periods (DP top-k refreshes of the "
           "running counts, preprocessing charges), in one ledger",
    "user": "adding or removing one user (all their rows) of the whole stream: every step "
            "Poisson-samples users, a sampled user's at most max_rows_per_user rows clipped as "
            "one; each period's DP base rate and DP Platt scaling read at most max_rows_per_user "
            "rows of a user; every period and preprocessing charge composed sequentially in one "
            "user-level ledger",
}
EPSILON_COVERS = {
    "epsilon": "(epsilon, delta)-DP for " + UNITS["row"],
    "covered": ["the model", "steps", "gradient_size_reduction", "epsilon_so_far", "stopped",
                "trained_now (whether this invocation trained a step)",
                "calibration_scale and calibration_shift (DP Platt scaling of each period)",
                "base_rate (DP, first period) and base_rate_log_loss",
                "holdout (final model on the hold-out days, not training data of this run)"],
    "public": ["plan", "settings", "days", "vocab_size and new_ids (vocabularies treated as "
               "public)", "timings"],
    "held_out_evaluation": "each period's auc, log_loss (= eval_loss) and base_rate_log_loss "
                           "evaluate the model trained before it on period p, which IS training "
                           "data of this run (trained on next): not covered by ε; holdout "
                           "evaluates days never trained on",
    "not_covered": "diagnostics_nonprivate (only with --diagnostics): exact period sizes, "
                   "Poisson batch sizes and training losses",
}
MIN_SPARE_ROWS = 8  # tiny tables (e.g. 3 buckets) would otherwise need a rebuild per new id
# {mechanism name: (its noise multiplier, or None when not private; a secret numpy Generator)}
Releases = Mapping[str, Tuple[Optional[float], np.random.Generator]]


class PeriodModel(abc.ABC):
  """What the streaming trainer needs from a model and its (DP) training step.

  `dprec.workflows.stream.CTRPeriodModel` implements it with the pCTR model and `DPModel`;
  anything with the same six methods can be streamed (`transfer_variable` helps to grow). A
  model whose shapes depend on more than its table rows (widths fixed when first built) says so
  in `shapes`, so that a resumed run rebuilds the checkpoint's shapes before restoring it.
  """

  @abc.abstractmethod
  def build(self, table_rows: Mapping[str, int]):
    """Creates the model, or grows its tables to `table_rows` keeping every learned row and
    optimizer slot (ids are stable across periods, so row i is the same bucket before and after)."""

  def shapes(self) -> Dict:
    """JSON of what shapes the built model besides its table rows (e.g. embedding widths), saved
    with every checkpoint and handed to `set_shapes` before a resumed run builds the model to
    restore it."""
    return {}

  def set_shapes(self, shapes: Mapping):
    """Makes the next `build` take the shapes `shapes()` returned (a checkpoint's)."""
    del shapes

  def shapes_in_checkpoint(self, prefix: str, table_rows: Mapping[str, int]) -> Dict:
    """`shapes()` of the model built for `table_rows` whose TensorFlow checkpoint is at `prefix`,
    read from its variables: for checkpoints written before they recorded `shapes`."""
    del prefix, table_rows
    return {}

  @abc.abstractmethod
  def trackables(self) -> Dict[str, tf.Module]:
    """Objects saved in checkpoints: model, optimizer (slots); never the noise generators."""

  @abc.abstractmethod
  def noise_generators(self) -> Dict[str, tf.random.Generator]:
    """{purpose: generator} of the step's secret noise; the trainer puts each on the state its
    run key derives for (purpose, period, step) before every step."""

  @abc.abstractmethod
  def set_selected_rows(self, selected_rows: Optional[Mapping[str, np.ndarray]]):
    """Sets the DP-FEST / DP-AdaFEST+ row set (None: the algorithm has no fixed set)."""

  @abc.abstractmethod
  def train_steps(self, batches: Iterable[Tuple[Mapping[str, np.ndarray], np.ndarray]],
                  steps: int, on_step: Callable[[Dict[str, float]], None]):
    """Runs one (DP) step per (features, labels) Poisson batch, in order, calling `on_step` with
    that step's logs (`loss`, `gradient_size_reduction`) after each."""

  @abc.abstractmethod
  def evaluate(self, features: Mapping[str, np.ndarray], labels: np.ndarray) -> Dict[str, float]:
    """Metrics on held-out data: at least `auc` and `loss` (log loss); `base_rate_log_loss`
    (of the constant the model starts from) if it has one."""

  def before_training(self, features, labels, releases: Releases) -> Dict[str, float]:
    """Called once before the first step of the first period (never again on resume), on its
    training rows, with the Gaussian mechanisms the plan releases once {name: (σ, secret rng)}
    (e.g. a DP base rate for the logit bias). Returns the released values (public: covered by
    ε). State it changes must be in `trackables`."""
    del features, labels, releases
    return {}

  def after_training(self, features, labels, releases: Releases) -> Dict[str, float]:
    """Called after the last step of every period on its training rows, with the mechanisms
    the plan releases in every period (e.g. DP Platt scaling, charged with the period), and
    again on a resume that replays the period's last steps (same rng: same release). Returns
    the released values."""
    del features, labels, releases
    return {}


@dataclasses.dataclass(frozen=True)
class StreamConfig:
  """How a streaming run proceeds (the privacy side is the plan, the run directory the `Run`).

  Attributes:
    checkpoint_every: steps between mid-period checkpoints (one is always written at period end).
    train_periods: periods to train (later complete periods are the final hold-out); None: all.
    idle_timeout: seconds to wait for the next period before finishing (0: stop when caught up).
    poll_interval: seconds between looks at the source while waiting.
    top_k: rows per table (int, or {table: k}) of the DP-FEST / DP-AdaFEST+ set refreshed every
      period from the running counts; by DP top-k when the plan reserves selection ε, else from
      the counts as they are (public). None: the algorithm has no fixed set.
    headroom: tables are allocated with this factor of spare rows and grown by it when new ids
      outrun them, so a model is rebuilt (and its step retraced) rarely, not every period.
    diagnostics: also keep the non-private diagnostics (exact period sizes, batch sizes, training
      loss) under `diagnostics_nonprivate`.
  """
  checkpoint_every: int = 100
  train_periods: Optional[int] = None
  idle_timeout: float = 0.0
  poll_interval: float = 1.0
  top_k: Optional[Union[int, Mapping[str, int]]] = None
  headroom: float = 1.5
  diagnostics: bool = False

  def __post_init__(self):
    if self.checkpoint_every < 1:
      raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
    if self.headroom < 1:
      raise ValueError(f"headroom must be >= 1, got {self.headroom}")


def _fresh_state():
  """The trainer state a checkpoint holds besides the TensorFlow objects (JSON)."""
  return {
      "period": 0, "step": 0,  # data position: the next (period, step) to train
      "evaluated": False,  # has period `period` evaluated the model trained before it?
      "running": None,  # sums over the steps of the period in progress (None: not started)
      "table_names": None, "vocab_sizes": None, "table_rows": None, "selected_rows": None,
      "model_shapes": None,  # `PeriodModel.shapes` of the model built for `table_rows`
      "journal_lines": 0, "rows": [], "stopped": None, "holdout": None}


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
    if plan.privacy_unit == "user" and plan.private and plan.selection_epsilon_per_period:
      raise DprecError("--privacy-unit user cannot refresh a DP top-k set: the running counts "
                       "behind it count every row of a user; use public counts (selection "
                       "epsilon 0) or an algorithm without a fixed set")
    self.checkpoints = ckpt_lib.CheckpointManager(run.checkpoints.directory)
    self.journal_path = os.path.join(run.run_dir, JOURNAL)
    self.ledger = run.budget.open_plan_ledger(plan)
    self.metrics = stream_metrics.MetricsWriter(run.run_dir)
    self.state = _fresh_state()
    self._tf_checkpoint = None
    self._loaded = (None, None)  # (period index, its arrays): evaluated, then trained on
    self._grouped = (None, None)  # (period index, its `UserRows`): a user-level plan's

  def _load(self, period: Period):
    if self._loaded[0] != period.index:
      self._loaded = (period.index, period.load())
    return self._loaded[1]

  def _users(self, period: Period) -> UserRows:
    """Period p's rows grouped by user (a user-level plan); refuses rows without an integer
    user id, before anything is charged."""
    if self._grouped[0] != period.index:
      features, labels = self._load(period)
      if USER_KEY not in features:
        raise DprecError(f"period {period.index} (days {list(period.days)}): --privacy-unit user "
                         f"needs a '{USER_KEY}' column in the stream's records")
      self._grouped = (period.index, UserRows.group(features[USER_KEY], len(labels),
                                                    f"{USER_KEY} of period {period.index}"))
    return self._grouped[1]

  def _release_rows(self, period: Period):
    """Period p's rows the releases read (DP base rate, DP Platt scaling): all of them, or for a
    user-level plan at most k = `max_rows_per_user` of each user's, drawn uniformly by the run's
    key (`user_sampling.rows_per_user`), so one user moves a release by at most k rows' worth."""
    features, labels = self._load(period)
    if self.plan.privacy_unit != "user":
      return features, labels
    kept = rows_per_user(self._users(period), self.plan.max_rows_per_user,
                         self.run_state.key.numpy_rng("rows per user", period.index))
    return {k: v[kept] for k, v in features.items()}, labels[kept]

  def _releases(self, mechanisms, purpose, period):
    """{name: (σ, secret rng)} of the plan's `mechanisms` ({} when not private)."""
    if not self.plan.private:
      return {}
    return {name: (self.plan.release_noise_multiplier(sigma),
                   self.run_state.key.numpy_rng(f"{purpose} {name}", period))
            for name, sigma in mechanisms.items()}

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
      self.model.set_selected_rows(_rows_from_json(self.state["selected_rows"]))
      self._tf_checkpoint.read(prefix).assert_consumed()
    _truncate_journal(self.journal_path, self.state["journal_lines"])
    return True

  def _commit(self):
    files = {}
    if self.ledger is not None and os.path.exists(self.ledger.path):
      files["ledger.json"] = self.ledger.path  # an audit copy; the live ledger is never rolled back
    write = (self._tf_checkpoint.write if self._tf_checkpoint is not None
             else lambda prefix: None)
    self.checkpoints.commit(self.state, write, files)

  def _journal(self, period, step, batch_size):
    entry = {"period": period, "step": step}
    if self.config.diagnostics:
      entry["diagnostics_nonprivate"] = {"batch_size": batch_size}
    with open(self.journal_path, "a", encoding="utf-8") as f:
      f.write(json.dumps(entry) + "\n")
    self.state["journal_lines"] += 1

  # ---- privacy ---------------------------------------------------------------------------

  def _label(self, index):
    return f"stream period {index}"

  def epsilon_spent(self):
    """ε charged so far (None for a non-private run)."""
    return self.ledger.epsilon_spent() if self.ledger is not None else None

  def _period_steps(self, period: Period):
    """The plan's T for a period of the planned number of days; proportionally fewer steps
    (same epochs, less ε) for one of fewer days (the last of a cut). From public day counts,
    never from the exact number of rows, which is private."""
    plan = self.plan
    planned_days = getattr(self.source, "period_days", len(period.days))
    scaled = math.ceil(plan.steps_per_period * len(period.days) / planned_days)
    return max(1, min(plan.steps_per_period, scaled))

  def _mechanisms(self, index):
    """{ledger label: σ} of the Gaussian mechanisms period `index` releases: the plan's
    once-only ones with the first period, its per-period ones (DP Platt scaling) with each."""
    label = self._label(index)
    mechanisms = {f"{label} {name}": sigma for name, sigma in self.plan.period_mechanisms.items()}
    if index == 0:
      mechanisms.update({f"stream {name}": sigma for name, sigma in self.plan.mechanisms.items()})
    return mechanisms

  def _pay_for_period(self, period: Period, steps):
    """Charges the ledger for period p's selection, mechanisms and `steps` steps, unless
    already charged. Row-level plans charge the steps and mechanisms as reading the period's
    days (parallel composition across periods), the selection (running counts) as reading all.

    Returns None once paid, or, charging nothing, the ε the period would have brought the run to.
    """
    if self.ledger is None:
      return None
    run, label = self.run_state, self._label(period.index)
    days = list(period.days) if self.plan.parallel_periods else None
    selection = {label + " selection": self.plan.selection_epsilon_per_period}
    mechanisms = self._mechanisms(period.index)
    projected = run.budget.epsilon_if_paid(self.plan, label, steps, selection,
                                           mechanisms=mechanisms, days=days)
    if not run.budget.fits(projected):
      return projected
    try:
      run.budget.pay_once(self.plan, {name: (epsilon, 0.0) for name, epsilon in selection.items()},
                   mechanisms=mechanisms, days=days)
      run.budget.pay_steps(self.plan, label, steps, days=days)
    except BudgetExceededError:
      return projected
    return None

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
    """Evaluates the model trained through period p-1 on period p and finishes p-1's row."""
    features, labels = self._load(period)
    metrics = self.model.evaluate(self._known_ids(features), labels)
    row = self.state["rows"][-1]
    constant = metrics.get("base_rate_log_loss")
    row.update(eval_period=period.index, auc=float(metrics["auc"]),
               eval_loss=float(metrics["loss"]), log_loss=float(metrics["loss"]),
               base_rate_log_loss=None if constant is None else float(constant))

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
      epsilon = self.plan.selection_epsilon_per_period or None  # paid in _pay_for_period
      # DP: candidates are every id of the domain (and the OOV row), not the rows the data made.
      selected = fest.fest_rows(period.counts(), self.config.top_k, epsilon=epsilon,
                                rng=self.run_state.key.numpy_rng("dp top-k", period.index),
                                domain=ID_DOMAIN + 1).rows
    self.model.set_selected_rows(selected)
    self.state["selected_rows"] = _rows_to_json(selected)
    return sum(sizes[n] - old.get(n, 0) for n in sizes) if old else 0

  def _batches(self, period, features, labels, start, stop, sizes):
    """Poisson batches of steps [start, stop): step (p, s) always draws the same (secret) batch.
    A user-level plan samples users at q, each bringing at most k rows, and marks each row's
    user in the batch (`UNIT_KEY`: the DP step clips per user; `user_sampling.user_batch`)."""
    for step in range(start, stop):
      if self.plan.privacy_unit == "user":
        indices, unit = user_batch(
            self._users(period), self.plan.sampling_rate, self.plan.max_rows_per_user,
            self.run_state.key.numpy_rng("user poisson", period.index, step))
      else:
        rng = self.run_state.key.numpy_rng("poisson", period.index, step)
        indices = next(poisson_batch_indices(len(labels), self.plan.sampling_rate, 1, rng))
      sizes.append(len(indices))
      batch = {k: v[indices] for k, v in features.items()}
      if self.plan.privacy_unit == "user":
        batch[UNIT_KEY] = unit
      yield batch, labels[indices]

  def _key_noise(self, period, step):
    """Puts the model's noise generators on their states for step (p, s) of the run's key."""
    for purpose, generator in self.model.noise_generators().items():
      self.run_state.key.reset(generator, purpose, period, step)

  def _train_period(self, period: Period):
    """Trains the rest of period p in chunks that end at checkpoints."""
    features, labels = self._load(period)
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
      self.model.train_steps(self._batches(period, features, labels, start, stop, sizes),
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
          self._users(period)  # refuses rows without user ids before anything is charged
        steps = self._period_steps(period)
        unaffordable = self._pay_for_period(period, steps)
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
              *self._release_rows(period), self._releases(self.plan.mechanisms, "stream", 0))
        self.state["running"] = {"loss": 0.0, "reduction": 0.0, "batch": 0, "steps": 0,
                                 "total": steps, "new_ids": new_ids, "released": released}
        self._commit()
      started = time.monotonic()
      running, n = self._train_period(period)
      released = dict(running.get("released") or {}, **self.model.after_training(
          *self._release_rows(period),
          self._releases(self.plan.period_mechanisms, self._label(index), index)))
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
          "eval_period": None}
      if self.config.diagnostics:
        row["diagnostics_nonprivate"] = {"examples": n, "train_loss": running["loss"] / steps,
                                         "mean_batch_size": running["batch"] / steps}
      self.state["rows"].append(row)
      self.state.update(period=index + 1, step=0, evaluated=False, running=None)
      self._commit()
      self.metrics.write(self.state["rows"])
      self.log(_period_line(self.state["rows"]))
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

  def _composition(self):
    """How the ledger composed the run's ε (public accounting), for the summary."""
    if self.ledger is None:
      return None
    result = self.ledger.composition()
    return {"periods": "parallel" if self.plan.parallel_periods else "sequential",
            "training_epsilon": result.training_epsilon,
            "sequential_selection_epsilon": result.selection_epsilon,
            "by_days": result.partitions}

  def summary(self, resumed=False):
    rows = self.state["rows"]
    unit = self.plan.privacy_unit or "row"
    covers = dict(EPSILON_COVERS, epsilon="(epsilon, delta)-DP for " + UNITS[unit])
    return {
        **self.run_state.summary.privacy_fields(self.plan.private, covers),
        "privacy_unit": unit,
        "max_rows_per_user": self.plan.max_rows_per_user,
        "ledger_unit": self.ledger.unit if self.ledger is not None else None,
        "epsilon_composition": self._composition(),
        "periods": rows,
        "periods_trained": len(rows),
        "epsilon": self.epsilon_spent(),
        "epsilon_total": self.plan.epsilon_total if self.plan.private else None,
        "delta": self.plan.delta,
        "plan": {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                 for k, v in self.plan.to_dict().items()},
        "holdout": self.state.get("holdout"),
        "stopped": self.state["stopped"],
        "resumed": resumed,
        "run_dir": self.run_state.run_dir,
    }


def _period_line(rows):
  """One line on the period just trained (and the AUC of the model before it, on it)."""
  row = rows[-1]
  line = (f"period {row['period']} (days {', '.join(map(str, row['days']))}): trained "
          f"{row['steps']} steps")
  if row["epsilon_so_far"] is not None:
    line += f", epsilon so far {row['epsilon_so_far']:.4g}"
  if len(rows) > 1 and rows[-2]["auc"] is not None:
    line += f"; the model before it had AUC {rows[-2]['auc']:.4f} on it"
  return line


def transfer_variable(old_value: np.ndarray, new_variable: tf.Variable):
  """Copies a variable into its (possibly grown) successor: leading rows from the old value, the
  rest keeps the successor's initialisation. Only the first axis may grow."""
  new_shape = tuple(new_variable.shape)
  if old_value.shape == new_shape:
    new_variable.assign(old_value)
    return
  if old_value.shape[1:] != new_shape[1:] or old_value.shape[0] > new_shape[0]:
    raise ValueError(f"cannot grow {new_variable.name} from {old_value.shape} to {new_shape}: "
                     "only rows may be added")
  value = new_variable.numpy()
  value[:old_value.shape[0]] = old_value
  new_variable.assign(value)


def _rows_to_json(rows):
  return None if rows is None else {k: np.asarray(v).tolist() for k, v in rows.items()}


def _rows_from_json(rows):
  return None if rows is None else {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}


def _truncate_journal(path, lines):
  """Drops journal lines of steps that were trained after the last checkpoint (to be replayed)."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    kept = f.readlines()[:lines]
  atomic_io.write_text(path, "".join(kept))
