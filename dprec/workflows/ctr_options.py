"""The options of `train ctr` (`CTRTrainOptions`) and the names and defaults its command line
offers, without TensorFlow: `dprec train ctr` parses its arguments (and refuses bad ones) before
it loads `dprec.workflows.ctr`, which trains with them."""
import argparse
import dataclasses
import math
from typing import Optional, Tuple

from dprec.cli_help import option
from dprec.distribute import cluster
from dprec.errors import DprecError
from dprec.optimizers import defaults as step_defaults
from dprec.privacy import accounting
from dprec.privacy_unit import DEFAULT_MAX_ROWS_PER_USER
from dprec.privacy_unit import PRIVACY_UNITS
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
# --user-sampling at --privacy-unit user: "users" samples users (ULS: a user's rows clipped as
# one), "rows" samples rows of at most k per user and accounts a user as a group (ELS).
USER_SAMPLINGS = ("users", "rows")


NON_PRIVATE = "non_private"  # the --algorithm of training without DP


def algorithm_help(default):
  """The help of `--algorithm` (parsed to None: `algorithm_and_epsilon` resolves it)."""
  return (f"training algorithm; {NON_PRIVATE} is --epsilon inf, training without DP "
          f"(default: {default})")


def int_list(text):
  """argparse type of `--hidden-units`: comma-separated positive widths."""
  try:
    values = tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
  return values


# Help texts that name the ledger and run directory only where the command keeps them
# (`run_directory`: `train ctr`, not `dprec audit`).
def _epsilon_help(run_directory):
  return "privacy budget ε, the total" + (
      ": what --ledger spent on this data before (e.g. a DP top-k vocabulary) is composed in"
      if run_directory else "") + " (required unless non_private); 'inf': --algorithm non_private"


def _delta_help(run_directory):
  return "δ (default: " + ("the --ledger's if it exists, else " if run_directory else "") + (
      "1/N, N = training rows; 1/U, U = training users, at --privacy-unit user)")


def _strategy_help(run_directory):
  return ("tf.distribute strategy: none (one device), mirrored (this machine's devices), "
          "multi_worker (the cluster in TF_CONFIG, one process per worker, worker 0 the chief" + (
              "; needs --run-dir on a file system all workers share, holding the secret noise "
              "key" if run_directory else "") + "), parameter_server (TF_CONFIG's chief, workers "
          "and ps: tables sharded by rows over the ps, steps scheduled by the chief; worker and "
          "ps tasks serve until stopped): docs/guide/train_ctr.md, 'Distributed training'")


_LOWEST, _HIGHEST = BATCH_SIZE_RANGE
DEFAULT_ALGORITHM = "dp_adafest"
HIDDEN_UNITS = (256, 256)
GHAZI = "Ghazi et al. 2023, arXiv:2311.08357"  # the paper of DP-FEST and DP-AdaFEST
STACK_MULTIPLE = 8  # `--stack-tables` without M: Table 3's 20 widths in 5 stacks
# Options kept only with a run directory: not `dprec audit`'s (`ctr_cli.add_options`).
RUN_DIRECTORY_ONLY = ("eval_batch_size", "log_dir")


