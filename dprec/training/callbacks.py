"""Keras callbacks for DP training: pay the privacy ledger before steps run, stop at the budget;
key each step's noise, checkpoints to resume from, a tqdm progress bar and a step timer (and
the streaming trainer's per-period progress bars).

Each DP step releases a noisy gradient, so its privacy cost must be recorded before it runs.
`PrivacyBudgetCallback` therefore charges the ledger in chunks of `charge_every` steps ahead of
time (one PLD evaluation per chunk instead of one per step). When the next chunk does not fit in
the budget it charges only the steps that do; when not even one more step fits it stops training
before that step. If training ends early for another reason, up to `charge_every - 1` prepaid
steps stay charged: the ledger only ever over-states what was spent, never under-states it.
"""
import signal
import threading
import time
from typing import Mapping, Optional

import tensorflow as tf

from dprec.errors import BudgetExceededError
from dprec.progress import progress_bar


class PrivacyBudgetCallback(tf.keras.callbacks.Callback):
  """Charges a `dprec.privacy.PrivacyLedger` as `model.fit` proceeds and stops at the budget.

  Adds `epsilon` (ε charged in the ledger so far, prepaid steps included; read when charging, not
  recomputed every step) to the batch and epoch
  logs, so History and TensorBoard record it. With `log_dir`, also writes TensorBoard scalars for
  ε and for every log entry whose name contains "gradient" (the DP step's gradient-size metrics).

  Args:
    ledger: the run's privacy ledger (already holding any earlier charges, e.g. DP top-k).
    noise_multiplier: σ of one step; for DP-AdaFEST the composed (σ1⁻² + σ2⁻²)^(−1/2).
    sampling_rate: q = expected batch size / N.
    poisson: False if batches are fixed-size shuffled (the ledger flags the charge).
    charge_every: steps paid per ledger charge.
    label: recorded with each charge.
    log_dir: optional TensorBoard directory.
    steps_taken, steps_charged: where a resumed run stands: the steps it has trained, and the
      steps of this run the ledger already holds (prepaid steps that a crash discarded are
      trained again without being paid again).
    steps_held: the steps the input holds in all (a batch directory's shards), None: as many as
      `model.fit` asks for; no step beyond them is paid for, and training stops after the last.
    charge_fields: more arguments of every charge (the plan's `charge_fields`: a row-level
      charge converted for a group of k rows on a user-level ledger).
  """

  def __init__(self, ledger, noise_multiplier: float, sampling_rate: float, poisson: bool = True,
               charge_every: int = 100, label: str = "", log_dir: Optional[str] = None,
               steps_taken: int = 0, steps_charged: int = 0, steps_held: Optional[int] = None,
               charge_fields=None):
    super().__init__()
    if charge_every < 1:
      raise ValueError(f"charge_every must be >= 1, got {charge_every}")
    if not 0 <= steps_taken <= steps_charged:
      raise ValueError(f"need 0 <= steps_taken <= steps_charged, got {steps_taken}, "
                       f"{steps_charged}")
    self.ledger = ledger
    self.noise_multiplier = noise_multiplier
    self.sampling_rate = sampling_rate
    self.poisson = poisson
    self.charge_every = charge_every
    self.label = label
    self.steps_taken = steps_taken
    self.steps_charged = steps_charged
    self.steps_held = steps_held
    self.charge_fields = dict(charge_fields or {})
    # Paid steps a resumed run trains again, not charged again: nothing the run computed after
    # its last checkpoint left the run directory, so the re-run's are their only releases.
    self.rerun_steps = steps_charged - steps_taken
    self.stopped_at_budget = False
    self.epsilon = ledger.epsilon_spent()
    self._planned_steps = None
    self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None

  def _charge_kwargs(self, steps):
    return dict(noise_multiplier=self.noise_multiplier, sampling_rate=self.sampling_rate,
                steps=steps, poisson=self.poisson, **self.charge_fields)

  def _affordable_steps(self, wanted):
    """The largest n ≤ wanted whose charge fits the remaining budget (ε is monotone in n)."""
    budget = self.ledger.epsilon_spent() + self.ledger.remaining()
    low, high = 0, wanted
    while low < high:
      middle = (low + high + 1) // 2
      try:
        fits = self.ledger.epsilon_if_charged(**self._charge_kwargs(middle)) <= budget
      except BudgetExceededError:
        fits = False
      if fits:
        low = middle
      else:
        high = middle - 1
    return low

  def _prepay(self):
    """Charges the next chunk of steps; returns how many were paid for (0 at the budget)."""
    wanted = self.charge_every
    if self._planned_steps is not None:
      wanted = min(wanted, self._planned_steps - self.steps_charged)
    if wanted <= 0:
      return 0
    try:
      self.epsilon = self.ledger.charge_gaussian(label=self.label, **self._charge_kwargs(wanted))
      paid = wanted
    except BudgetExceededError:
      paid = self._affordable_steps(wanted - 1)
      if paid:
        self.epsilon = self.ledger.charge_gaussian(label=self.label, **self._charge_kwargs(paid))
    self.steps_charged += paid
    return paid

  def on_train_begin(self, logs=None):
    steps, epochs = self.params.get("steps"), self.params.get("epochs")
    self._planned_steps = steps * epochs + self.steps_taken if steps and epochs else None
    if self.steps_held is not None:
      self._planned_steps = min(self._planned_steps or self.steps_held, self.steps_held)
    if self.steps_taken == self.steps_charged and not self._prepay():
      raise BudgetExceededError(
          f"{self.ledger.path}: the privacy budget cannot pay for a single step (spent "
          f"{self.ledger.epsilon_spent():.4g} by {len(self.ledger.charges)} earlier charges, "
          f"remaining {self.ledger.remaining():.4g}). A ledger keeps what every run charged "
          "to it; to start a new budget, delete the file or give the ledger another path")

  def on_train_batch_end(self, batch, logs=None):
    self.steps_taken += 1
    if self.steps_taken == self.steps_held:
      self.model.stop_training = True  # the input holds no further step
    elif self.steps_taken == self.steps_charged:
      more_planned = self._planned_steps is None or self.steps_charged < self._planned_steps
      if more_planned and not self._prepay():
        self.stopped_at_budget = True
        self.model.stop_training = True
    if logs is not None:
      logs["epsilon"] = self.epsilon
    if self._writer is not None:
      with self._writer.as_default(step=self.steps_taken):
        tf.summary.scalar("privacy/epsilon", self.epsilon)
        for name, value in (logs or {}).items():
          if "gradient" in name:
            tf.summary.scalar(f"gradient_size/{name}", value)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      logs["epsilon"] = self.epsilon

  def on_train_end(self, logs=None):
    if self._writer is not None:
      self._writer.flush()


