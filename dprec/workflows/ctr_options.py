"""The options of `train ctr` (`CTRTrainOptions`) and the names and defaults its command line
offers, without TensorFlow: `dprec train ctr` parses its arguments (and refuses bad ones) before
it loads `dprec.workflows.ctr`, which trains with them."""
import dataclasses
import math
from typing import Optional, Tuple

from dprec.distribute import cluster
from dprec.errors import DprecError
from dprec.optimizers import defaults as step_defaults
from dprec.privacy import accounting
from dprec.privacy_unit import DEFAULT_MAX_ROWS_PER_USER
from dprec.training import batch_sizes
from dprec.workflows import run as run_lib

ALGORITHMS = step_defaults.ALGORITHMS
FEST_ALGORITHMS = step_defaults.PRESELECTED  # a DP top-k set, drawn before training
STRATEGIES = cluster.STRATEGIES
LOCAL_CLUSTERS = ("multi_worker", "parameter_server")
OPTIMIZER_NAMES = ("sgd", "adagrad", "adam", "adambc", "table_sgd")  # `ctr.OPTIMIZERS`
LOGIT_INITS = ("base_rate", "default")
STEPS_PER_EPOCH = batch_sizes.STEPS_PER_EPOCH  # default B: `ctr.default_batch_size`
BATCH_SIZE_RANGE = batch_sizes.DATA_SIZED_RANGE
# `train ctr` trains in memory up to this many training rows (`--out-of-core-above`), where that
# path is faster and fits: it holds ~365 bytes a row over ~1.3 GB (BENCHMARKS.md, "Out of core"),
# 20M rows ≈ 8.6 GB; above it the rows stay on disk (`dprec.workflows.out_of_core`).
ROWS_IN_MEMORY = 20_000_000
NON_PRIVATE_TABLE_LEARNING_RATE = 0.1  # --optimizer table_sgd without DP: not tuned


# Adam's learning rate without `--learning-rate`. Under DP the noise in Adam's second moment
# shrinks its steps, so private runs want a larger one than non-private runs, which lose at it;
# and Dense 256-256 rather than App. D.1.1's 598×4 (1.1M weights noised every step, 5× the step
# time). Both chosen on validation: the numbers are in docs/experiments/ctr_utility.md.
DEFAULT_LEARNING_RATES = {"private": 1e-2, "non_private": 3e-3}
SELECTION_POINTS = 20  # --select-on-validation: validation log loss this many times a run
PRIVACY_UNITS = ("row", "user")
# --user-sampling at --privacy-unit user: "users" samples users (ULS: a user's rows clipped as
# one), "rows" samples rows of at most k per user and accounts a user as a group (ELS).
USER_SAMPLINGS = ("users", "rows")


