"""What dprec holds back of the libraries' own logs.

The `dprec` command, unless `--verbose`: TensorFlow's native start-up log, Beam's and Dask's
Python logs, Beam workers' output (`hold_library_logs`); dprec reports on stdout and stderr
itself, and replays what was held back when the block it was held for fails.

`import dprec` (the library): TensorFlow's start-up noise only (`quiet_tensorflow_start_up`):
its INFO log, and the start-up lines TensorFlow writes before its log level is read (they come
twice, once per native library it loads) and CUDA's `failed call to cuInit` on a machine without
an NVIDIA driver. Its warnings and errors, and every other line, still show.
"""
import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import tempfile

QUIET = False  # set by `hold_library_logs`; `held_stderr_if_quiet` reads it
TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
_SET_BY_DPREC = None  # the TF_LOG_LEVEL dprec set (a user's own setting wins)


def _set_tf_log_level(level: str):
  """Sets TensorFlow's native log level unless the user set it."""
  global _SET_BY_DPREC
  if os.environ.get(TF_LOG_LEVEL) in (None, _SET_BY_DPREC):
    os.environ[TF_LOG_LEVEL] = _SET_BY_DPREC = level


def hold_library_logs():
  """Sets the libraries' log levels (a user's own setting of these variables wins): TensorFlow's
  native log, Python logging below ERROR (Beam's, absl's), Dask's (here and in its workers)."""
  global QUIET
  QUIET = True
  _set_tf_log_level("3")
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


# TensorFlow's start-up lines that are noise: absl's notice before its log is initialised, INFO
# lines (CPU features, oneDNN, "Could not find cuda drivers") and the CPU-features continuation.
START_UP_NOISE = re.compile(r"(WARNING: All log messages before absl::InitializeLog\(\)"
                            r"|I\d{4} |To enable the following instructions:)")
NO_GPU_NOISE = "failed call to cuInit"  # CUDA probing, noise where no NVIDIA driver is loaded
NVIDIA_DRIVER = "/proc/driver/nvidia"


def start_up_lines_to_show(text: str) -> str:
  """The lines of TensorFlow's start-up stderr `text` that are not start-up noise."""
  no_gpu = not os.path.exists(NVIDIA_DRIVER)
  return "".join(line for line in text.splitlines(keepends=True)
                 if not START_UP_NOISE.match(line) and not (no_gpu and NO_GPU_NOISE in line))


@contextlib.contextmanager
def filtered_stderr():
  """`held_stderr`, then replays the held lines that are not start-up noise (all if the block
  raises)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    failed = True
    try:
      yield
      failed = False
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = held.read().decode(errors="replace")
      sys.stderr.write(text if failed else start_up_lines_to_show(text))
      sys.stderr.flush()


class _QuietLoader(importlib.abc.Loader):
  """TensorFlow's own loader, executing the module (and probing its devices, which is when CUDA
  is initialised) under `filtered_stderr`."""

  def __init__(self, loader):
    self.loader = loader

  def __getattr__(self, name):
    return getattr(self.loader, name)

  def create_module(self, spec):
    return self.loader.create_module(spec)

  def exec_module(self, module):
    with filtered_stderr():
      self.loader.exec_module(module)
      module.config.list_physical_devices()


class _QuietTensorFlowFinder(importlib.abc.MetaPathFinder):
  """Finds `tensorflow` once, the first time it is imported, with `_QuietLoader`."""

  def find_spec(self, fullname, path, target=None):
    if fullname != "tensorflow":
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


def quiet_tensorflow_start_up():
  """On `import dprec`: TensorFlow's INFO log off (`TF_CPP_MIN_LOG_LEVEL=1`, unless the user set
  it) and, if TensorFlow is not imported yet, its import filtered (`filtered_stderr`)."""
  _set_tf_log_level("1")
  if "tensorflow" not in sys.modules and not any(
      isinstance(finder, _QuietTensorFlowFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _QuietTensorFlowFinder())