class KeyedNoiseCallback(tf.keras.callbacks.Callback):
  """Before every step, puts each `{purpose: tf.random.Generator}` on the state a
  `dprec.privacy.noise_key.NoiseKey` derives for (purpose, *index, step).

  A step's noise then depends only on the secret key and the step: a resumed run draws exactly
  what the uninterrupted one would, and no checkpoint needs (or holds) generator state.
  """

  def __init__(self, noise_key, generators: Mapping[str, tf.random.Generator],
               start_step: int = 0, index=()):
    super().__init__()
    self.noise_key, self.generators = noise_key, dict(generators)
    self.step, self.index = start_step, tuple(index)

  def on_train_batch_begin(self, batch, logs=None):
    for purpose, generator in self.generators.items():
      self.noise_key.reset(generator, purpose, *self.index, self.step)

  def on_train_batch_end(self, batch, logs=None):
    self.step += 1


class SharedStop(tf.keras.callbacks.Callback):
  """Stops every worker of a multi-worker `strategy` at the step where any one of them sets
  `model.stop_training` (the chief, at the budget): after every step the flag is summed over
  all replicas. Alone, the chief would leave `model.fit` while the other workers wait for it in
  the next step's collectives forever. (Put it after the callbacks that may stop.)"""

  def __init__(self, strategy):
    super().__init__()
    self.strategy = strategy

  def on_train_batch_end(self, batch, logs=None):
    flag = tf.constant(1.0 if self.model.stop_training else 0.0)
    stops = self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(lambda: flag),
                                 axis=None)
    self.model.stop_training = bool(stops > 0)


