"""The options of `dprec stream` (`StreamOptions`) and the names and defaults its command line
offers, without TensorFlow: `dprec stream` parses its arguments (and refuses bad ones) before it
loads `dprec.workflows.stream`, which trains with them. The model and step are `train ctr`'s,
defaults included (`CTRTrainOptions`), but for `STEP_OVERRIDES` and the batch size."""
import dataclasses
from typing import Optional, Tuple

from dprec.cli_help import option
from dprec.cli_help import same_option
from dprec.errors import DprecError
from dprec.privacy import recalibration
from dprec.training.batch_sizes import DEFAULT_BATCH_SIZE
from dprec.workflows import ctr_options
from dprec.workflows import run as run_lib
from dprec.workflows.ctr_options import CTRTrainOptions

# `train ctr`'s options that shape the streamed model and its step.
MODEL_FIELDS = ("algorithm", "l2_norm_clip", "ratio", "threshold", "contribution_clip",
                "learning_rate", "optimizer", "adambc_floor", "hidden_units", "seed",
                "logit_init", "secure_noise")
REFERENCES = ("non_private",)
REFERENCE_DIR = "reference_non_private"
_CTR = CTRTrainOptions  # the defaults the stream shares with `train ctr`
# Where the stream's step differs from `train ctr`'s, measured on streams one lever at a time,
# three draws each (docs/experiments/stream_parity.md). σ is calibrated for one short period,
# so at `train ctr`'s C2 = 1 nearly every example is clipped and the first periods rank near
# chance (7 periods of 25k rows, ε = 1: AUC 0.499–0.525 after period 1 in six draws, 0.564–0.582
# at C2 = 10; the last period's AUC the same). `train ctr`'s r = 2 with τ = 7 stay: on Table 3's
# vocabularies (5 periods of 50k rows) they beat r = 5 with τ = 1 (0.685 ± 0.002 against 0.677
# ± 0.003) and shrink the gradient 340–400× instead of 2.3×; on the 88 rows of all the tables
# of the 25k-row periods they cost 0.012 (0.661 ± 0.019 in nine draws, 0.673 ± 0.004 in three).
STEP_OVERRIDES = {"l2_norm_clip": 10.0}


