"""One run of a workflow (`train ctr`, `train seqrec`, `stream`, `demo`): its directory, its id,
its secret noise key and its charges in the privacy ledger, in one place for every way in.

A run directory holds:
  run.json          the run id, the command, and whether the noise is secret (shareable)
  secret/noise_key  32 bytes from the OS CSPRNG, mode 0600 in a 0700 directory. Keep it private:
                    with it the noise can be replayed and subtracted. Reloaded on resume; never
                    copied into a checkpoint, summary, log or TensorBoard.
  ledger.json       the privacy ledger (unless `ledger` names another, possibly shared, file)
  ...               the workflow's checkpoints and outputs (no generator state in checkpoints:
                    a step's noise is re-derived from the key and the step)
Without a run directory nothing is stored: the key lives in memory, the id is new, and the
ledger, unless given, is a temporary file.

The ledger is the budget of the run's data set (`data`, identified by `dprec.data.identity`):
every charge of the run records it, a ledger holding charges for another data set is refused,
and what the ledger spent on this data set before the run's first charge (e.g. a preprocessing
job's DP top-k vocabulary) is composed into the run's plan (`spent_before`) and reported in the
summary's `epsilon_parts`.

Every randomness the privacy proof relies on comes from the key (`noise_key`): the DP step's
generator (`noise_callback`), Poisson sampling (`entropy("poisson")`), DP top-k and DP counts
(`numpy_rng`). `insecure_noise_seed` derives the key from a public seed instead: reproducible,
not private; the summary (`privacy_fields`) and every ledger charge say so.
"""
import datetime
import json
import os
import secrets
import shutil
import tempfile
from typing import Mapping, Optional

from dprec import atomic_io
from dprec.data import identity
from dprec.errors import DprecError
from dprec.privacy.noise_key import KEY_BYTES
from dprec.privacy.noise_key import NoiseKey

RUN_FILE = "run.json"
RUN_FORMAT = "dprec-run-v1"
SECRET_DIR = "secret"
KEY_FILE = "noise_key"
LEDGER_FILE = "ledger.json"


class Run:
  """See the module docstring. Use as a context manager (removes a temporary ledger)."""

  def __init__(self, command: str, run_dir: Optional[str] = None, ledger: Optional[str] = None,
               insecure_noise_seed: Optional[int] = None, data: Optional[str] = None):
    self.command, self.run_dir, self.data = command, run_dir, data
    # The data set trained on (None: in-memory data, which no charge can be matched to).
    self.dataset = identity.dataset_identity(data) if data is not None else None
    self._temporary = None
    # Whether the run directory already held this run (a resumed run: same id, same key).
    self.resumed = run_dir is not None and os.path.exists(os.path.join(run_dir, RUN_FILE))
    if run_dir is None:
      self.run_id = secrets.token_hex(8)
      self.noise_key = _key(insecure_noise_seed)
      self._temporary = tempfile.mkdtemp(prefix="dprec-run-")
      base = self._temporary
    else:
      os.makedirs(run_dir, exist_ok=True)
      self.run_id, self.noise_key = self._load_or_create(insecure_noise_seed)
      base = run_dir
    self.ledger_path = ledger or os.path.join(base, LEDGER_FILE)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    if self._temporary is not None:
      shutil.rmtree(self._temporary, ignore_errors=True)
      self._temporary = None

  # ---- the run directory -------------------------------------------------------------------

  @property
  def key_path(self):
    return os.path.join(self.run_dir, SECRET_DIR, KEY_FILE)

  def _load_or_create(self, insecure_seed):
    path = os.path.join(self.run_dir, RUN_FILE)
    if not os.path.exists(path):
      key = _key(insecure_seed)
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
      return run_id, _key(insecure_seed)
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
    from dprec.training import callbacks  # pylint: disable=import-outside-toplevel
    return callbacks.KeyedNoiseCallback(self.noise_key, generators, start_step, index)

  # ---- the ledger --------------------------------------------------------------------------

  def open_ledger(self, epsilon_budget, delta, accountant, default_delta=None):
    """The ledger at `ledger_path`; every charge this run makes records its `run_id` and data
    set (and, with insecure noise, `private: false` and the reason). `delta` None: the existing
    ledger's δ, or `default_delta` for a new one. Refuses a ledger holding charges for another
    data set."""
    from dprec.privacy import PrivacyLedger  # pylint: disable=import-outside-toplevel
    if delta is None and not os.path.exists(self.ledger_path):
      delta = default_delta
    marks = {} if self.private else {"private": False, "privacy_note": self.noise_key.note}
    if self.dataset is not None:
      marks["dataset"] = self.dataset
    ledger = PrivacyLedger(self.ledger_path, epsilon_budget=epsilon_budget, delta=delta,
                           accountant=accountant, run_id=self.run_id, marks=marks)
    ledger.check_dataset(self.dataset)
    return ledger

  def spent_before(self, ledger):
    """What `ledger` (None: nothing) spent on this data set before this run's first charge
    (`PrivacyLedger.spent_before`): what the run's privacy plan composes with."""
    from dprec.privacy import composition  # pylint: disable=import-outside-toplevel
    return composition.Spent() if ledger is None else ledger.spent_before(self.run_id)

  def steps_paid(self, ledger, label) -> int:
    """Steps this run has charged under `label` (charges of other runs never count)."""
    return sum(charge.get("steps", 0) for charge in ledger.charges_of(self.run_id, label))

  def paid(self, ledger, label) -> bool:
    """Whether this run has charged `label` already."""
    return bool(ledger.charges_of(self.run_id, label))

  # ---- the summary -------------------------------------------------------------------------

  def privacy_fields(self, dp: bool, epsilon_covers: dict, notes=(), ledger=None) -> dict:
    """The summary's privacy fields: `private` (a DP algorithm with secret randomness),
    `privacy_note` (why not, and other caveats), `epsilon_covers` (which outputs ε covers);
    with the run's `ledger`, `epsilon_parts` (preprocessing selection and training, adding up
    to its ε) and, with its data directory, `dataset` (which data set, and whether its
    vocabulary is DP): both public."""
    reasons = ([] if dp else ["non-private training: no differential privacy"])
    reasons += [] if self.private else [self.noise_key.note]
    public = list(epsilon_covers.get("public", [])) + [
        "epsilon_parts (accounting) and dataset (the data set's path, id and vocab_privacy)"]
    fields = {"run_id": self.run_id, "epsilon_covers": dict(epsilon_covers, public=public)}
    public_seeded = []
    if ledger is not None:
      fields["epsilon_parts"] = ledger.parts()
      preprocessing = fields["epsilon_parts"]["preprocessing_selection"]["charges"]
      public_seeded = [f"preprocessing release '{c['label']}' drew its randomness from a public "
                       "seed: it is NOT differentially private"
                       for c in preprocessing if not c["private"]]
    if self.dataset is not None:
      fields["dataset"] = dict(self.dataset, vocab_privacy=identity.manifest_field(
          self.data, "vocab_privacy"))
    return dict(fields, private=dp and self.private and not public_seeded,
                privacy_note="; ".join(reasons + public_seeded + list(notes)) or None)


def _key(insecure_seed):
  return NoiseKey.fresh() if insecure_seed is None else NoiseKey.insecure(insecure_seed)


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
