"""What the `dprec` command holds back unless `--verbose`: the libraries' own logs (TensorFlow's
native start-up log, Beam's and Dask's Python logs, Beam workers' output). dprec reports on stdout
and stderr itself, and replays what was held back when the block it was held for fails."""
import contextlib
import logging
import os
import sys
import tempfile

QUIET = False  # set by `hold_library_logs`; `held_stderr_if_quiet` reads it


def hold_library_logs():
  """Sets the libraries' log levels (a user's own setting of these variables wins): TensorFlow's
  native log, Python logging below ERROR (Beam's, absl's), Dask's (here and in its workers)."""
  global QUIET  # pylint: disable=global-statement
  QUIET = True
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
  logging.getLogger().setLevel(logging.ERROR)


@contextlib.contextmanager
def held_stderr():
  """Sends file descriptor 2 (this process's and its children's stderr, native writes too) to a
  temporary file for the block; replays it if the block raises (not on Ctrl-C: the libraries'
  shutdown noise is no report of what went wrong)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    except KeyboardInterrupt:
      raise
    except BaseException:
      sys.stderr.flush()
      os.dup2(saved, 2)
      held.seek(0)
      sys.stderr.write(held.read().decode(errors="replace"))
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


def held_stderr_if_quiet():
  """`held_stderr()` under `hold_library_logs`, else nothing held."""
  return held_stderr() if QUIET else contextlib.nullcontext()