@dataclasses.dataclass
class CTRTrainOptions(run_lib.FitOptions):
  """Everything `dprec train ctr` accepts (see `dprec.workflows.ctr_cli` for each field)."""
  NOT_FINGERPRINTED = run_lib.FitOptions.NOT_FINGERPRINTED + (
      "vocab", "log_dir", "eval_batch_size", "strategy", "local_workers", "local_ps",
      "min_shard_rows", "runner", "dask_workers", "beam_options", "out_of_core_above")
  data: str
  strategy: str = "none"
  local_workers: int = 0
  local_ps: int = 0
  min_shard_rows: int = cluster.MIN_ROWS_PER_SHARD
  algorithm: str = "dp_adafest"
  epsilon: Optional[float] = None
  delta: Optional[float] = None
  batch_size: Optional[int] = None  # None: from N (`sized_for`)
  max_batch_size: Optional[int] = None  # B_max: truncated Poisson (`dprec.privacy.truncation`)
  steps: Optional[int] = None  # None: one epoch at the batch size
  ratio: float = step_defaults.ADAFEST_RATIO
  threshold: float = step_defaults.ADAFEST_THRESHOLD
  contribution_clip: float = 1.0
  l2_norm_clip: float = 1.0  # see BENCHMARKS.md "Calibrated DP pCTR"
  learning_rate: Optional[float] = None  # None: `DEFAULT_LEARNING_RATES` (private or not)
  optimizer: str = "adam"
  adambc_floor: float = step_defaults.ADAMBC_FLOOR
  table_learning_rate: Optional[float] = None  # --optimizer table_sgd; None: `table_learning_rate`
  momentum: float = 0.0  # --optimizer table_sgd: on the tables
  logit_init: str = "base_rate"
  base_rate_share: float = 0.01
  calibration_share: float = 0.1
  top_k: Optional[int] = None
  top_k_epsilon: float = 0.1
  vocab: Optional[str] = None
  vocab_min_count: int = 1
  hidden_units: Tuple[int, ...] = (256, 256)
  stack_tables: int = 0  # 0: one variable per table; m: widths rounded up to m, one per width
  eval_batch_size: int = 8192
  log_dir: Optional[str] = None
  out_of_core: bool = False  # Poisson batches written by a Beam job, streamed (`out_of_core`)
  out_of_core_above: int = ROWS_IN_MEMORY  # ... and by default above this many training rows
  runner: Optional[str] = None  # the Beam jobs of --out-of-core (default: embedded)
  dask_workers: Optional[int] = None
  beam_options: Tuple[str, ...] = ()
  select_on_validation: float = 0.0  # non_private: share of training rows for model selection
  privacy_unit: str = "row"  # "user": ε protects all of a user's rows (the `user_id` column)
  max_rows_per_user: Optional[int] = None  # k; None at user level: DEFAULT_MAX_ROWS_PER_USER
  user_sampling: str = "users"  # at user level: USER_SAMPLINGS

  @property
  def private(self):
    return self.algorithm != "non_private"

  @property
  def user_level(self) -> bool:
    return self.privacy_unit == "user"

  @property
  def rows_per_user(self) -> Optional[int]:
    """k at user level (`max_rows_per_user`, else the default); None at row level."""
    if not self.user_level:
      return None
    return self.max_rows_per_user or DEFAULT_MAX_ROWS_PER_USER

  def validate(self):
    super().validate()
    for name, value, allowed in (("algorithm", self.algorithm, ALGORITHMS),
                                 ("strategy", self.strategy, STRATEGIES),
                                 ("optimizer", self.optimizer, OPTIMIZER_NAMES),
                                 ("logit-init", self.logit_init, LOGIT_INITS)):
      if value not in allowed:
        raise DprecError(f"--{name} must be one of {', '.join(allowed)}, got {value}")
    if not self.adambc_floor > 0:
      raise DprecError(f"--adambc-floor must be positive, got {self.adambc_floor}")
    if not 0 < self.base_rate_share < 1:
      raise DprecError(f"--base-rate-share must be in (0, 1), got {self.base_rate_share}")
    if not 0 <= self.calibration_share < 1:
      raise DprecError(f"--calibration-share must be in [0, 1), got {self.calibration_share}")
    if (self.batch_size is not None and self.batch_size < 1) or (
        self.steps is not None and self.steps < 1):
      raise DprecError("--batch-size and --steps must be positive")
    if self.private and (self.epsilon is None or not self.epsilon > 0):
      raise DprecError(f"--algorithm {self.algorithm} needs a positive --epsilon")
    if self.delta is not None and not 0 < self.delta < 1:
      raise DprecError(f"--delta must be in (0, 1), got {self.delta}")
    if self.algorithm in FEST_ALGORITHMS and not (self.top_k or 0) > 0:
      raise DprecError(f"--algorithm {self.algorithm} needs --top-k-total (rows kept over all "
                       "tables)")
    if self.top_k_epsilon < 0:
      raise DprecError("--top-k-epsilon must be >= 0")
    if self.local_workers < 0 or (self.local_workers and self.strategy not in LOCAL_CLUSTERS):
      raise DprecError("--local-workers N (N >= 1) starts a localhost cluster for --strategy "
                       "multi_worker or parameter_server")
    if self.local_ps < 0 or bool(self.local_ps) != (
        self.strategy == "parameter_server" and self.local_workers > 0):
      raise DprecError("--strategy parameter_server --local-workers N needs --local-ps K "
                       "(K >= 1 parameter servers), and --local-ps only goes with them")
    if self.stack_tables < 0:
      raise DprecError(f"--stack-tables must be >= 1 (or absent: off), got {self.stack_tables}")
    if self.min_shard_rows < 1:
      raise DprecError(f"--min-shard-rows must be >= 1, got {self.min_shard_rows}")
    if self.out_of_core_above < 0:
      raise DprecError(f"--out-of-core-above must be >= 0, got {self.out_of_core_above}")
    if self.out_of_core:
      self._validate_out_of_core()
    if self.select_on_validation:
      self._validate_selection()
    if self.algorithm == "dp_sgd_lazy":
      self._validate_lazy_noise()
    self._validate_privacy_unit()
    if self.strategy == "parameter_server" and self.secure_noise:
      raise DprecError("--secure-noise is not available with --strategy parameter_server")
    if (self.strategy == "multi_worker" and self.run_dir is None
        and self.insecure_noise_seed is None):
      raise DprecError("--strategy multi_worker needs --run-dir: the chief keeps the run's secret "
                       "noise key there and the other workers read it (a file system they share)")


  def _validate_privacy_unit(self):
    """--privacy-unit and its options; at user level, what the user-level path (in memory or
    out of core) cannot run yet, each named alone."""
    if self.privacy_unit not in PRIVACY_UNITS:
      raise DprecError(f"--privacy-unit must be one of {', '.join(PRIVACY_UNITS)}, got "
                       f"{self.privacy_unit}")
    if self.user_sampling not in USER_SAMPLINGS:
      raise DprecError(f"--user-sampling must be one of {', '.join(USER_SAMPLINGS)}, got "
                       f"{self.user_sampling}")
    if not self.user_level:
      if self.max_rows_per_user is not None or self.user_sampling != "users":
        raise DprecError("--max-rows-per-user and --user-sampling go with --privacy-unit user")
      return
    if self.max_rows_per_user is not None:
      accounting.check_group_size(self.max_rows_per_user)
    problems = [
        (not self.private, f"--algorithm {self.algorithm}: training without DP protects no "
                           "unit (drop --privacy-unit)"),
        (self.strategy != "none", f"--strategy {self.strategy}: it trains on one device "
                                  "(replicas could split a user's rows)"),
        (self.local_workers > 0, "--local-workers: it trains in this process"),
        (self.fixed_batches, "--fixed-batches: it samples users or rows by Poisson"),
        (self.max_batch_size is not None, "--max-batch-size: its batches are not truncated"),
        (self.algorithm == "dp_sgd_lazy", "--algorithm dp_sgd_lazy: its step clips per row"),
        (self.algorithm in FEST_ALGORITHMS and self.top_k_epsilon > 0,
         f"--algorithm {self.algorithm} with --top-k-epsilon {self.top_k_epsilon:g}: its DP "
         "top-k counts every row of a user (give --top-k-epsilon 0: the counts treated as "
         "public)")]
    refused = [reason for bad, reason in problems if bad]
    if refused:
      raise DprecError("--privacy-unit user cannot run with " + "; ".join(refused))

  def _validate_lazy_noise(self):
    """What lazy noise cannot run with, each named alone (as `dp_step`'s refusal, but before the
    ledger is paid)."""
    problems = [
        (self.strategy != "none", f"--strategy {self.strategy}: it runs on one device (drop "
                                  "--strategy)"),
        (self.secure_noise, "--secure-noise: it draws the default noise (drop --secure-noise)"),
        (self.optimizer not in ("sgd", "table_sgd"),
         f"--optimizer {self.optimizer}: it needs SGD on the tables (--optimizer table_sgd or "
         "sgd)")]
    refused = [reason for bad, reason in problems if bad]
    if refused:
      raise DprecError("--algorithm dp_sgd_lazy cannot run with " + "; ".join(refused))

  def _validate_selection(self):
    """--select-on-validation: a non-private run on one device, in memory, without a run
    directory (a resumed run would not know the best step so far)."""
    if not 0 < self.select_on_validation < 1:
      raise DprecError("--select-on-validation must be in (0, 1), got "
                       f"{self.select_on_validation}")
    if self.private or self.run_dir or self.out_of_core or self.strategy != "none":
      raise DprecError("--select-on-validation (model selection on held-out training rows, read "
                       "exactly) is for --algorithm non_private on one device, in memory, "
                       "without --run-dir")

  def _validate_out_of_core(self):
    """What --out-of-core does not do yet (docs/guide/train_ctr.md, 'Data larger than memory')."""
    if self.strategy not in ("none", "parameter_server"):
      raise DprecError("--out-of-core trains on one device or with --strategy parameter_server "
                       "(the chief reads the shards)")
    if self.fixed_batches:
      raise DprecError("--out-of-core writes Poisson batches: drop --fixed-batches")
    if self.vocab:
      raise DprecError("--out-of-core builds the vocabulary in its Beam job: drop --vocab, or "
                       "give --data a `dprec preprocess criteo` output")


