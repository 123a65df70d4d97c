"""One object per training algorithm (Ghazi, Huang, Kamath, Kumar, Manurangsi, Sinha & Zhang
2023, "Sparsity-preserving differentially private training of large embedding models",
arXiv:2311.08357): NonPrivate, DP-SGD, DP-FEST, DP-AdaFEST, DP-AdaFEST+.

Each object owns how the DP step treats a batch: how per-example gradients are clipped (C2,
`clip_factors`), which embedding rows may receive an update (`kept_rows`: every row, a fixed
DP-FEST set, or the rows a DP-AdaFEST contribution map selects this step), where the noise goes
(σ2·C2 on dense variables and on those rows; every row for `kept_rows` None), and how a step is
accounted (`accounting_noise_multiplier`, `split_noise`, `preselected`: a set drawn once by DP
top-k, charged separately). `from_plan` builds it from a planned σ and the run's options, and
`row_release_probabilities` states what it releases about one example's row (the white-box
audit's claim). A new algorithm is one class here, listed in `ALGORITHMS`. `DPModel` reads the
object from the `DPOptimizer` passed to `compile`.
"""
import dataclasses
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from dprec.optimizers.defaults import ADAFEST_RATIO, ADAFEST_THRESHOLD  # noqa: F401
from dprec.sparse import kept_rows as kept_rows_lib
from dprec.sparse.selection import gaussian_survival


def _check_positive(name, value, allow_inf=False):
  if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
    raise ValueError(f"{name} must be a number, got {value!r}")
  if value <= 0 or (math.isinf(value) and not allow_inf):
    limit = "a positive number (inf allowed)" if allow_inf else "a positive finite number"
    raise ValueError(f"{name} must be {limit}, got {value!r}")


def _check_non_negative(name, value):
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  if value < 0:
    raise ValueError(f"{name} must be >= 0, got {value!r}")


def _check_finite_noise(clip_name, clip, noise_multiplier):
  # An infinite clip only makes sense without noise (σ·C would be infinite).
  if math.isinf(clip) and noise_multiplier > 0:
    raise ValueError(f"{clip_name} = inf needs a noise multiplier of 0, got {noise_multiplier}")


def _freeze_rows(selected_rows):
  """Validates {table name: row ids} and returns sorted unique int64 arrays."""
  if not isinstance(selected_rows, Mapping) or not selected_rows:
    raise ValueError("selected_rows must be a non-empty mapping {table name: row ids}")
  frozen = {}
  for table, rows in selected_rows.items():
    rows = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1))
    if rows.size and rows[0] < 0:
      raise ValueError(f"selected_rows[{table!r}] contains a negative row id {rows[0]}")
    frozen[str(table)] = rows
  return frozen