@dataclasses.dataclass
class StreamOptions(run_lib.RunOptions):
  """Everything `dprec stream` accepts; each field made by `cli_help.option` is also its
  command-line option (`stream_cli`), listed in field order."""
  data: str = option(group="data", required=True,
                     help="output directory of `dprec preprocess criteo [--streaming]`")
  run_dir: str = dataclasses.field(default="stream_run", kw_only=True)
  period_days: int = option(
      1, group="data",
      help="days per training period (the streaming experiments of Ghazi et al. 2023, "
           "arXiv:2311.08357, Table 5: 1, 2, 4, 8, 16, 18)")
  train_days: Optional[int] = option(
      None, group="data", help="train on the first D days; later days are the final hold-out")
  idle_timeout: float = option(
      0.0, group="data",
      help="seconds to wait for the next period before finishing (default %(default)s)")
  poll_interval: float = option(
      1.0, group="data", flag="--poll-seconds", deprecated=("--poll-interval",), advanced=True,
      help="seconds between looks for a new period while waiting")

  algorithm: str = option(  # parsed None: `algorithm_and_epsilon` resolves it with --epsilon
      ctr_options.DEFAULT_ALGORITHM, group="privacy", choices=ctr_options.ALGORITHMS,
      parsed_default=None, help=ctr_options.algorithm_help(ctr_options.DEFAULT_ALGORITHM))
  epsilon_total: Optional[float] = option(
      None, group="privacy", flag="--epsilon", deprecated=("--epsilon-total",),
      help="privacy budget ε of the whole run, the total: what --ledger spent on this data "
           "before is composed in (required unless non_private); 'inf': --algorithm non_private")
  delta: Optional[float] = option(
      None, group="privacy",
      help="δ of the run (default: the ledger's if it exists, else 1 / expected examples over "
           "all periods)")
  privacy_unit: str = option(
      "row", group="privacy", choices=ctr_options.PRIVACY_UNITS,
      help="what ε protects: a row (each lives in one period: the periods compose in parallel, "
           "ε is the costliest period's plus the DP top-k refreshes) or a user (the records' "
           "user_id; each step Poisson-samples users at q = B / U, U the first period's users, "
           "each sampled user's rows clipped as one; periods compose sequentially, in a "
           "user-level ledger)")
  max_rows_per_user: Optional[int] = option(  # privacy unit "user": None is 16 (`user_sampling`)
      None, group="privacy",
      help="--privacy-unit user: k, the most rows a sampled user brings to a step (drawn afresh "
           "each step by the run's key) and a user's rows in each DP base rate and DP Platt "
           "scaling (default 16; public, bounds work not ε)")
  top_k: Optional[int] = option(
      None, group="privacy", flag="--top-k-per-feature", metavar="K", deprecated=("--top-k",),
      help="DP-FEST / DP-AdaFEST+: rows kept per feature's table, refreshed every period (no "
           "default: required by dp_fest and dp_adafest_plus)")
  top_k_epsilon: float = option(
      0.1, group="privacy",
      help="total pure ε of the per-period DP top-k refreshes; 0 treats the counts as public")
  expected_periods: Optional[int] = option(
      None, group="privacy", advanced=True,
      help="periods the budget must last (default: training periods of --train-days)")
  examples_per_period: Optional[int] = option(
      None, group="privacy", advanced=True,
      help="expected examples per period; sets q = B / N (default: the first period's; row unit "
           "only: a user-level q uses the first period's users)")
  noise_multiplier: Optional[float] = option(
      None, group="privacy", advanced=True,
      help="use this σ instead of calibrating it (the run stops at the budget)")
  base_rate_share: float = option(
      _CTR.base_rate_share, group="privacy", advanced=True,
      help="share of ε for the DP click rate of the first period (the logit layer's starting "
           "bias, DP Platt scaling's prior)")
  calibration_share: float = option(
      _CTR.calibration_share, group="privacy", advanced=True,
      help="share of ε for DP Platt scaling after each period, on its rows (row unit: of every "
           "period; user unit: over all periods); 0: none")
  # DP Platt scaling (`CTRPeriodModel.after_training`) as `train ctr` fits it: L = 10 and n0 =
  # 10,000 rows of prior on the affine, no level prior (n1 = 0). Centred on logit(base rate),
  # which at L = 10 moves the clip window by ~1. The stream's L = 1 and n1 = 100,000 suited App.
  # D.1.1's tower at 3e-3 (narrow logits: docs/experiments/streaming.md); on `train ctr`'s
  # tower they clip most logits and the affine extrapolates: log loss up to 0.6 above the base
  # rate's at C2 = 1 (docs/experiments/stream_parity.md).
  calibration_logit_bound: float = option(
      recalibration.LOGIT_BOUND, group="privacy", advanced=True,
      help="DP Platt scaling fits on z − logit(base rate) clipped to ± this (default "
           "%(default)s)")
  calibration_prior_examples: float = option(
      recalibration.PRIOR_EXAMPLES, group="privacy", advanced=True,
      help="DP Platt scaling's prior on the affine: worth this many rows that predict the base "
           "rate (`train ctr`'s; default %(default)s)")
  calibration_level_prior_examples: float = option(
      0.0, group="privacy", advanced=True,
      help="DP Platt scaling's prior on the level only (the logit at the mean): worth this many "
           "rows at the base rate; the fit serves the next period, after the click rate moved "
           "(default %(default)s; 0: none)")
  # The model and step are `train ctr`'s (one source: `CTRTrainOptions`; the learning rate its
  # private or non-private default) but for `STEP_OVERRIDES` and the batch (`default_batch_size`).
  l2_norm_clip: float = same_option(_CTR, "l2_norm_clip", STEP_OVERRIDES["l2_norm_clip"])
  ratio: float = same_option(_CTR, "ratio")
  threshold: float = same_option(_CTR, "threshold")
  contribution_clip: float = same_option(_CTR, "contribution_clip")
  learning_rate: Optional[float] = same_option(_CTR, "learning_rate")  # None: its default rates
  optimizer: str = same_option(  # table_sgd: `train ctr`'s only
      _CTR, "optimizer",
      choices=[name for name in sorted(ctr_options.OPTIMIZER_NAMES) if name != "table_sgd"])
  adambc_floor: float = same_option(_CTR, "adambc_floor")
  hidden_units: Tuple[int, ...] = option(
      _CTR.hidden_units, group="model", type=ctr_options.int_list,
      help="comma-separated Dense(relu) widths (default: " + ",".join(map(str, _CTR.hidden_units))
      + ", train ctr's)")
  logit_init: str = option(
      _CTR.logit_init, group="model", choices=ctr_options.LOGIT_INITS, advanced=True,
      help="base_rate: the logit layer starts at the first period's (DP) click rate; default: "
           "Keras' initialisation")
  headroom: float = option(
      1.5, group="model", advanced=True,
      help="spare table rows for new ids, as a factor (default %(default)s)")
  reference: Optional[str] = option(
      None, group="model", choices=REFERENCES, advanced=True,
      help=f"also train a non-private stream on the same periods (RUN/{REFERENCE_DIR}), shown in "
           "the plot and the summary")

  batch_size: Optional[int] = option(  # None: `default_batch_size` of the period size
      None, group="training",
      help=f"expected (Poisson) batch size (default: {DEFAULT_BATCH_SIZE}, at most an eighth of "
           "the expected period size; not train ctr's N/150; --privacy-unit user: expected users "
           "per batch, by the same rule on users)")
  epochs_per_period: float = option(
      1.0, group="training",
      help="expected passes over a period's data (steps = epochs · N / B)")

  @property
  def private(self):
    return self.algorithm != "non_private"

  def validate(self):
    super().validate()
    if self.private and not (self.epsilon_total or 0) > 0:
      raise DprecError(f"--algorithm {self.algorithm} needs a positive --epsilon")
    if self.algorithm in ctr_options.FEST_ALGORITHMS and not (self.top_k or 0) > 0:
      raise DprecError(f"--algorithm {self.algorithm} needs --top-k-per-feature (rows per table)")
    if self.period_days < 1 or (self.train_days is not None and self.train_days < 1):
      raise DprecError("--period-days and --train-days must be positive")
    if self.expected_periods is None and self.train_days is None and self.idle_timeout > 0:
      raise DprecError("a live stream (--idle-timeout > 0) needs --expected-periods (or "
                       "--train-days) so the budget can be planned")
    if self.privacy_unit not in ctr_options.PRIVACY_UNITS:
      raise DprecError(f"--privacy-unit must be one of {', '.join(ctr_options.PRIVACY_UNITS)}, "
                       f"got {self.privacy_unit}")
    if self.max_rows_per_user is not None and (self.privacy_unit != "user"
                                               or self.max_rows_per_user < 1):
      raise DprecError("--max-rows-per-user N (N >= 1) goes with --privacy-unit user")
    if (self.privacy_unit == "user" and self.algorithm in ctr_options.FEST_ALGORITHMS
        and self.top_k_epsilon > 0):
      raise DprecError("--privacy-unit user cannot refresh a DP top-k set: the running counts "
                       "behind it count every row of a user; use --top-k-epsilon 0 (counts "
                       "public) or --algorithm dp_adafest")
    if self.reference not in (None,) + REFERENCES:
      raise DprecError(f"--reference must be one of {', '.join(REFERENCES)}, got "
                       f"{self.reference}")
    if self.batch_size is not None and self.batch_size < 1:
      raise DprecError(f"--batch-size must be positive, got {self.batch_size}")
    if self.logit_init not in ctr_options.LOGIT_INITS:
      raise DprecError(f"--logit-init must be one of {', '.join(ctr_options.LOGIT_INITS)}")
    if not 0 < self.base_rate_share < 1 or not 0 <= self.calibration_share < 1:
      raise DprecError("--base-rate-share must be in (0, 1) and --calibration-share in [0, 1)")
    if not min(self.calibration_prior_examples, self.calibration_level_prior_examples) >= 0:
      raise DprecError(f"--calibration-prior-examples and --calibration-level-prior-examples "
                       f"must be >= 0, got {self.calibration_prior_examples} and "
                       f"{self.calibration_level_prior_examples}")
    if not self.calibration_logit_bound > 0:
      raise DprecError(f"--calibration-logit-bound must be positive, got "
                       f"{self.calibration_logit_bound}")

  def model_options(self) -> CTRTrainOptions:
    """`train ctr`'s options of the model and its step (algorithm, clips, optimizer, ...)."""
    return CTRTrainOptions(data=self.data, **{k: getattr(self, k) for k in MODEL_FIELDS})
