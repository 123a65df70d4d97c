"""The options of `dprec.make_private` (`PrivateOptions`, documented at `make_private`) and the
defaults its plan and algorithm choice read."""
import dataclasses
import math
from typing import Optional, Tuple

import numpy as np

from dprec.errors import DprecError
from dprec.optimizers import config as config_lib
from dprec.privacy import accounting
from dprec.privacy_unit import PRIVACY_UNITS
from dprec.training import output_layer
from dprec.training import user_sampling

COMMAND = "make_private"
TRAINING_LABEL = "make_private training"
LABEL_STATISTICS_LABEL = "make_private output bias"
RECALIBRATION_LABEL = "make_private recalibration"
# "auto" and the algorithms that need no rows drawn before training (DP-FEST's top-k).
ALGORITHMS = ("auto",) + tuple(name for name, algorithm in config_lib.ALGORITHMS.items()
                               if algorithm.private and not algorithm.preselected)
# "auto": DP-SGD while dense noise on every row of the DP tables is cheap (Σ V·d up to this many
# floats, the size of a modest Dense layer), DP-AdaFEST above. On the ranking benchmark's small
# tables DP-SGD was better (docs/experiments/make_private.md); AdaFEST pays off in gradient size.
AUTO_DENSE_LIMIT = 1 << 20
# ... and DP-SGD too when DP-AdaFEST could keep only noise: an example gives each of its k rows
# C1/√k of its contribution map, so a row reaches τ only if ⌈τ·√k/C1⌉ examples of the batch touch
# it; above this share of B hardly any row does, and the rows kept are false positives (the
# sampled retriever, k = 203: a random 2.3% of rows, docs/experiments/make_private.md).
AUTO_MAX_TOUCH_SHARE = 0.1
PREDICT_BATCH = 8192
# The default B: `poisson.data_sized_batch_size`, about 150 steps per epoch: per step σ·C2/B falls
# faster than the planned σ grows with B (docs/experiments/make_private.md, "Adaptive clipping
# and the batch").
# The default C2 by loss kind: MSE on a rating scale has per-example norms well above 1, and
# C2 = 1 clips nearly every example and trains towards the label median (same record). Other
# losses keep 1 (not re-measured).
DEFAULT_CLIP = {output_layer.MSE: 3.0}
# σ_b of the quantile count per expected batch example: the noisy unclipped fraction has std
# 1/20 (Andrew et al. 2021 §3: σ_b = m/20); at B = 128 and σ = 0.74 it raises the gradient's σ
# by 0.2%. Never below σ itself (the gradient's σ then grows by at most 15%).
QUANTILE_COUNT_NOISE = 1 / 20
# Adam moves a weight by about its learning rate a step, so by at most ≈ lr·T over T steps. Below
# this, a private model barely leaves its initialisation (the pCTR and TFRS ranking models
# measured in docs/experiments/make_private.md).
SHORT_ADAM_PATH = 0.5


@dataclasses.dataclass
class PrivateOptions:
  """The options of `make_private` (documented there)."""
  epsilon: float
  train_size: int
  delta: Optional[float] = None
  batch_size: Optional[int] = None
  epochs: float = 1
  algorithm: str = "auto"
  ledger: Optional[str] = None
  l2_norm_clip: Optional[float] = None
  target_quantile: Optional[float] = None
  clip_learning_rate: float = 0.2
  ratio: float = config_lib.ADAFEST_RATIO
  threshold: float = config_lib.ADAFEST_THRESHOLD
  contribution_clip: float = 1.0
  init_output_bias: bool = True
  output_bias_share: float = 0.02
  recalibrate: Optional[bool] = None
  recalibration_share: float = 0.05
  label_range: Optional[Tuple[float, float]] = None
  accountant: str = "pld"
  charge_every: int = 100
  secure_noise: bool = False
  insecure_noise_seed: Optional[int] = None
  max_batch_size: Optional[int] = None
  privacy_unit: str = "row"
  user_id: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
  max_rows_per_user: Optional[int] = None

  private = True  # the algorithms' `from_plan` reads it

  def validate(self) -> Optional[user_sampling.UserRows]:
    """Refuses bad options in one line; returns the training rows grouped by user at user level
    (`user_sampling.UserRows`), None at row level."""
    if not self.epsilon > 0 or not math.isfinite(self.epsilon):
      raise DprecError(f"epsilon must be positive and finite, got {self.epsilon}")
    if int(self.train_size) < 1:
      raise DprecError(f"train_size must be a positive number of examples, got "
                       f"{self.train_size}")
    if self.delta is not None and not 0 < self.delta < 1:
      raise DprecError(f"delta must be in (0, 1), got {self.delta}")
    users = self._users()
    units = self.train_size if users is None else users.num_users
    if self.batch_size is not None and not 1 <= self.batch_size <= units:
      what = "train_size" if users is None else "the number of users"
      raise DprecError(f"batch_size must be in [1, {what}={units}], got {self.batch_size}")
    if not self.epochs > 0:
      raise DprecError(f"epochs must be positive, got {self.epochs}")
    if self.algorithm not in ALGORITHMS:
      raise DprecError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got "
                       f"{self.algorithm!r}")
    if self.target_quantile is not None and not 0 < self.target_quantile < 1:
      raise DprecError(f"target_quantile must be in (0, 1) or None, got {self.target_quantile}")
    for name in ("l2_norm_clip", "clip_learning_rate", "ratio", "threshold",
                 "contribution_clip"):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise DprecError(f"{name} must be positive, got {getattr(self, name)}")
    shares = self.output_bias_share * self.init_output_bias + (
        self.recalibration_share * (self.recalibrate is not False))
    if not (0 < self.output_bias_share < 1 and 0 < self.recalibration_share < 1
            and shares < 0.5):
      raise DprecError("output_bias_share and recalibration_share must be in (0, 1) and leave "
                       f"training at least half of epsilon, got {self.output_bias_share}, "
                       f"{self.recalibration_share}")
    if self.label_range is not None and not (len(self.label_range) == 2
                                             and self.label_range[0] < self.label_range[1]):
      raise DprecError(f"label_range must be (lo, hi) with lo < hi, got {self.label_range}")
    return users

  @property
  def rows_per_unit(self) -> int:
    """k, the most rows of a protected unit a step or a one-off release reads (1: a row)."""
    if self.privacy_unit != "user":
      return 1
    if self.max_rows_per_user is None:
      return user_sampling.DEFAULT_MAX_ROWS_PER_USER
    return self.max_rows_per_user

  def _users(self) -> Optional[user_sampling.UserRows]:
    """The user-level options checked, and the rows grouped by `user_id` (None at row level)."""
    if self.privacy_unit not in PRIVACY_UNITS:
      raise DprecError(f"privacy_unit must be one of {', '.join(PRIVACY_UNITS)}, got "
                       f"{self.privacy_unit!r}")
    if self.privacy_unit == "row":
      if self.user_id is not None or self.max_rows_per_user is not None:
        raise DprecError("user_id and max_rows_per_user go with privacy_unit='user'; at the "
                         "default privacy_unit='row' one training example is protected")
      return None
    if self.user_id is None:
      raise DprecError("privacy_unit='user' needs user_id: an integer array of train_size "
                       "user ids, one per training example in the order fit receives them")
    if self.max_batch_size is not None:
      raise DprecError("max_batch_size caps row-level Poisson batches; at privacy_unit='user' "
                       "a batch holds at most max_rows_per_user rows per sampled user already")
    accounting.check_group_size(self.rows_per_unit)
    return user_sampling.UserRows.group(self.user_id, self.train_size, field="user_id")