@dataclasses.dataclass(frozen=True)
class QuantileClipping:
  """Adaptive clipping to a quantile of the per-example gradient norms (Andrew, Thakkar,
  McMahan & Ramaswamy 2021, "Differentially private learning with adaptive clipping",
  Algorithm 1 with the geometric update): after each step, with b_i = 1[‖g_i‖ ≤ C],
      b̃ = (Σ_i (b_i − ½) + N(0, σ_b²)) / B + ½,      C ← C·exp(−η·(b̃ − γ)),
  B the expected batch size (under Poisson sampling the batch's size is private, but Σ(b_i − ½)
  over a Poisson batch has mean B·(P[‖g‖ ≤ C] − ½), so b̃ is unbiased). Adding or removing one
  example moves Σ(b_i − ½) by exactly ½: the count is a Gaussian mechanism of noise multiplier
  2σ_b, composed with the gradient's into one Gaussian of σ = (σ_Δ⁻² + (2σ_b)⁻²)^(−1/2) (their
  Theorem 1); `dprec.privacy.quantile_gradient_noise_multiplier` inverts it for a planned σ.
  C depends on the data only through the noisy counts of earlier steps (adaptive composition).

  count_noise_multiplier: σ_b, the std of the noise on the count (the paper's m/20: B/20).
  target_quantile: γ, the quantile C tracks (0.5: the median, the paper's default).
  learning_rate: η_C (0.2, the paper's default for the geometric update).
  """
  count_noise_multiplier: float
  target_quantile: float = 0.5
  learning_rate: float = 0.2

  def __post_init__(self):
    _check_positive("count_noise_multiplier", self.count_noise_multiplier)
    _check_positive("learning_rate", self.learning_rate)
    if not 0 < self.target_quantile < 1:
      raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}")

  @staticmethod
  def centered_count(squared_norms, clip):
    """Σ_i (1[‖g_i‖ ≤ C] − ½) from ‖g_i‖² [batch]: sensitivity ½ per example."""
    unclipped = tf.cast(squared_norms <= tf.square(tf.cast(clip, squared_norms.dtype)),
                        squared_norms.dtype)
    return tf.reduce_sum(unclipped - 0.5)

  def next_clip(self, clip, noisy_centered_count, expected_batch_size):
    """C·exp(−η·(b̃ − γ)) for the noisy Σ(b_i − ½) (noise already added)."""
    fraction = noisy_centered_count / tf.cast(expected_batch_size, clip.dtype) + 0.5
    return clip * tf.exp(-self.learning_rate * (fraction - self.target_quantile))

  def with_count(self, noise_multiplier):
    """σ of the step with the count: the gradient's σ composed with the count's 2σ_b."""
    from dprec.privacy import composed_noise_multiplier
    if noise_multiplier == 0:
      return 0.0
    return composed_noise_multiplier(noise_multiplier, 2 * self.count_noise_multiplier)


class _Algorithm:
  """What every algorithm answers (the methods its subclasses override)."""
  name: str
  private = True
  preselected = False  # whether it trains a set of rows drawn once before training (DP top-k)

  @classmethod
  def split_noise(cls, noise_multiplier, ratio):
    """(σ1 of the row selection or None, σ2 of the gradient) of a step accounted at σ."""
    del ratio
    return None, noise_multiplier

  @classmethod
  def from_plan(cls, noise_multiplier, options, selected_rows=None):
    """The algorithm at planned σ (`accounting_noise_multiplier`), its hyperparameters read from
    `options` (`l2_norm_clip`; DP-AdaFEST also `ratio`, `contribution_clip`, `threshold`), the
    DP-FEST set from `selected_rows` ({table name: row ids}, for a `preselected` algorithm)."""
    raise NotImplementedError

  def kept_rows(self, layout, pairs, batch_size, generator, replicas=None):
    """One `dprec.sparse.kept_rows.KeptRows` per variable of `layout` for the batch's distinct
    (example, row) `pairs` (`dprec.sparse.kept_rows.select_kept_rows`). Default: every row
    (rows None: the noise goes on every row)."""
    del layout, batch_size, generator, replicas
    return kept_rows_lib.all_rows(pairs)

  def row_release_probabilities(self):
    """(p_in, p_fp): the chance a row only one example touches (contributing 1 before C1) is
    updated when the example is in the batch, and when it is not. Default: always (1, 1)."""
    return 1.0, 1.0


@dataclasses.dataclass(frozen=True)
class NonPrivate(_Algorithm):
  """Plain training: no clipping, no noise; embedding updates on the rows the batch touched."""
  name = "non_private"
  private = False
  noise_multiplier = 0.0

  @property
  def accounting_noise_multiplier(self):
    return None

  @classmethod
  def split_noise(cls, noise_multiplier, ratio):
    return None, None

  @classmethod
  def from_plan(cls, noise_multiplier, options, selected_rows=None):
    return cls()


