"""One run of a workflow (`train ctr`, `train seqrec`, `stream`, `demo`): its directory, its id,
its secret noise key, its charges in the privacy ledger, its checkpoints and its summary, in one
place for every way in.

A run directory holds:
  run.json          the run id, the command, and whether the noise is secret (shareable)
  run.json.lock     held while a process (a multi-worker run's chief) uses the directory: a
                    second one is refused
  secret/noise_key  32 bytes from the OS CSPRNG, mode 0600 in a 0700 directory. Keep it private:
                    with it the noise can be replayed and subtracted. Reloaded on resume; never
                    copied into a checkpoint, summary, log or TensorBoard.
  ledger.json       the privacy ledger (unless `ledger` names another, possibly shared, file)
  checkpoints/      `ckpt-<n>` directories (`dprec.workflows.resume`): model, optimizer slots
                    and the data position, committed atomically; no generator state: a step's
                    noise and batch are re-derived from the key and the step, so a resumed run
                    draws exactly what an uninterrupted one would
  ...               the workflow's other outputs (`stream`: journal, metrics, TensorBoard, plot)
Without a run directory nothing is stored: the key lives in memory, the id is new, nothing is
checkpointed and the ledger, unless given, is a temporary file.

The ledger is the budget of the run's data set (`data`, identified by `dprec.data.identity`):
every charge of the run records it, a ledger holding charges for another data set is refused,
and what the ledger spent on this data set before the run's first charge (e.g. a preprocessing
job's DP top-k vocabulary) is composed into the run's plan (`plan_prior`) and reported in the
summary's `epsilon_parts`.

Every randomness the privacy proof relies on comes from the key (`noise_key`): the DP step's
generator (`noise_callback`), Poisson sampling (`entropy("poisson")`), DP top-k and DP counts
(`numpy_rng`). `insecure_noise_seed` derives the key from a public seed instead: reproducible,
not private; the summary (`privacy_fields`) and every ledger charge say so.

The ledger is paid before anything is released: `check_budget` refuses, before the first charge,
a run whose unpaid part would exceed the budget; `pay_once` charges the one-off releases (Gaussian
mechanisms, DP top-k) and `budget_callback` / `pay_steps` the steps, each under the run's label.
A run only ever counts its own charges as paid (`steps_paid`, `paid`), so a resumed run pays
nothing twice and never counts another run's charges.
"""
import dataclasses
import datetime
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Mapping, Optional

from dprec import atomic_io
from dprec.data import identity
from dprec.errors import BudgetExceededError, DprecError
from dprec.privacy.noise_key import KEY_BYTES
from dprec.privacy.noise_key import NoiseKey
from dprec.workflows import resume as resume_lib

RUN_FILE = "run.json"
RUN_FORMAT = "dprec-run-v1"
SECRET_DIR = "secret"
KEY_FILE = "noise_key"
LEDGER_FILE = "ledger.json"
SUMMARY_FILE = "summary.json"  # in the run directory, unless --summary-json says otherwise
STDOUT = "-"  # --summary-json -: the JSON summary on stdout
CHECKPOINTS_DIR = "checkpoints"
WORKER_WAIT_SECONDS = 600  # how long a worker waits for the chief to create the run
BUDGET_SLACK = 1 + 1e-6  # calibration's rounding: a plan within this of the budget fits it
CHECKPOINT_EVERY = 100  # steps between checkpoints at most, unless `checkpoint_every` says


