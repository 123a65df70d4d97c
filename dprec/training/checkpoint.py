"""Atomic checkpoints of a streaming run: model, optimizer slots, data position and ledger.

A checkpoint is a directory `ckpt-<n>` written under a temporary name, flushed to disk, and
renamed into place; a `LATEST` pointer (itself replaced atomically) names the newest one. A
`kill -9` at any moment therefore leaves either the previous checkpoint or the new one, never a
mix: the rename is the single commit point for the model, the optimizer slots, the trainer state
(period, step, metrics so far) and the privacy ledger, which are restored together. A `LATEST`
file names the newest checkpoint for people and tools; the trainer itself trusts the directories.
"""
import json
import os
import re
import shutil
import uuid
import warnings

from dprec import atomic_io
from dprec.errors import DprecError

_NAME = re.compile(r"^ckpt-(\d+)$")
LATEST = "LATEST"
STATE = "state.json"
MODEL_PREFIX = "model"


def atomic_copy(src, dst):
  """Copies a small file atomically (used to publish and restore the ledger)."""
  with open(src, "rb") as f:
    atomic_io.write_bytes(dst, f.read())


class CheckpointFallbackWarning(UserWarning):
  """The newest checkpoint did not restore; an older one was used."""


class CheckpointManager:
  """Commits and finds checkpoints in `directory`, keeping the newest `keep` of them (None: all,
  e.g. to evaluate a learning curve afterwards)."""

  def __init__(self, directory, keep=2):
    self.directory = directory
    self.keep = keep
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # half-written checkpoints of a killed process
      if name.startswith(".tmp-"):
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

  def _committed(self):
    numbers = []
    for name in os.listdir(self.directory):
      match = _NAME.match(name)
      if match and os.path.exists(os.path.join(self.directory, name, STATE)):
        numbers.append(int(match.group(1)))
    return sorted(numbers)

  def latest(self):
    """Path of the newest committed checkpoint, or None on a fresh run.

    The directory rename is the commit point, so the highest-numbered `ckpt-<n>` is complete even
    if the process died before it updated the human-facing `LATEST` pointer.
    """
    committed = self._committed()
    return os.path.join(self.directory, f"ckpt-{committed[-1]:06d}") if committed else None

  def restore_newest(self, restore):
    """Restores the newest committed checkpoint that `restore(path)` reads without error and
    returns its path (None: no checkpoint). A newer one that fails (e.g. its `model.data-*`
    truncated by a full disk or an interrupted copy) is skipped with a `CheckpointFallbackWarning`
    naming it and its error; `restore` must then restore everything again from the older one.
    Raises `DprecError` if none restores."""
    failed = []
    for number in reversed(self._committed()):
      path = os.path.join(self.directory, f"ckpt-{number:06d}")
      try:
        restore(path)
      except DprecError:
        raise
      except Exception as error:
        failed.append(f"{path}: {type(error).__name__}: {error}")
        continue
      if failed:
        warnings.warn(f"{'; '.join(failed)}; so resuming from the older checkpoint {path}",
                      CheckpointFallbackWarning, stacklevel=2)
      return path
    if failed:
      raise DprecError(f"no checkpoint in {self.directory} restores ({'; '.join(failed)}); move "
                       "the directory aside to train the run again from step 0 (its ledger "
                       "keeps every charge, and steps it has paid are not paid again)")
    return None

  @staticmethod
  def read_state(path):
    with open(os.path.join(path, STATE), encoding="utf-8") as f:
      return json.load(f)

  def commit(self, state, write_model, files=None):
    """Writes a new checkpoint atomically and returns its path.

    Args:
      state: JSON-serialisable trainer state (data position, metrics, vocabulary sizes, ...).
      write_model: callable(prefix) writing the TensorFlow checkpoint (model + optimizer slots +
        random generator states) under the given file prefix.
      files: {name in checkpoint: source path} of small files to copy in (the ledger).
    """
    committed = self._committed()
    number = committed[-1] + 1 if committed else 0
    tmp = os.path.join(self.directory, f".tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    write_model(os.path.join(tmp, MODEL_PREFIX))
    for name, src in (files or {}).items():
      shutil.copyfile(src, os.path.join(tmp, name))
    with open(os.path.join(tmp, STATE), "w", encoding="utf-8") as f:
      json.dump(state, f, indent=1)
    for name in os.listdir(tmp):
      with open(os.path.join(tmp, name), "rb") as f:
        os.fsync(f.fileno())
    atomic_io.fsync_directory(tmp)
    name = f"ckpt-{number:06d}"
    os.rename(tmp, os.path.join(self.directory, name))
    atomic_io.fsync_directory(self.directory)
    atomic_io.write_text(os.path.join(self.directory, LATEST), name)
    for old in committed[:max(0, len(committed) + 1 - self.keep)] if self.keep else []:
      shutil.rmtree(os.path.join(self.directory, f"ckpt-{old:06d}"), ignore_errors=True)
    return os.path.join(self.directory, name)
