"""White-box canaries: Dirac gradients inside the real DP step, every released update observed.

Canary j (of m) is an example whose only lookup is row j of a width-1 `DPEmbedding` that no
other example touches, and whose loss is −G·w_j: its gradient is G on that one coordinate and 0
elsewhere (Nasr et al. 2023's Dirac canary, on "rows only they touch"). The canaries that are
"in" (each with probability 1/2) are Poisson-sampled at the configuration's rate q = B/N at each
of its T steps and go through `DPModel`'s DP step with the configuration's `DPOptimizer`: per
example clipping to C2 (G > C2, so a step that skips clipping shows), DP-AdaFEST's contribution
map, noisy count and threshold (a canary row is released only when kept, or as a false
positive), DP-FEST's set (the canary rows are in it), noise σ2·C2 on the released rows, division
by B. The adversary reads each step's released gradient on the canary rows, x_t = −B·g_t/C2
(1 if sampled, else 0, plus N(0, σ2²) per the claim), and scores canary j by

  llr:    Σ_t log[(1 − q) + q·ρ_t], the log-likelihood ratio of "in" against "out" under the
          claimed mechanism, ρ_t = (p_in/p_fp)·exp((2x_t − 1)/(2σ2²)) for a released row and
          (1 − p_in)/(1 − p_fp) for a withheld one (p_in, p_fp: the chance the row is kept with
          and without the canary; 1 for DP-SGD and DP-FEST) — the Neyman–Pearson statistic of
          the composed steps;
  spread: the variance of x_t over the steps its row was released — zero for an "out" canary
          whose noise repeats from step to step, so a step that reuses its noise shows.

User level (`rows_per_user` = k): canary j is a user of k rows, each a Dirac canary on the same
coordinate j (the user's gradient kG on it, G > C2). The users that are "in" are Poisson-sampled
at q over users by the real user-level sampler (`dprec.training.user_sampling.user_batch`), the
batch carries each row's unit (`UNIT_KEY`), and the DP step clips the user's summed gradient as
one (`dprec.clipping.units`; DP-AdaFEST's 0/1 contribution map per user), normalised by B users:
a sampled user's released coordinate is −C2/B plus the noise, the claim is the row level's at q
over users, and the scores are unchanged. A step that clipped each row alone would release k·C2
(and a per-user norm that missed the k rows' sum on one coordinate, √k·C2), which the scores
read as a leak.

Real training examples touch neither the canary rows nor, being clipped one by one (one user at
a time), the canaries' clipped sums: the canaries' released coordinates are distributed as in the
full run, so the audit runs the step on the canaries alone (fast, and the same at any data size).
"""
import dataclasses
import math
from typing import Optional

import numpy as np
import tensorflow as tf

from dprec.layers.embedding import DPEmbedding
from dprec.models.dp_model import DPModel
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import SparseSGD
from dprec.privacy_unit import UNIT_KEY
from dprec.training import poisson
from dprec.training import user_sampling

CANARY_TABLE = "audit_canaries"
GRADIENT_NORM = 10.0  # G in units of C2: a step that skips clipping releases 10× the signal
SCORES = ("llr", "spread")
CANARY_IDS = "canary"  # the feature: each row's canary coordinate


@dataclasses.dataclass(frozen=True)
class Claim:
  """What the adversary believes a step does to a canary: sampling rate q, noise multiplier σ2
  of the released rows, and the chances p_in / p_fp that a canary row is released with / without
  the canary in the batch."""
  sampling_rate: float
  noise_multiplier: float
  keep_in: float = 1.0
  keep_out: float = 1.0

  @classmethod
  def of(cls, config, sampling_rate):
    """The claim of a `dprec.optimizers.config` algorithm (NonPrivate: σ2 = 0): its σ2 and its
    `row_release_probabilities`."""
    return cls(sampling_rate, config.noise_multiplier, *config.row_release_probabilities())


class CanaryModel(DPModel):
  """m Dirac canaries (module docstring) whose released updates are scored as they come."""

  def __init__(self, count: int, claim: Claim, clip: float, **kwargs):
    super().__init__(**kwargs)
    self.count, self.claim, self.clip = int(count), claim, float(clip)
    self.canaries = DPEmbedding(self.count, 1, embeddings_initializer="zeros",
                                table_name=CANARY_TABLE, name=CANARY_TABLE)
    zeros = lambda: tf.Variable(tf.zeros([self.count], tf.float64), trainable=False)
    # Per canary: Σ_t llr_t, and Σ 1, Σ x, Σ x² over the steps its row was released.
    self.llr, self.released, self.total, self.squares = zeros(), zeros(), zeros(), zeros()

  def call(self, inputs, training=False):
    return GRADIENT_NORM * self.clip * self.canaries(inputs[CANARY_IDS])  # [n, 1]

  def per_example_loss(self, y, y_pred, sample_weight=None):
    return -y_pred[:, 0]  # gradient −G on the canary's own coordinate

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
    return tf.reduce_mean(self.per_example_loss(y, y_pred))

  def compute_metrics(self, x, y, y_pred, sample_weight=None):
    return {}

  def _noisy_gradients(self, config, dense_sums, table_sums, kept_rows, normaliser, clip=None):
    """The real step's release, observed on the canary rows, then passed on unchanged."""
    grads = super()._noisy_gradients(config, dense_sums, table_sums, kept_rows, normaliser, clip)
    self._observe(grads[-1], normaliser, self.clip if clip is None else clip)
    return grads

  def _observe(self, gradient, normaliser, clip):
    if isinstance(gradient, tf.IndexedSlices):
      rows = gradient.indices[:, tf.newaxis]
      values = tf.scatter_nd(rows, gradient.values[:, 0], [self.count])
      kept = tf.scatter_nd(rows, tf.ones_like(gradient.values[:, 0]), [self.count])
    else:
      values, kept = gradient[:, 0], tf.ones([self.count], gradient.dtype)
    x = tf.cast(-values * normaliser / clip, tf.float64)
    kept = tf.cast(kept, tf.float64)
    self.llr.assign_add(_step_llr(x, kept, self.claim))
    self.released.assign_add(kept)
    self.total.assign_add(kept * x)
    self.squares.assign_add(kept * x * x)

  def scores(self):
    """{score name: [m] scores}, higher meaning more likely "in"."""
    released, total = self.released.numpy(), self.total.numpy()
    mean = total / np.maximum(released, 1)
    spread = (self.squares.numpy() - released * mean ** 2) / np.maximum(released - 1, 1)
    return {"llr": self.llr.numpy(), "spread": spread}


