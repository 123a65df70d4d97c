"""A run's directory: where its files go, its id and its lock.

  run.json          the run id, the command, and whether the noise is secret (shareable)
  run.json.lock     held while a process (a multi-worker run's chief) uses the directory: a
                    second one is refused
  secret/noise_key  the run's secret noise key (`dprec.workflows.run_key`)
Without a run directory the run's files go to a temporary directory of this process, removed at
the end of the run, and the id is new."""
import datetime
import json
import os
import secrets
import shutil
import tempfile
import time
from typing import Optional

from dprec import atomic_io
from dprec.errors import DprecError
from dprec.privacy.noise_key import NoiseKey
from dprec.workflows import run_key

RUN_FILE = "run.json"
RUN_FORMAT = "dprec-run-v1"
WORKER_WAIT_SECONDS = 600  # how long a worker waits for the chief to create the run


class RunDirectory:
  """The directory of a run of `command` (`path`; None: a temporary one) and, once `open`, its
  id and key. `chief`: this process creates the run and holds the lock; the other workers of a
  multi-worker run wait for the chief's run file and only read the directory. Close it to
  release the lock and remove the temporary directories."""

  def __init__(self, command: str, path: Optional[str] = None, chief: bool = True):
    self.command, self.path, self.chief = command, path, chief
    self._lock = self._scratch = None
    self.temporary = None if path is not None else tempfile.mkdtemp(prefix="dprec-run-")
    if path is None:
      return
    os.makedirs(path, exist_ok=True)
    if chief:
      self._lock = atomic_io.lock(os.path.join(path, RUN_FILE), wait=False)
      if self._lock is None:
        raise DprecError(f"{path}: another dprec process is using this run directory; wait for "
                         "it to finish, or use another --run-dir")

  @property
  def base(self) -> str:
    """The run directory, else the temporary one."""
    return self.path if self.path is not None else self.temporary

  def open(self, insecure_seed: Optional[int] = None):
    """(run id, `NoiseKey`): a temporary run's new ones; the run file's and the stored key of
    a run directory, both created first if the run is new. Refuses a run file of another
    command or another `insecure_seed`."""
    if self.path is None:
      return secrets.token_hex(8), NoiseKey.new(insecure_seed)
    path = os.path.join(self.path, RUN_FILE)
    if not self.chief:  # the chief creates the run (id, key); the other workers read it
      wait_for(path, "the chief's run file")
    if not os.path.exists(path):
      key = run_key.create(self.path, insecure_seed)  # before the run file that announces it
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
    return run_id, run_key.load(self.path, insecure_seed)

  def key_file(self, key) -> str:
    """The run's secret key file, for processes that read the key themselves (a Beam job's
    workers): the run directory's, else one written (mode 0600) into the temporary directory."""
    path = run_key.path_in(self.base)
    if self.path is None and not os.path.exists(path):
      run_key.write(self.base, key)
    return path

  def scratch(self) -> str:
    """A temporary directory of this process (removed by `close`)."""
    if self._scratch is None:
      self._scratch = tempfile.mkdtemp(prefix="dprec-worker-")
    return self._scratch

  def close(self):
    if self._lock is not None:  # the run directory is free for a resume
      self._lock.close()
      self._lock = None
    for directory in (self.temporary, self._scratch):
      if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    self.temporary = self._scratch = None


def wait_for(path, what, timeout=WORKER_WAIT_SECONDS):
  """Waits (a worker that is not the chief) until `path` exists."""
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise DprecError(f"{path}: {what} did not appear within {timeout:g} s; start the chief "
                       "(worker 0) with the same --run-dir")
    time.sleep(0.2)