@dataclasses.dataclass(frozen=True)
class DPSGD(_Algorithm):
  """DP-SGD (Ghazi et al. 2023, eq. 1): clip each example's full gradient to `l2_norm_clip`
  (C2), add N(0, (σ·C2)²) to every coordinate of every variable, embedding tables included
  (dense).

  `normalization_offset` γ (keyword only) switches clipping min(1, C/‖g_i‖) to per-example
  normalisation C/(‖g_i‖ + γ) ("automatic clipping", Bu et al. 2022, which DPFormer trains with:
  C = 1, γ = 0.01 as in fastDP; Ding, Wu, Wang & Pan 2023, "DPFormer: learning differentially
  private transformer on long-tailed data", arXiv:2305.17633). Either way ‖c_i·g_i‖ < C, so
  the sensitivity and the accounting are unchanged.

  `quantile_clipping` (keyword only, a `QuantileClipping`) makes C2 adaptive: `l2_norm_clip` is
  its initial value, `DPOptimizer.clip` the current one; `noise_multiplier` is the gradient's
  σ_Δ and each step is accounted with the count's noise composed in.

  `per_step_noise` (keyword only): the tables' noise at step t is `dprec.sparse.lazy.
  row_step_noise`, keyed by (run key, table, t), so that `DPSGDLazy` can replay it (tests)."""
  l2_norm_clip: float
  noise_multiplier: float
  normalization_offset: Optional[float] = dataclasses.field(default=None, kw_only=True)
  quantile_clipping: Optional[QuantileClipping] = dataclasses.field(default=None, kw_only=True)
  per_step_noise: bool = dataclasses.field(default=False, kw_only=True)
  name = "dp_sgd"

  def __post_init__(self):
    _check_positive("l2_norm_clip", self.l2_norm_clip, allow_inf=True)
    _check_non_negative("noise_multiplier", self.noise_multiplier)
    _check_finite_noise("l2_norm_clip", self.l2_norm_clip, self.noise_multiplier)
    if self.normalization_offset is not None:
      _check_positive("normalization_offset", self.normalization_offset)
      if self.l2_norm_clip == float("inf"):
        raise ValueError("normalisation needs a finite l2_norm_clip")
    if self.quantile_clipping is not None:
      if not isinstance(self.quantile_clipping, QuantileClipping):
        raise ValueError(f"quantile_clipping must be a QuantileClipping, got "
                         f"{type(self.quantile_clipping).__name__}")
      if self.normalization_offset is not None or math.isinf(self.l2_norm_clip):
        raise ValueError("quantile clipping needs a finite l2_norm_clip and no normalisation")

  def clip_factors(self, squared_norms, share=1.0, clip=None):
    """Per-example factors c_i applied to g_i, from ‖g_i‖² [batch], clipping (or normalising)
    to C·√share: a clipping group with `share` of C² (per-group clipping, McMahan et al. 2018;
    groups whose shares sum to 1 keep the total sensitivity C). `clip`: this step's C (a
    tensor, under quantile clipping) instead of `l2_norm_clip`."""
    norms = tf.sqrt(squared_norms)
    limit = self.l2_norm_clip if clip is None else tf.cast(clip, squared_norms.dtype)
    bound = limit * share ** 0.5
    if self.normalization_offset is not None:
      return bound / (norms + self.normalization_offset)
    if self.l2_norm_clip == float("inf"):
      return tf.ones_like(squared_norms)
    return bound / tf.maximum(bound, norms)

  def _with_count(self, noise_multiplier):
    if self.quantile_clipping is None:
      return noise_multiplier
    return self.quantile_clipping.with_count(noise_multiplier)

  @property
  def accounting_noise_multiplier(self):
    """σ of the single Gaussian mechanism each step is accounted as."""
    return self._with_count(self.noise_multiplier)

  @classmethod
  def from_plan(cls, noise_multiplier, options, selected_rows=None):
    return cls(float(options.l2_norm_clip), noise_multiplier)