def _step_llr(x, kept, claim: Claim):
  """log[(1 − q) + q·ρ_t] per canary (module docstring); σ2 = 0 (no noise claimed): x itself."""
  q = claim.sampling_rate
  if claim.noise_multiplier == 0:
    return x
  log_ratio_kept = ((2.0 * x - 1.0) / (2.0 * claim.noise_multiplier ** 2)
                    + math.log(max(claim.keep_in, 1e-300) / max(claim.keep_out, 1e-300)))
  log_ratio_withheld = math.log(max(1.0 - claim.keep_in, 1e-300)
                                / max(1.0 - claim.keep_out, 1e-300))
  log_ratio = kept * log_ratio_kept + (1.0 - kept) * log_ratio_withheld
  if q >= 1.0:
    return log_ratio
  return tf.reduce_logsumexp(tf.stack([tf.fill(tf.shape(x), tf.constant(math.log1p(-q), x.dtype)),
                                       math.log(q) + log_ratio]), axis=0)


def run_canaries(config, count: int, sampling_rate: float, steps: int, batch_size: float,
                 rng: np.random.Generator, secure_noise: bool = False,
                 rows_per_user: Optional[int] = None):
  """One run: `count` canaries, each "in" with probability 1/2, through `steps` DP steps of
  `config` at Poisson rate `sampling_rate` normalised by `batch_size`; with `rows_per_user` k,
  canary users of k rows sampled over users (module docstring). Returns (scores dict, included
  [m] bool). Noise and batches draw fresh OS entropy."""
  included = rng.random(count) < 0.5
  if config_lib.fixed_rows(config) is not None:
    # DP-FEST, DP-AdaFEST+: the canary rows are in the set, taken as given, as the training
    # guarantee takes it (the set's own ε is the DP top-k selection's).
    config = dataclasses.replace(config, selected_rows={CANARY_TABLE: np.arange(count)})
  model = CanaryModel(count, Claim.of(config, sampling_rate),
                      config.l2_norm_clip if config_lib.is_private(config) else 1.0)
  model.compile(optimizer=DPOptimizer(_observed(config), SparseSGD(0.0),
                                      expected_batch_size=batch_size, secure_noise=secure_noise))
  ids = np.flatnonzero(included).astype(np.int32)
  specs = {CANARY_IDS: tf.TensorSpec([None], tf.int32)}
  if rows_per_user is not None:
    specs[UNIT_KEY] = tf.TensorSpec([None], tf.int32)
  dataset = tf.data.Dataset.from_generator(
      lambda: ((batch, np.zeros(len(batch[CANARY_IDS]), np.float32))
               for batch in canary_batches(ids, sampling_rate, steps, rows_per_user)),
      output_signature=(specs, tf.TensorSpec([None], tf.float32)))
  model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
  return model.scores(), included


def canary_batches(ids, sampling_rate: float, steps: int, rows_per_user: Optional[int] = None):
  """Each step's batch {`CANARY_IDS`: [n]} of the "in" canaries `ids`, from fresh OS entropy
  (secret): each canary Poisson-sampled at `sampling_rate`; with `rows_per_user` k, each canary
  a user of k rows on its coordinate, users sampled by `user_sampling.user_batch` and each row's
  unit in `UNIT_KEY`."""
  rng = np.random.default_rng()
  if rows_per_user is None:
    for batch in poisson.poisson_batch_indices(len(ids), sampling_rate, steps, rng):
      yield {CANARY_IDS: ids[batch]}
    return
  rows = np.repeat(ids, rows_per_user)  # user u's k rows all look up coordinate ids[u]
  users = user_sampling.UserRows.group(np.repeat(np.arange(len(ids)), rows_per_user)) if len(
      ids) else None  # (no user "in": empty batches)
  empty = (np.zeros(0, np.int64), np.zeros(0, np.int32))
  for _ in range(steps):
    batch, unit = (user_sampling.user_batch(users, sampling_rate, rows_per_user, rng) if users
                   else empty)
    yield {CANARY_IDS: rows[batch], UNIT_KEY: unit}


def _observed(config):
  """A non-private configuration is observed as DP-SGD without clipping or noise (the plain
  gradient), so that the same release hook sees it."""
  if config_lib.is_private(config):
    return config
  return config_lib.DPSGD(l2_norm_clip=float("inf"), noise_multiplier=0.0)
