"""A run's secret noise key on disk: `secret/noise_key` in the run directory, 32 bytes from the
OS CSPRNG, mode 0600 in a 0700 directory. Keep it private: with it the noise can be replayed and
subtracted. Reloaded on resume; never copied into a checkpoint, summary, log or TensorBoard.

Every randomness the privacy proof relies on comes from the key (`NoiseKey`): the DP step's
generator, Poisson sampling (`entropy("poisson")`), DP top-k and DP counts (`numpy_rng`). An
`insecure_noise_seed` derives the key from a public seed instead (nothing stored): reproducible,
not private; the summary and every ledger charge say so."""
import os
import secrets
from typing import Optional

from dprec import atomic_io
from dprec.errors import DprecError
from dprec.privacy.noise_key import KEY_BYTES
from dprec.privacy.noise_key import NoiseKey

SECRET_DIR = "secret"
KEY_FILE = "noise_key"


def path_in(directory: str) -> str:
  """Where a run directory (or a temporary one) keeps its key."""
  return os.path.join(directory, SECRET_DIR, KEY_FILE)


def create(directory: str, insecure_seed: Optional[int] = None) -> NoiseKey:
  """A new key for a new run in `directory`, stored there unless it derives from
  `insecure_seed`."""
  key = NoiseKey.new(insecure_seed)
  if key.private:
    write(directory, key)
  return key


def write(directory: str, key: NoiseKey) -> str:
  """Stores `key` in `directory` (for processes that read the key themselves, e.g. a Beam job's
  workers); returns its path."""
  path = path_in(directory)
  _write_secret(path, key.key_bytes())
  return path


def load(directory: str, insecure_seed: Optional[int] = None) -> NoiseKey:
  """The key of the run in `directory`: the stored one, or with `insecure_seed` the key it
  derives (the run directory's run file has checked the seed is the run's)."""
  if insecure_seed is not None:
    return NoiseKey.new(insecure_seed)
  path = path_in(directory)
  try:
    with open(path, "rb") as f:
      key = f.read()
  except OSError as error:
    raise DprecError(f"{path}: the run's secret noise key is missing ({error}); the run cannot "
                     "resume on the same noise: use a new run directory") from error
  if len(key) != KEY_BYTES:
    raise DprecError(f"{path}: a noise key has {KEY_BYTES} bytes, found {len(key)}")
  return NoiseKey(key)


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