@dataclasses.dataclass(frozen=True)
class DPSGDLazy(DPSGD):
  """DP-SGD with lazy dense noise (Lim et al., "LazyDP", ASPLOS 2024; `dprec.sparse.lazy`): the
  same mechanism and accounting as `DPSGD`, the same final model in distribution, at the cost of
  the rows a step reads. A step's gradient is an IndexedSlices over the rows the batch touched,
  the clipped sum alone: its noise, like the noise every other row would have received, waits
  until the row is next read (drawn before the forward pass) or the model leaves the run (every
  checkpoint, `evaluate`, `predict` and save materialises it first). Intermediate weights lack it:
  they must never be released. Needs SGD on the tables (`SparseSGD`, or `TableSGD` with or
  without momentum: the noise must enter linearly), a fixed `expected_batch_size`, a fixed C2.

  `per_step_noise` (keyword only): every table's noise at step t is `dprec.sparse.lazy.
  row_step_noise` keyed by (run key, table, t); pending steps are replayed, O(V·d) each: equal
  to `DPSGD(per_step_noise=True)` to float rounding (tests)."""
  name = "dp_sgd_lazy"

  def __post_init__(self):
    super().__post_init__()
    if self.quantile_clipping is not None:
      raise ValueError("dp_sgd_lazy needs a fixed clip: pending noise is summed at one σ·C2")

  def kept_rows(self, layout, pairs, batch_size, generator, replicas=None):
    """Every pair kept; each variable's noised rows: those the batch touched."""
    del layout, batch_size, generator, replicas
    return kept_rows_lib.touched_rows(pairs)


@dataclasses.dataclass(frozen=True)
class DPFEST(DPSGD):
  """DP-FEST (Ghazi et al. 2023 §3.1): DP-SGD restricted to a fixed set of rows per embedding table.

  `selected_rows` maps a table name (see `dprec.layers.DPEmbedding.table_name`) to the local row
  ids to train, chosen from public counts or by DP top-k (`dprec.sparse.fest`; its ε is charged
  separately). Rows outside the set are zeroed before clipping, get no noise and are never
  updated: lookups of them keep returning their initial values. Tables not listed get no update.
  """
  selected_rows: Mapping[str, Sequence[int]]
  name = "dp_fest"
  preselected = True

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "selected_rows", _freeze_rows(self.selected_rows))

  @classmethod
  def from_plan(cls, noise_multiplier, options, selected_rows=None):
    return cls(float(options.l2_norm_clip), noise_multiplier, selected_rows=selected_rows)

  def kept_rows(self, layout, pairs, batch_size, generator, replicas=None):
    """The fixed set every step."""
    del batch_size, generator, replicas
    return kept_rows_lib.fixed_set_rows(layout, self.selected_rows, pairs)