class CheckpointCallback(tf.keras.callbacks.Callback):
  """Commits an atomic checkpoint (`dprec.training.checkpoint`) every `every` steps of
  `model.fit` and at its end, so a killed run resumes from the last one; on Ctrl-C (SIGINT) it
  lets the running step finish, commits one (its steps were paid before they ran: the ledger
  holds their charge) and raises `KeyboardInterrupt`. A second Ctrl-C stops at once. Not on a
  cluster, where a checkpoint is written by every worker together or waits for steps in flight.

  Each checkpoint holds the objects of `tf_checkpoint` (model, optimizer slots, noise generator)
  and the JSON `state` with `step` (steps trained so far, counting from `start_step`) and
  `loss` (the last logged loss) filled in.
  """

  def __init__(self, manager, tf_checkpoint: tf.train.Checkpoint, every: int, state: dict,
               start_step: int = 0):
    super().__init__()
    if every < 1:
      raise ValueError(f"checkpoint every must be >= 1, got {every}")
    self.manager = manager
    self.tf_checkpoint = tf_checkpoint
    self.every = every
    self.state = dict(state, step=start_step)
    self._committed_step = start_step
    self._interrupted = False
    self._previous_handler = None

  def commit(self):
    flush = getattr(self.model, "materialise_pending", None)  # a checkpoint holds no pending noise
    if flush is not None:
      flush()
    self.manager.commit(self.state, self.tf_checkpoint.write)
    self._committed_step = self.state["step"]

  def _on_interrupt(self, signum, frame):
    if self._interrupted:  # the second Ctrl-C
      raise KeyboardInterrupt
    self._interrupted = True

  def _restore_handler(self):
    if self._previous_handler is not None:
      signal.signal(signal.SIGINT, self._previous_handler)
      self._previous_handler = None

  def on_train_begin(self, logs=None):
    clusters = (tf.distribute.MultiWorkerMirroredStrategy,
                tf.distribute.experimental.ParameterServerStrategy)
    if (threading.current_thread() is threading.main_thread()
        and not isinstance(self.model.distribute_strategy, clusters)):
      self._interrupted = False
      self._previous_handler = signal.signal(signal.SIGINT, self._on_interrupt)

  def on_train_batch_end(self, batch, logs=None):
    self.state["step"] += 1
    if logs and "loss" in logs:
      self.state["loss"] = float(logs["loss"])
    if self.state["step"] % self.every == 0:
      self.commit()
    if self._interrupted:
      self._restore_handler()
      if self.state["step"] != self._committed_step:
        self.commit()
      raise KeyboardInterrupt

  def on_train_end(self, logs=None):
    self._restore_handler()
    if self.state["step"] != self._committed_step:
      self.commit()


class StepTimer(tf.keras.callbacks.Callback):
  """Counts training steps and measures steps/s from the end of the first step (which includes
  tracing the `tf.function`) to the end of the last, less the time callbacks spent evaluating
  (`exclude`)."""

  def __init__(self):
    super().__init__()
    self.steps = 0
    self._first_end = None
    self._last_end = None
    self._excluded = self._pending = 0.0

  def exclude(self, seconds: float):
    """Leaves `seconds` spent evaluating after a step (not training) out, once a later step
    ends (time after the last step is not measured)."""
    if self._first_end is not None:
      self._pending += seconds

  def on_train_batch_end(self, batch, logs=None):
    self.steps += 1
    self._last_end = time.perf_counter()
    self._excluded, self._pending = self._excluded + self._pending, 0.0
    if self._first_end is None:
      self._first_end = self._last_end

  @property
  def seconds(self) -> float:
    """Seconds from the end of the first step to the end of the last."""
    return (self._last_end - self._first_end - self._excluded) if self.steps > 1 else 0.0

  @property
  def steps_per_second(self) -> Optional[float]:
    return (self.steps - 1) / self.seconds if self.seconds > 0 else None


