"""Crash-safe local file writes: write a temporary file beside the target, fsync, rename.

A reader (or a process restarted after `kill -9`) sees the old content or the new one, never a
torn file. Temporaries are named `<target>.<random>.tmp`; `remove_stale_temporaries` clears those
left by a writer killed before its rename. `locked` serialises read-modify-write cycles of
several processes on one file (`<target>.lock`, an advisory `flock`, released when the holder
exits, even by `kill -9`). (Beam jobs write through Beam's `FileSystems`
instead, so that they also work on cloud storage: see `pipelines.beam_io`.)
"""
import contextlib
import fcntl
import glob
import json
import math
import os
import tempfile


def fsync_directory(directory):
  """Makes a rename or a new entry in `directory` durable."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def make_parent(path):
  """Creates the directory `path` goes in (and its parents) if missing; returns it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  return directory


def write_bytes(path, data):
  """Replaces `path` with `data` atomically and durably (file and directory fsynced); creates
  its directory if missing."""
  directory = make_parent(path)
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  fsync_directory(directory)


def write_text(path, text):
  write_bytes(path, text.encode("utf-8"))


def strict(value):
  """`value` with every number that is not finite (ε = ∞ of a non-private run, a NaN loss) as
  None: JSON has no such numbers, and dprec writes strict JSON (null)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {key: strict(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict(item) for item in value]
  return value


def dumps(value, **kwargs) -> str:
  """`json.dumps` of `strict(value)`: strict JSON (`allow_nan=False`)."""
  return json.dumps(strict(value), allow_nan=False, **kwargs)


def write_json(path, value, sort_keys=False):
  write_text(path, dumps(value, indent=2, sort_keys=sort_keys) + "\n")


def remove_stale_temporaries(path):
  """Deletes temporaries of `path` left by writers killed before their rename."""
  for stale in glob.glob(glob.escape(path) + ".*.tmp"):
    os.unlink(stale)


def lock(path, wait=True):
  """An open handle holding the exclusive lock `<path>.lock` (close it to release); with
  `wait=False`, None if another process holds it. Creates `path`'s directory if missing."""
  make_parent(path)
  handle = open(path + ".lock", "a", encoding="utf-8")
  try:
    fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.close()
    return None
  return handle


@contextlib.contextmanager
def locked(path):
  """Holds the exclusive lock `<path>.lock` for the block (waits for other holders)."""
  handle = lock(path)
  try:
    yield
  finally:
    handle.close()