NON_PRIVATE = "non_private"  # the --algorithm of training without DP


def algorithm_help(default):
  """The help of `--algorithm` (parsed to None: `algorithm_and_epsilon` resolves it)."""
  return (f"training algorithm; {NON_PRIVATE} is --epsilon inf, training without DP "
          f"(default: {default})")


def algorithm_and_epsilon(algorithm, epsilon, default):
  """(algorithm, ε) of `--algorithm` (None: not given) and `--epsilon`, one choice under two
  names: `--epsilon inf` is `--algorithm non_private` (ε None), given alone or with it; a finite
  ε with `non_private`, or `inf` with a DP algorithm, is refused as contradictory."""
  infinite = epsilon is not None and math.isinf(epsilon)
  if algorithm == NON_PRIVATE and epsilon is not None and not infinite:
    raise DprecError(f"--algorithm {NON_PRIVATE} trains without DP and spends no ε: drop "
                     f"--epsilon {epsilon:g}, or choose a DP --algorithm")
  if infinite and algorithm not in (None, NON_PRIVATE):
    raise DprecError(f"--epsilon inf trains without DP (as --algorithm {NON_PRIVATE}): give a "
                     f"finite --epsilon for --algorithm {algorithm}, or drop --algorithm")
  if infinite:
    return NON_PRIVATE, None
  return algorithm or default, epsilon