@dataclasses.dataclass(frozen=True)
class DPAdaFEST(DPSGD):
  """DP-AdaFEST (Ghazi et al. 2023, Algorithm 1): per step, each example's 0/1 row-contribution map
  (jointly over all tables) is clipped to `contribution_clip` (C1), summed, perturbed with
  N(0, (σ1·C1)²) and thresholded at `threshold` (τ); DP-SGD with clip C2 = `l2_norm_clip` and
  noise σ2 = `noise_multiplier` then updates only the surviving rows (and all dense variables).

  Accounting: one step is a Gaussian mechanism with σ = (σ1⁻² + σ2⁻²)^(−1/2).
  """
  contribution_clip: float
  contribution_noise_multiplier: float
  threshold: float
  name = "dp_adafest"

  def __post_init__(self):
    super().__post_init__()
    _check_positive("contribution_clip", self.contribution_clip, allow_inf=True)
    _check_non_negative("contribution_noise_multiplier", self.contribution_noise_multiplier)
    _check_finite_noise("contribution_clip", self.contribution_clip,
                        self.contribution_noise_multiplier)
    # τ <= 0 would make Ψ(τ/(σ1·C1)) >= 1/2: most of the vocabulary would be selected.
    _check_positive("threshold", self.threshold)

  @classmethod
  def from_noise_multiplier(cls, l2_norm_clip, noise_multiplier, ratio=5.0, **kwargs):
    """The configuration whose composed σ (the one accounted) is `noise_multiplier`, split
    with σ1 = ratio·σ2 (Ghazi et al. 2023 §3.2; ratio 5 or 10 is best in its Fig. 7)."""
    sigma1, sigma2 = cls.split_noise(noise_multiplier, ratio)
    return cls(l2_norm_clip, sigma2, contribution_noise_multiplier=sigma1, **kwargs)

  @classmethod
  def split_noise(cls, noise_multiplier, ratio):
    """σ1 = ratio·σ2 composing to σ (`dprec.privacy.adafest_noise_multipliers`)."""
    from dprec.privacy import adafest_noise_multipliers
    return adafest_noise_multipliers(noise_multiplier, ratio)

  @classmethod
  def from_plan(cls, noise_multiplier, options, selected_rows=None):
    fest = {"selected_rows": selected_rows} if cls.preselected else {}
    return cls.from_noise_multiplier(
        float(options.l2_norm_clip), noise_multiplier, options.ratio,
        contribution_clip=float(options.contribution_clip), threshold=float(options.threshold),
        **fest)

  def kept_rows(self, layout, pairs, batch_size, generator, replicas=None):
    """The rows the step's noisy, thresholded contribution map keeps (false positives
    included), within the DP-FEST set of DP-AdaFEST+."""
    return kept_rows_lib.contribution_map_rows(
        layout, pairs, batch_size, generator, replicas, self.contribution_clip,
        noise_std(self.contribution_clip, self.contribution_noise_multiplier), self.threshold,
        fixed_rows(self))

  def row_release_probabilities(self):
    """Ψ((τ − min(1, C1))/(σ1·C1)) and Ψ(τ/(σ1·C1)) (exact thresholds without noise)."""
    std = noise_std(self.contribution_clip, self.contribution_noise_multiplier)
    count = min(1.0, self.contribution_clip)  # a one-row map clipped to C1
    if std == 0:
      return float(count >= self.threshold), 0.0
    return (gaussian_survival((self.threshold - count) / std),
            gaussian_survival(self.threshold / std))

  @property
  def accounting_noise_multiplier(self):
    from dprec.privacy import composed_noise_multiplier
    sigma1, sigma2 = self.contribution_noise_multiplier, self.noise_multiplier
    if sigma1 == 0 or sigma2 == 0:
      return 0.0
    return self._with_count(composed_noise_multiplier(sigma1, sigma2))


@dataclasses.dataclass(frozen=True)
class DPAdaFESTPlus(DPAdaFEST):
  """DP-AdaFEST+ (Ghazi et al. 2023 §4.2): DP-FEST pre-selection (`selected_rows`, as in
  `DPFEST`), then DP-AdaFEST restricted to that set: contribution maps and false positives
  range over it only."""
  selected_rows: Mapping[str, Sequence[int]]
  name = "dp_adafest_plus"
  preselected = True

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "selected_rows", _freeze_rows(self.selected_rows))


# DP-AdaFEST's default σ1/σ2 ratio r and threshold τ (`train ctr`, the stream, `make_private`):
# Ghazi et al.'s frontier reproduced at 5M rows (docs/experiments/ctr_utility.md): the
# ≥ 10³× point with the best validation AUC; σ1 = 2·σ2 keeps τ/σ1 ≈ 4 (false positives ~3e-5 a
# row).

ALGORITHMS = {cls.name: cls for cls in (NonPrivate, DPSGD, DPSGDLazy, DPFEST, DPAdaFEST,
                                         DPAdaFESTPlus)}


def is_private(config) -> bool:
  return config.private


def noise_std(clip, noise_multiplier):
  """σ·C, with 0 for σ = 0 even when C = inf (the non-private limit)."""
  return 0.0 if noise_multiplier == 0 else float(noise_multiplier) * float(clip)


def fixed_rows(config) -> Optional[Mapping[str, np.ndarray]]:
  """The DP-FEST set of `config`, or None when every row may be updated."""
  return getattr(config, "selected_rows", None)