class ProgressBar(tf.keras.callbacks.Callback):
  """A tqdm bar over training steps (on stderr) showing ε and gradient-size reduction, and with
  `diagnostics` the (non-private: exact, unclipped) training loss and AUC.

  ε is shown as "eps_paid": the ledger is charged ahead in blocks (`PrivacyBudgetCallback`), so
  it includes steps paid for but not yet trained. With a `timer` (`StepTimer`), the rate shown is
  its "steps/s", the summary's `steps_per_second` (training steps after the first, which traces
  the step), in place of tqdm's own rate (which counts the tracing).
  """

  SHOWN = {"epsilon": "eps_paid", "gradient_size_reduction": "gradient_size_reduction"}
  DIAGNOSTICS = {"loss": "loss", "auc": "auc"}

  RATE = "steps/s"
  WITHOUT_RATE = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

  def __init__(self, desc: str = "train", initial: int = 0, diagnostics: bool = False,
               timer: Optional[StepTimer] = None):
    """`initial`: steps already trained (a resumed run's bar starts there)."""
    super().__init__()
    self.desc = desc
    self.initial = initial
    self.shown = dict(self.SHOWN, **(self.DIAGNOSTICS if diagnostics else {}))
    self.timer = timer
    self._bar = None
    self._postfix = {}

  def on_train_begin(self, logs=None):
    steps, epochs = self.params.get("steps"), self.params.get("epochs") or 1
    rate = {} if self.timer is None else {"bar_format": self.WITHOUT_RATE}
    self._bar = progress_bar(total=self.initial + steps * epochs if steps else None,
                             initial=self.initial, desc=self.desc, unit="step", **rate)

  def _set_postfix(self, refresh):
    rate = self.timer and self.timer.steps_per_second
    self._bar.set_postfix(dict({self.RATE: f"{rate:.3g}"} if rate else {}, **self._postfix),
                          refresh=refresh)

  def on_train_batch_end(self, batch, logs=None):
    self._bar.update(1)
    if batch % 10 == 0:
      self._postfix = {self.shown[k]: f"{float(v):.4g}" for k, v in (logs or {}).items()
                       if k in self.shown}
      self._set_postfix(refresh=False)

  def on_train_end(self, logs=None):
    self._set_postfix(refresh=False)  # the final rate, the summary's steps_per_second: closing
    # draws it
    self._bar.close()


class PeriodProgress:
  """The streaming trainer's progress: one tqdm bar per period of `steps_per_period` steps (on
  stderr); the (non-private) training loss only with `diagnostics`."""

  def __init__(self, steps_per_period: int, diagnostics: bool = False):
    self.total, self.bar, self.period = steps_per_period, None, None
    self.diagnostics = diagnostics

  def __call__(self, period, step, logs):
    if period != self.period:
      if self.bar is not None:
        self.bar.close()
      self.period = period
      self.bar = progress_bar(total=self.total, initial=step, desc=f"period {period}",
                              unit="step")
    self.bar.update(1)
    if self.diagnostics:
      self.bar.set_postfix(loss=f"{logs.get('loss', float('nan')):.4f}")
    if step + 1 == self.total:
      self.bar.close()
      self.bar, self.period = None, None


class BestOnValidation(tf.keras.callbacks.Callback):
  """Model selection on validation data (early stopping's choice without stopping): every
  `every` steps and after the last, `score(model)` (lower is better, e.g. validation log loss);
  the weights of the best score are kept, and `restore` puts them back. Only for a non-private
  run: the choice reads the validation rows exactly. With a `timer` (`StepTimer`), the time
  spent scoring is left out of its steps/s."""

  def __init__(self, score, every: int, timer: Optional[StepTimer] = None):
    super().__init__()
    self.score, self.every, self.timer = score, every, timer
    self.steps, self.scores = 0, {}
    self.best_step, self._best = None, None

  def _consider(self):
    start = time.perf_counter()
    value = float(self.score(self.model))
    if self.timer is not None:
      self.timer.exclude(time.perf_counter() - start)
    self.scores[self.steps] = value
    if self.best_step is None or value < self.scores[self.best_step]:
      self.best_step, self._best = self.steps, self.model.get_weights()

  def on_train_batch_end(self, batch, logs=None):
    self.steps += 1
    if self.steps % self.every == 0:
      self._consider()

  def on_train_end(self, logs=None):
    if self.steps and self.steps not in self.scores:
      self._consider()

  def restore(self, model):
    """Puts the best weights into `model` (the one trained)."""
    if self._best is not None:
      model.set_weights(self._best)