@dataclasses.dataclass
class CTRTrainOptions(run_lib.FitOptions):
  """Everything `dprec train ctr` accepts; each field made by `cli_help.option` is also its
  command-line option (`ctr_cli.add_options`), listed in field order. Help shows their defaults
  ("(default ..."); where a field's default is None, its help says what None does."""
  NOT_FINGERPRINTED = run_lib.FitOptions.NOT_FINGERPRINTED + (
      "vocab", "log_dir", "eval_batch_size", "strategy", "local_workers", "local_ps",
      "min_shard_rows", "runner", "dask_workers", "beam_options", "out_of_core_above")
  data: str = option(
      group="data", required=True,
      help="directory of Criteo TSV day_N files, or a Beam output dir")
  vocab: Optional[str] = option(
      None, group="data", advanced=True,
      help="directory of a saved (public) CriteoVocabulary instead of building one")
  vocab_min_count: int = option(1, group="data", advanced=True,
                                help="min count of an id kept in the vocabulary")
  # Poisson batches written by a Beam job, streamed (`out_of_core`) ...
  out_of_core: bool = option(
      False, group="data", action="store_true",
      help="for more rows than memory holds: a Beam job writes the run's Poisson batches (one "
           "shard per step, drawn from the run's key) and training streams them; the base rate, "
           "calibration and evaluation are streaming passes (memory grows with B and the model, "
           "not with N; slower): docs/guide/train_ctr.md, 'Data larger than memory'. Without "
           "it, runs above --out-of-core-above rows train out of core")
  # ... and by default above this many training rows
  out_of_core_above: int = option(
      ROWS_IN_MEMORY, group="data", metavar="ROWS", advanced=True,
      help="train out of core when the training rows (the manifest's count, or TSV bytes / 240) "
           "exceed ROWS and the options allow it (default %(default)s: ~8.6 GB in memory)")
  runner: Optional[str] = option(
      None, group="data", advanced=True,
      help="out of core: the Beam runner of its jobs (default: embedded; DaskRunner, "
           "DataflowRunner, ...)")
  dask_workers: Optional[int] = option(
      None, group="data", metavar="N", advanced=True,
      help="out of core with --runner DaskRunner: the local Dask cluster's worker processes")
  beam_options: Tuple[str, ...] = option(
      (), group="data", flag="--beam-option", action="append", metavar="NAME=VALUE",
      advanced=True,
      help="out of core: another Beam pipeline option (e.g. dask_client_address=HOST:PORT); "
           "repeatable")

  algorithm: str = option(  # parsed None: `algorithm_and_epsilon` resolves it with --epsilon
      DEFAULT_ALGORITHM, group="privacy", choices=ALGORITHMS, parsed_default=None,
      help=algorithm_help(DEFAULT_ALGORITHM))
  epsilon: Optional[float] = option(None, group="privacy", help=_epsilon_help)
  delta: Optional[float] = option(None, group="privacy", help=_delta_help)
  # "user": ε protects all of a user's rows (the `user_id` column)
  privacy_unit: str = option(
      "row", group="privacy", choices=PRIVACY_UNITS,
      help="what ε protects: a row, or a user (all rows with one user_id: the day files' 41st "
           "field, as `dprec synth criteo --users N` writes; a user-level ledger, δ 1/U; in "
           "memory, on one device): docs/guide/train_ctr.md, 'The privacy unit' (default: "
           "%(default)s)")
  max_rows_per_user: Optional[int] = option(  # k; None at user level: DEFAULT_MAX_ROWS_PER_USER
      None, group="privacy", metavar="K",
      help="--privacy-unit user: k, the most rows of a user a step or a release reads (drawn by "
           "the run's key; public, never read off the data) "
           f"(default: {DEFAULT_MAX_ROWS_PER_USER})")
  user_sampling: str = option(  # at user level: USER_SAMPLINGS
      "users", group="privacy", choices=USER_SAMPLINGS,
      help="--privacy-unit user: users (each step Poisson-samples users at q = B / U, each "
           "sampled user's at most K rows clipped as one: the sampled Gaussian over users) or "
           "rows (the baseline: each user's rows cut once to at most K, rows Poisson-sampled as "
           "at the row level, ε converted for a group of K rows) (default: %(default)s)")
  top_k: Optional[int] = option(
      None, group="privacy", flag="--top-k-total", metavar="K", deprecated=("--top-k",),
      help="DP-FEST / DP-AdaFEST+: rows kept over all tables, K/F per table of the F tables (no "
           "default: required by dp_fest and dp_adafest_plus)")
  top_k_epsilon: float = option(
      0.1, group="privacy",
      help="pure ε of the DP top-k (Gumbel) selection, deducted from --epsilon; 0 = treat the "
           "training counts as public")
  # The DP step (`dprec stream`'s too).
  l2_norm_clip: float = option(  # see BENCHMARKS.md "Calibrated DP pCTR"
      1.0, group="privacy",
      help="per-example gradient clip C2 (small clips, e.g. 1, clip nearly every example: the "
           "best AUC, with logits at the label median, which --calibration-share recalibrates)")
  ratio: float = option(step_defaults.ADAFEST_RATIO, group="privacy", advanced=True,
                        help="DP-AdaFEST noise ratio r = σ1/σ2")
  threshold: float = option(step_defaults.ADAFEST_THRESHOLD, group="privacy", advanced=True,
                            help="DP-AdaFEST threshold τ on noisy counts")
  contribution_clip: float = option(1.0, group="privacy", advanced=True,
                                    help="DP-AdaFEST contribution clip C1")
  learning_rate: Optional[float] = option(  # None: `DEFAULT_LEARNING_RATES` (private or not)
      None, group="training",
      help="learning rate (default: " + ", ".join(
          f"{rate:g} {run}" for run, rate in DEFAULT_LEARNING_RATES.items())
      + "; for --optimizer adam)")
  optimizer: str = option(
      "adam", group="training", choices=sorted(OPTIMIZER_NAMES), advanced=True,
      help="row-sparse optimizer applying the noisy gradient (adam = lazy Adam; adambc = "
           "DP-AdamBC: Adam with the noise variance subtracted, Tang et al. 2024, "
           "arXiv:2411.04205)")
  adambc_floor: float = option(
      step_defaults.ADAMBC_FLOOR, group="training", advanced=True,
      help="γ' of --optimizer adambc: floor of the corrected second moment")

  max_batch_size: Optional[int] = option(  # B_max: truncated Poisson (`dprec.privacy.truncation`)
      None, group="privacy", metavar="B_MAX", advanced=True,
      help="truncate each Poisson batch to B_MAX rows (default: none, exact Poisson): a fixed "
           "upper bound on a step's memory, paid for as δ (the chance any step's batch exceeds "
           "it, times 1 + e^ε: Chua et al. 2024), taken from training's δ and shown in the "
           "summary's truncation_delta; refused where it would cost over a tenth of δ")
  base_rate_share: float = option(
      0.01, group="privacy", advanced=True,
      help="share of --epsilon the DP base rate is calibrated for (composed with training in "
           "the accountant, so it costs training far less)")
  calibration_share: float = option(
      0.1, group="privacy", advanced=True,
      help="share of --epsilon for recalibrating the logits after training (DP Platt scaling on "
           "the training data, dprec.privacy.dp_platt_scaling, composed with training in the "
           "accountant, so it costs training far less); 0: none")

  hidden_units: Tuple[int, ...] = option(
      HIDDEN_UNITS, group="model", type=int_list,
      help="comma-separated Dense(relu) widths (default: " + ",".join(map(str, HIDDEN_UNITS))
      + f"; the paper's model ({GHAZI}, App. D.1.1) has 598,598,598,598, which trains worse "
      "under DP: docs/experiments/ctr_utility.md)")
  logit_init: str = option(
      "base_rate", group="model", choices=LOGIT_INITS, advanced=True,
      help="base_rate: the logit layer starts at zero weights and the bias at the logit of the "
           "training click rate (DP: a Gaussian estimate charged to the ledger), so the "
           "untrained model predicts the base rate; default: Keras' Glorot init (p ≈ 0.5)")
  # 0: one variable per table; m: widths rounded up to m, one per width
  stack_tables: int = option(
      0, group="model", nargs="?", const=STACK_MULTIPLE, metavar="M", advanced=True,
      help=f"hold the tables whose widths round up to the same multiple of M in one variable (M "
           f"alone: {STACK_MULTIPLE}; 1: exact widths): the same model and DP step (same key, "
           f"same noise), with the step's per-table work done once per stack "
           f"(docs/experiments/dp_step_time.md, 'Stacked tables'). Costs: the padding columns "
           f"(never read nor updated) are stored, in the model and in every optimizer slot (M = "
           f"8: +14%% embedding parameters at the Criteo vocabularies of {GHAZI}, Table 3, +5%% "
           f"at 10M rows), and checkpoints hold one variable per stack, so a run resumes only "
           f"with the same setting. Default: off (one variable per table)")

  batch_size: Optional[int] = option(  # None: from N (`sized_for`)
      None, group="training",
      help=f"expected (Poisson) batch size B (default: from the N training rows, the power of "
           f"two nearest N/{STEPS_PER_EPOCH}, an epoch in about {STEPS_PER_EPOCH} steps, within "
           f"[{_LOWEST}, {_HIGHEST}], at most N/8; --user-sampling users: expected users per "
           f"batch, --user-sampling rows' B on the same data, at most U/8)")
  steps: Optional[int] = option(  # None: one epoch at the batch size
      None, group="training",
      help="training steps T (default: one epoch, ⌈N/B⌉; --user-sampling users: one epoch of "
           "the users or, if more, --user-sampling rows' T on the same data)")
  table_learning_rate: Optional[float] = option(  # None: `table_learning_rate`
      None, group="training", advanced=True,
      help="--optimizer table_sgd (SGD on the embedding tables, lazy Adam at --learning-rate on "
           "the dense layers): the tables' learning rate (default: B·(1 − momentum)/(80·C2) for "
           "a private run, the best on validation at 400k and 5M rows; "
           f"{NON_PRIVATE_TABLE_LEARNING_RATE:g} without DP)")
  momentum: float = option(0.0, group="training", advanced=True,
                           help="--optimizer table_sgd: the tables' momentum (0: plain SGD)")
  select_on_validation: float = option(  # non_private: share of training rows for selection
      0.0, group="training", metavar="SHARE", advanced=True,
      help="--algorithm non_private: hold out this share of the training rows (the end of the "
           "last training day) and keep the weights of the best validation log loss, measured "
           f"{SELECTION_POINTS} times a run (early stopping's choice; never on the evaluation "
           "day); default: off")
  strategy: str = option("none", group="training", choices=STRATEGIES, help=_strategy_help)
  local_workers: int = option(
      0, group="training", metavar="N", advanced=True,
      help="with --strategy multi_worker: start N worker processes on localhost (their TF_CONFIG "
           "made up) and print the chief's summary; with parameter_server: N workers (and "
           "--local-ps K servers) in this process, the chief; 0: the cluster of TF_CONFIG")
  local_ps: int = option(
      0, group="training", metavar="K", advanced=True,
      help="with --strategy parameter_server --local-workers N: K parameter servers")
  min_shard_rows: int = option(
      cluster.MIN_ROWS_PER_SHARD, group="training", metavar="ROWS", advanced=True,
      help="with --strategy parameter_server: a table is split by rows over up to all parameter "
           "servers, each shard at least ROWS rows (smaller tables and dense layers stay whole)")
  eval_batch_size: int = option(8192, group="training", advanced=True,
                                help="batch size of the evaluation")
  log_dir: Optional[str] = option(
      None, group="run", help="TensorBoard directory (loss, AUC, ε, gradient size)")

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