@dataclasses.dataclass(kw_only=True)
class RunOptions:
  """The options of every way in that concern the run rather than the model: where its files go,
  its randomness (`seed`: public initialisation only) and how it reports."""
  run_dir: Optional[str] = None
  ledger: Optional[str] = None
  accountant: str = "pld"
  checkpoint_every: Optional[int] = None  # None: `checkpoint_interval`
  seed: int = 0
  insecure_noise_seed: Optional[int] = None
  secure_noise: bool = False  # exact noise, no floating-point artefact (`privacy.secure_noise`)
  diagnostics: bool = False
  progress: bool = True
  summary_json: Optional[str] = None

  # Options a resumed run may change (where files go, how it reports); a workflow adds its own.
  NOT_FINGERPRINTED = ("data", "run_dir", "ledger", "checkpoint_every", "keep_checkpoints",
                       "diagnostics", "progress", "summary_json")

  def validate(self):
    if self.checkpoint_every is not None and self.checkpoint_every < 1:
      raise DprecError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")

  def checkpoint_interval(self, steps=None) -> int:
    """Steps between checkpoints: `checkpoint_every` if set, else a quarter of the run's `steps`
    (None: unknown) and at most `CHECKPOINT_EVERY`, so that a short run killed early resumes past
    step 0."""
    if self.checkpoint_every is not None:
      return self.checkpoint_every
    return CHECKPOINT_EVERY if steps is None else max(1, min(CHECKPOINT_EVERY, steps // 4))

  def run_fingerprint(self, **extra) -> dict:
    """The options a resumed run must share with the run it continues (`fingerprint`)."""
    return resume_lib.fingerprint(self, self.NOT_FINGERPRINTED, **extra)


@dataclasses.dataclass(kw_only=True)
class FitOptions(RunOptions):
  """`RunOptions` of a `model.fit` run (`train ctr`, `train seqrec`): its batches, its ledger
  charges and how many checkpoints it keeps."""
  fixed_batches: bool = False
  charge_every: int = 100
  keep_checkpoints: Optional[int] = 2  # None or 0: keep all

  def validate(self):
    super().validate()
    if self.keep_checkpoints is not None and self.keep_checkpoints < 0:
      raise DprecError(f"--keep-checkpoints must be >= 0, got {self.keep_checkpoints}")
    if self.charge_every < 1:
      raise DprecError(f"--charge-every must be >= 1, got {self.charge_every}")


class Run:
  """See the module docstring. Use as a context manager (removes a temporary ledger)."""

  def __init__(self, command: str, run_dir: Optional[str] = None, ledger: Optional[str] = None,
               insecure_noise_seed: Optional[int] = None, secure_noise: bool = False,
               data: Optional[str] = None, chief: bool = True):
    self.command, self.run_dir, self.secure_noise = command, run_dir, secure_noise
    self.chief = chief
    if not chief and run_dir is None and insecure_noise_seed is None:
      raise DprecError("the workers of a multi-worker run share the chief's secret noise key "
                       "through its run directory: give --run-dir (a directory every worker "
                       "can read, e.g. on a shared file system)")
    # The data set trained on (None: in-memory data, which no charge can be matched to).
    self.data = data
    self.dataset = identity.dataset_identity(data) if data is not None else None
    self._temporary = self._lock = self._scratch_dir = None
    if run_dir is None:
      self.run_id = secrets.token_hex(8)
      self.noise_key = NoiseKey.new(insecure_noise_seed)
      self._temporary = tempfile.mkdtemp(prefix="dprec-run-")
      base = self._temporary
    else:
      os.makedirs(run_dir, exist_ok=True)
      if chief:  # the other workers of a multi-worker run only read the chief's directory
        self._lock = atomic_io.lock(os.path.join(run_dir, RUN_FILE), wait=False)
        if self._lock is None:
          raise DprecError(f"{run_dir}: another dprec process is using this run directory; "
                           "wait for it to finish, or use another --run-dir")
      try:
        self.run_id, self.noise_key = self._load_or_create(insecure_noise_seed)
      except BaseException:
        self.close()
        raise
      base = run_dir
    self.ledger_path = ledger or os.path.join(base, LEDGER_FILE)
    self._temporary_ledger = ledger is None and run_dir is None
    self.ledger = None  # opened by `open_ledger` (a private run)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    if self._lock is not None:  # the run directory is free for a resume
      self._lock.close()
      self._lock = None
    for directory in (self._temporary, self._scratch_dir):
      if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    self._temporary = self._scratch_dir = None

  def _scratch(self):
    """A temporary directory of this process (removed by `close`)."""
    if self._scratch_dir is None:
      self._scratch_dir = tempfile.mkdtemp(prefix="dprec-worker-")
    return self._scratch_dir

  # ---- the run directory -------------------------------------------------------------------

  @property
  def key_path(self):
    return os.path.join(self.run_dir, SECRET_DIR, KEY_FILE)

  def key_file(self) -> str:
    """The run's secret key file, for processes that read the key themselves (a Beam job's
    workers): the run directory's, else one written (mode 0600) into the run's temporary
    directory, removed by `close`."""
    if self.run_dir is not None:
      return self.key_path
    path = os.path.join(self._temporary, SECRET_DIR, KEY_FILE)
    if not os.path.exists(path):
      _write_secret(path, self.noise_key.key_bytes())
    return path

  @property
  def checkpoint_dir(self):
    return os.path.join(self.run_dir, CHECKPOINTS_DIR)

  def _load_or_create(self, insecure_seed):
    path = os.path.join(self.run_dir, RUN_FILE)
    if not self.chief:  # the chief creates the run (id, key); the other workers read it
      _wait_for(path, "the chief's run file")
    if not os.path.exists(path):
      key = NoiseKey.new(insecure_seed)
      if key.private:
        _write_secret(self.key_path, key.key_bytes())
      run_id = secrets.token_hex(8)
      created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
      atomic_io.write_json(path, {"format": RUN_FORMAT, "run_id": run_id,
                                  "command": self.command, "created": created,
                                  "insecure_noise_seed": insecure_seed})
      return run_id, key
    try:
      with open(path, encoding="utf-8") as f:
        info = json.load(f)
      run_id = info["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as error:
      raise DprecError(f"{path}: not a readable dprec run file ({error})") from error
    if info.get("command") != self.command:
      raise DprecError(f"{path}: this run directory belongs to `{info.get('command')}`, not "
                       f"`{self.command}`; use another run directory")
    if info.get("insecure_noise_seed") != insecure_seed:
      raise DprecError(f"{path}: field insecure_noise_seed: the run was started with "
                       f"{info.get('insecure_noise_seed')!r}, now {insecure_seed!r}; resume it "
                       "with the same --insecure-noise-seed (or none)")
    if insecure_seed is not None:
      return run_id, NoiseKey.new(insecure_seed)
    try:
      with open(self.key_path, "rb") as f:
        key = f.read()
    except OSError as error:
      raise DprecError(f"{self.key_path}: the run's secret noise key is missing ({error}); "
                       "the run cannot resume on the same noise: use a new run directory") \
          from error
    if len(key) != KEY_BYTES:
      raise DprecError(f"{self.key_path}: a noise key has {KEY_BYTES} bytes, found {len(key)}")
    return run_id, NoiseKey(key)

  # ---- randomness --------------------------------------------------------------------------

  @property
  def private(self) -> bool:
    """Whether the run's randomness is secret."""
    return self.noise_key.private

  def numpy_rng(self, purpose, *index):
    return self.noise_key.numpy_rng(purpose, *index)

  def entropy(self, purpose, *index):
    return self.noise_key.entropy(purpose, *index)

  def noise_callback(self, generators: Mapping[str, object], start_step: int = 0, index=()):
    """A Keras callback putting each `{purpose: tf.random.Generator}` on its state for
    (purpose, index..., step) before every step."""
    from dprec.training import callbacks
    return callbacks.KeyedNoiseCallback(self.noise_key, generators, start_step, index)

  # ---- the ledger --------------------------------------------------------------------------

  def open_ledger(self, epsilon_budget, delta, accountant, default_delta=None, unit=None):
    """The ledger at `ledger_path` (also kept as `self.ledger`); every charge this run makes
    records its `run_id` and data set (and, with insecure noise, `private: false` and the
    reason). `delta` None: the existing ledger's δ, or `default_delta` for a new one. `unit`:
    the privacy unit of its budget (None: the existing ledger's, else "row"; another than an
    existing ledger's is refused). Refuses a ledger holding charges for another data set."""
    from dprec.privacy import PrivacyLedger
    if not self.chief and self._temporary is None:  # a shared ledger: the chief creates it
      _wait_for(self.ledger_path, "the chief's privacy ledger")
    if delta is None and not os.path.exists(self.ledger_path):
      delta = default_delta
    marks = {} if self.private else {"private": False, "privacy_note": self.noise_key.note}
    if self.dataset is not None:
      marks["dataset"] = self.dataset
    self.ledger = PrivacyLedger(self.ledger_path, epsilon_budget=epsilon_budget, delta=delta,
                                accountant=accountant, run_id=self.run_id, marks=marks,
                                unit=unit)
    self.ledger.check_dataset(self.dataset)
    return self.ledger

  @property
  def ledger_file(self) -> Optional[str]:
    """The path of the ledger this run opened (None: none, or a temporary one, removed at the
    end of the run)."""
    return None if self.ledger is None or self._temporary_ledger else self.ledger_path

  def open_plan_ledger(self, plan):
    """The ledger of a `dprec.workflows.plan.PrivacyPlan`'s budget (the one `plan_prior`
    opened, if it did); None for a non-private plan."""
    if not plan.private:
      return None
    return self.ledger or self.open_ledger(plan.epsilon_total, plan.delta, plan.accountant,
                                           unit=plan.privacy_unit)

  def steps_paid(self, ledger, label) -> int:
    """Steps this run has charged under `label` (charges of other runs never count)."""
    return sum(charge.get("steps", 0) for charge in ledger.charges_of(self.run_id, label))

  def paid(self, ledger, label) -> bool:
    """Whether this run has charged `label` already."""
    return bool(ledger.charges_of(self.run_id, label))

  def _unpaid(self, plan, selections, mechanisms=None):
    mechanisms = plan.mechanisms if mechanisms is None else mechanisms
    gaussian = [(sigma, label) for label, sigma in mechanisms.items()
                if not self.paid(self.ledger, label)]
    pure = {label: epsilon for label, epsilon in selections.items()
            if epsilon and not self.paid(self.ledger, label)}
    return gaussian, pure

  def epsilon_if_paid(self, plan, label, steps, selections=None, noise_multiplier=None,
                      sampling_rate=None, mechanisms=None, days=None) -> float:
    """ε the ledger would reach once this run has paid for `steps` steps under `label` (at the
    plan's σ and q unless given), the Gaussian `mechanisms` {label: σ} (default: the plan's)
    and the pure-ε `selections` {label: ε}; what it has paid already counts once. The steps and
    mechanisms read the data set's `days` (None: every day; `PrivacyLedger`), the selections
    every day, in the ledger's unit (a user-level stream's σ and q are per user). Nothing is
    charged."""
    gaussian, pure = self._unpaid(plan, selections or {}, mechanisms)
    unpaid = max(0, steps - self.steps_paid(self.ledger, label))
    epsilon = self.ledger.epsilon_if_charged(
        plan.noise_multiplier if noise_multiplier is None else noise_multiplier,
        plan.sampling_rate if sampling_rate is None else sampling_rate,
        unpaid, poisson=plan.poisson, label=label, gaussian_mechanisms=gaussian, days=days,
        approximate=[(0.0, delta, label) for label, delta in self._unpaid_truncation(plan)],
        **plan.charge_fields)
    return epsilon + sum(pure.values())  # basic composition, as the ledger does

  def _unpaid_truncation(self, plan):
    """[(label, δ)] of the plan's batch cap (`dprec.privacy.truncation`) if unpaid."""
    from dprec.privacy import truncation
    if not plan.truncation_delta or self.paid(self.ledger, truncation.LABEL):
      return []
    return [(truncation.LABEL, plan.truncation_delta)]

  def fits(self, epsilon) -> bool:
    return epsilon <= self.ledger.epsilon_budget * BUDGET_SLACK

  def check_budget(self, plan, label, steps, selections=None, **rates):
    """Raises `BudgetExceededError`, before anything is charged, if paying this run's unpaid
    part (`epsilon_if_paid`) would bring the ledger over its budget."""
    planned = self.epsilon_if_paid(plan, label, steps, selections, **rates)
    if not self.fits(planned):
      raise BudgetExceededError(
          f"{self.ledger.path}: the planned run would bring the ledger to ε={planned:.4g} > "
          f"budget {self.ledger.epsilon_budget:g} (already spent "
          f"{self.ledger.epsilon_spent():.4g})")

  def pay_once(self, plan, selections=None, mechanisms=None, days=None):
    """Charges the Gaussian `mechanisms` {label: σ} (default: the plan's) on `days`, then the
    `selections` {label: (ε, δ)}, that this run has not paid yet (a resumed run re-draws them
    from the key and pays nothing again). Only the chief of a multi-worker run charges (here
    and in `pay_steps`, `budget_callback`). The plan's batch cap is paid here too, as the
    (0, δ_trunc) release of `dprec.privacy.truncation`."""
    if not self.chief:
      return
    for label, delta in self._unpaid_truncation(plan):
      self.ledger.charge_approximate(0.0, delta, label)
    for label, sigma in (plan.mechanisms if mechanisms is None else mechanisms).items():
      if not self.paid(self.ledger, label):
        self.ledger.charge_gaussian_mechanism(sigma, label, days, **plan.charge_fields)
    for label, (epsilon, delta) in (selections or {}).items():
      if epsilon and not self.paid(self.ledger, label):
        self.ledger.charge_approximate(epsilon, delta, label)

  def pay_steps(self, plan, label, steps, days=None):
    """Charges the steps of `steps` under `label` (reading `days`) this run has not paid yet."""
    if not self.chief:
      return
    unpaid = steps - self.steps_paid(self.ledger, label)
    if unpaid > 0:
      self.ledger.charge_gaussian(plan.noise_multiplier, plan.sampling_rate, unpaid,
                                  poisson=plan.poisson, label=label, days=days,
                                  **plan.charge_fields)

  def check_ledger_covers_checkpoint(self, label):
    """Raises `DprecError` if the ledger holds fewer steps of this run under `label` than its
    newest checkpoint has trained (steps are paid before they are taken): the run's ledger was
    deleted or replaced after it trained, and going on would release a model the ledger does
    not account for. Call it before the run charges anything (the chief: it alone charges)."""
    if not self.chief:
      return
    trained = resume_lib.checkpointed_step(self.checkpoint_dir) if self.run_dir else 0
    paid = self.steps_paid(self.ledger, label)
    if paid < trained:
      other = sorted(other for other in {c.get("label") for c in self.ledger.charges} - {label}
                     if self.steps_paid(self.ledger, other) >= trained)
      if other:
        raise DprecError(
            f"{self.run_dir}: this run trained as '{other[0]}', and this command asks for "
            f"'{label}': an argument changed (not the ledger). Rerun with the run's arguments "
            "to resume it, or use a new --run-dir to train from scratch")
      raise DprecError(
          f"{self.ledger.path}: this ledger holds {paid} steps of run {self.run_id} under "
          f"'{label}', but the run's checkpoints in {self.run_dir} have trained {trained}: the "
          "run's ledger was deleted or replaced after it trained. Put the run's ledger back at "
          "that path (or give it with --ledger) and rerun; to train from scratch instead, use "
          "a new --run-dir")

  def budget_callback(self, plan, label, start_step=0, charge_every=100, log_dir=None,
                      steps_held=None):
    """`PrivacyBudgetCallback` paying the plan's steps under `label` ahead of `model.fit`; a
    resumed run (at `start_step`) pays again only for steps it has not paid; `steps_held`: the
    steps its input holds (none paid beyond them). None on a worker that is not the chief: each
    global step is paid once, by the chief."""
    if not self.chief:
      return None
    from dprec.training import callbacks
    return callbacks.PrivacyBudgetCallback(
        self.ledger, plan.noise_multiplier, plan.sampling_rate, poisson=plan.poisson,
        charge_every=charge_every, label=label, log_dir=log_dir, steps_taken=start_step,
        steps_charged=self.steps_paid(self.ledger, label), steps_held=steps_held,
        charge_fields=plan.charge_fields)

  # ---- checkpoints and resume ----------------------------------------------------------------

  def resume(self, model, options, keep=2, **facts):
    """A `dprec.workflows.resume.Resume` of `model` in this run's directory (where it stands),
    for a run of `options` (a `RunOptions`) on data with these `facts`."""
    return resume_lib.Resume(
        self.run_dir and self.checkpoint_dir, resume_lib.checkpoint_objects(model),
        options.run_fingerprint(**facts), keep,
        resume_lib.fingerprint_defaults(options, options.NOT_FINGERPRINTED))

  def fit_callbacks(self, generators, resume, charges=None, checkpoint_every=100, extra=(),
                    progress=None, diagnostics=False):
    """(step timer, the callbacks of `model.fit`): the timer, each step's noise keyed from
    (purpose, step), `charges` (paying the ledger), a checkpoint every `checkpoint_every` steps
    with a run directory (by the chief; the other workers write theirs to a scratch directory
    and read the chief's on resume), `extra`, and a progress bar titled `progress` (None:
    none)."""
    from dprec.training import callbacks
    timer = callbacks.StepTimer()
    fit = [timer, self.noise_callback(generators, start_step=resume.step)]
    fit += [charges] if charges is not None else []
    if resume.manager is not None:
      fit.append(resume.callback(checkpoint_every, None if self.chief else self._scratch()))
    fit += list(extra)
    if progress:
      fit.append(callbacks.ProgressBar(desc=progress, initial=resume.step,
                                       diagnostics=diagnostics, timer=timer))
    return timer, fit

  def fit(self, model, features, labels, batch_size, poisson, steps, resume, callbacks,
          coordinator=None, batches=None, read=None, max_batch_size=None):
    """`model.fit` from `resume.step` to `steps` on batches of (`features`, `labels`) drawn with
    the run's secret entropy (Poisson at q = B/N, truncated to `max_batch_size` if given, else
    fixed-size shuffled): the very batches an uninterrupted run draws; or on `batches`, a
    `tf.data.Dataset` of the (features, labels) batches of steps `resume.step`.. drawn elsewhere
    (out of core: `dprec.workflows.out_of_core`).
    Under the `tf.distribute` strategy `model` was built in, every worker draws the same global
    batches and each replica trains on its shard. With the `coordinator` of a
    `ParameterServerStrategy`, this chief draws the batches and schedules step t on a worker
    with its batch (or, with `read`, `batches` are the steps' references and the worker reads its
    batch itself: `read(reference)`) and the noise state of (the DP step, t)
    (`dprec.distribute.parameter_server.fit`). Returns the history ({} when no step is left)."""
    import tensorflow as tf
    from dprec.training import poisson as sampling_lib
    if steps <= resume.step:
      if self.chief:
        print(f"dprec: {self.run_dir}: this run finished its {steps} steps before: evaluating "
              "its model again (nothing charged)", file=sys.stderr)
      return {}
    sampling = sampling_lib.BatchSampling(batch_size, poisson, self.entropy("poisson"),
                                          max_batch_size)
    distributed = model.distribute_strategy is not tf.distribute.get_strategy()
    if batches is None and (coordinator is not None or not distributed):
      batches = sampling_lib.sampled_dataset(features, labels, sampling, steps, resume.step)
    if coordinator is not None:
      from dprec.distribute import parameter_server
      from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
      from dprec.training.callbacks import CheckpointCallback
      return parameter_server.fit(
          model, coordinator, batches,
          (self.noise_key.tf_state(NOISE_PURPOSE, t) for t in range(resume.step, steps)),
          steps - resume.step, callbacks,
          sync_every=next((c.every for c in callbacks if isinstance(c, CheckpointCallback)),
                          None), read=read)
    if batches is None:  # every replica of the strategy draws its shard of the global batch
      batches = tf.keras.utils.experimental.DatasetCreator(sampling_lib.replica_dataset_fn(
          features, labels, sampling, steps, resume.step))
    return model.fit(batches, epochs=1, steps_per_epoch=steps - resume.step,
                     callbacks=callbacks, verbose=0).history

  # ---- the summary -------------------------------------------------------------------------

  def privacy_fields(self, dp: bool, epsilon_covers: dict, notes=()) -> dict:
    """The summary's privacy fields: `ledger` (the path of the ledger charged; None: none, or a
    temporary one), `private` (a DP algorithm with secret randomness),
    `privacy_note` (why not, and other caveats), `epsilon_covers` (which outputs ε covers),
    `secure_noise` (the DP step's noise sampled exactly); with the run's ledger, `epsilon_parts`
    (preprocessing selection and training, adding up to its ε) and, with its data directory,
    `dataset` (which data set, and whether its vocabulary is DP): both public."""
    reasons = ([] if dp else ["non-private training: no differential privacy"])
    reasons += [] if self.private else [self.noise_key.note]
    public = list(epsilon_covers.get("public", [])) + [
        "epsilon_parts (accounting), ledger (its path) and dataset (the data set's path, id "
        "and vocab_privacy)"]
    fields = {"run_id": self.run_id, "epsilon_covers": dict(epsilon_covers, public=public),
              "secure_noise": self.secure_noise, "ledger": self.ledger_file}
    public_seeded = []
    if self.ledger is not None:
      fields["epsilon_parts"] = self.ledger.parts()
      preprocessing = fields["epsilon_parts"]["preprocessing_selection"]["charges"]
      public_seeded = [f"preprocessing release '{c['label']}' drew its randomness from a public "
                       "seed: it is NOT differentially private"
                       for c in preprocessing if not c["private"]]
    if self.dataset is not None:
      fields["dataset"] = dict(self.dataset, vocab_privacy=identity.manifest_field(
          self.data, "vocab_privacy"))
    return dict(fields, private=dp and self.private and not public_seeded,
                privacy_note="; ".join(reasons + public_seeded + list(notes)) or None)

  def privacy_summary(self, plan, epsilon_covers, dp=None, notes=()) -> dict:
    """ε spent (None without a ledger), δ, the accountant, Poisson or not, and
    `privacy_fields` (with the plan's notes)."""
    ledger = self.ledger
    return {"epsilon": ledger.epsilon_spent() if ledger is not None else None,
            "delta": plan.delta, "accountant": plan.accountant if ledger is not None else None,
            "poisson": bool(ledger is not None and plan.poisson),
            **self.privacy_fields(plan.private if dp is None else dp, epsilon_covers,
                                  plan.notes + list(notes))}


def plan_prior(run, epsilon_budget, delta, accountant, default_delta, unit=None):
  """(δ, `Spent`) a privacy plan starts from. In a private `run` (a finite `epsilon_budget`):
  its ledger, opened now (`Run.open_ledger`: δ `delta`, else the existing ledger's, else
  `default_delta`; privacy `unit`, None: the existing ledger's, else "row"), and what it spent
  on the run's data set before the run's first charge (`PrivacyLedger.spent_before`: e.g. a DP
  top-k vocabulary; a resumed run finds what it found when it started). Otherwise (`run`
  None: planning alone): (`delta` or `default_delta`, nothing spent)."""
  from dprec.privacy import composition
  if run is None or epsilon_budget is None or not math.isfinite(epsilon_budget):
    return (default_delta if delta is None else delta), composition.Spent()
  ledger = run.open_ledger(epsilon_budget, delta, accountant, default_delta, unit)
  return ledger.delta, ledger.spent_before(run.run_id)


def summary_path(options: RunOptions) -> Optional[str]:
  """Where the JSON summary goes: `--summary-json` (`STDOUT`: printed by `report`), else
  RUN_DIR/summary.json with a run directory, else nowhere."""
  if options.summary_json:
    return options.summary_json
  return os.path.join(options.run_dir, SUMMARY_FILE) if options.run_dir else None


def write_summary(summary, path):
  """Writes the JSON summary (strict JSON: `atomic_io.strict`) to `path` atomically (None or
  `STDOUT`: no file)."""
  if path and path != STDOUT:
    atomic_io.write_json(path, summary, sort_keys=True)


def report(summary: dict, options: RunOptions, result: str) -> int:
  """Ends a command: its one-line `result` (the metric with its baseline, ε with its unit and δ:
  `dprec.workflows.result`) on stdout, followed by where the JSON summary is; with
  `--summary-json -` the JSON on stdout and the line on stderr. Returns 0 (the exit status)."""
  path = summary_path(options)
  if path == STDOUT:
    print(atomic_io.dumps(summary, indent=2, sort_keys=True))
    print(result, file=sys.stderr)
  else:
    print(f"{result}; summary: {path}" if path else
          f"{result} (JSON summary: --summary-json PATH, or - for stdout)")
  return 0


def _wait_for(path, what, timeout=WORKER_WAIT_SECONDS):
  """Waits (a worker that is not the chief) until `path` exists."""
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise DprecError(f"{path}: {what} did not appear within {timeout:g} s; start the chief "
                       "(worker 0) with the same --run-dir")
    time.sleep(0.2)


def _write_secret(path, data):
  """Writes `data` to `path` atomically with mode 0600 (directory 0700)."""
  directory = os.path.dirname(path)
  os.makedirs(directory, mode=0o700, exist_ok=True)
  os.chmod(directory, 0o700)
  tmp = f"{path}.tmp-{secrets.token_hex(4)}"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  atomic_io.fsync_directory(directory)
