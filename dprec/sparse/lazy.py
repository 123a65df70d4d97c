"""Lazy dense noise for DP-SGD (Lim, Kim, Kwon & Rhu, "LazyDP: Co-Designing Algorithm-Software
for Scalable Training of Differentially Private Recommendation Models", ASPLOS 2024,
arXiv:2404.08847, §5): an embedding row the batch does not read gets only noise from a DP-SGD
step, and under SGD that noise enters the row linearly, so it can be drawn when the row is next
read (or released) instead of at every step.

A row last brought up to date after step L, read before step t (k = t − 1 − L steps pending),
with per-step update noise −η·ξ_s, ξ_s ~ N(0, s²) per coordinate (s = σ·C2/B, B the expected
batch size), and Keras' heavy-ball momentum μ (v ← μ·v − η·ξ, w ← w + v) moves by
    w ← w + v·μ(1 − μᵏ)/(1 − μ) + Δw,      v ← μᵏ·v + Δv,
    Δw = −η Σ_{j<k} a_j ξ_{t−1−j},  Δv = −η Σ_{j<k} μ^j ξ_{t−1−j},  a_j = (1 − μ^{j+1})/(1 − μ),
a 2-variable Gaussian per coordinate with covariance (η·s)²·[[A, X], [X, V]] (`pending_covariance`):
    A = Σ a_j² = (k − 2μ(1 − μᵏ)/(1 − μ) + μ²(1 − μ^{2k})/(1 − μ²)) / (1 − μ)²,
    X = Σ a_j μ^j = ((1 − μᵏ)/(1 − μ) − μ(1 − μ^{2k})/(1 − μ²)) / (1 − μ),
    V = Σ μ^{2j} = (1 − μ^{2k})/(1 − μ²);
without momentum (μ = 0) Δw ~ N(0, k·(η·s)²): Σ_t η²σ²C²/B² over the pending steps. Drawn as one
Gaussian (Cholesky of the 2×2), the pending noise is distributed as DP-SGD's sum of draws, so the
final model is distributed as DP-SGD's; weights in between lack the pending noise and must never
be released (`LazyNoise.flush` first). `per_step` mode instead replays each pending step's draw,
keyed by (run key, table, step) (`row_step_noise`), at O(V·d) a replayed step: a run equal to eager
DP-SGD with the same keyed draws, to float rounding (the tests' reference; not for training).
"""
import tensorflow as tf

from dprec.sparse import gaussian

FLUSH_ELEMENTS = 2 ** 22  # coordinates materialised at once by `LazyNoise.flush`


def row_step_noise(seed, table, step, shape, stddev, dtype=tf.float32):
  """N(0, stddev²) of table `table`'s rows [V, d] at `step`: a function of (seed: two ints,
  table, step) alone, so a row's draw at a step is the same whenever it is made."""
  key = tf.random.experimental.stateless_fold_in(
      tf.random.experimental.stateless_fold_in(tf.constant(seed, tf.int64), table),
      tf.cast(step, tf.int64))
  return tf.random.stateless_normal(shape, key, stddev=stddev, dtype=dtype)


def pending_covariance(pending, momentum):
  """(A, X, V) of the module docstring for `pending` steps (float64 [n]), in units of (η·s)²."""
  k, mu = tf.cast(pending, tf.float64), tf.constant(momentum, tf.float64)
  mu_k, mu_2k = tf.pow(mu, k), tf.pow(mu, 2.0 * k)
  if momentum == 0:
    return k, tf.zeros_like(k), tf.cast(k > 0, tf.float64)
  geometric, squares = (1.0 - mu_k) / (1.0 - mu), (1.0 - mu_2k) / (1.0 - mu * mu)
  return ((k - 2.0 * mu * geometric + mu * mu * squares) / (1.0 - mu) ** 2,
          (geometric - mu * squares) / (1.0 - mu), squares)


class LazyNoise:
  """Per table variable, the step through which each row's noise is materialised (`done`,
  int64 [V]) and, with momentum, whether its velocity is current one step past that (`ahead`,
  int8 [V]: a step that reads a row applies its clipped gradient at once, its noise later);
  neither is checkpointed: every checkpoint is flushed first. `materialise` brings rows up to
  date, `flush` every row. `tables`: the table variables; `optimizer`: a `SparseSGD` or a
  `TableSGD` (its table learning rate, momentum and velocity slots); `step_std`: s = σ·C2/B;
  `generator`: the DP step's; `seed`: two ints for `per_step` mode (None: one Gaussian).

  Every step's noise is deferred, that of the rows it updates too (the step's gradient carries
  none): by linearity the noise of steps L+1..t moves (w, v) as in the module docstring whatever
  signal the row received, and the momentum drift of the steps the optimizer skipped is applied
  from the stored velocity."""

  def __init__(self, tables, optimizer, step_std, generator, seed=None):
    self.tables, self.optimizer, self.generator, self.seed = tables, optimizer, generator, seed
    self.step_std = float(step_std)
    self.momentum = float(getattr(optimizer, "momentum", 0.0))
    with tf.init_scope():
      rate = getattr(optimizer, "table_learning_rate", None)
      self.learning_rate = float(optimizer.learning_rate.numpy() if rate is None else rate)
      applied = optimizer.iterations.numpy()
      self.done = [tf.Variable(tf.fill([t.shape[0]], tf.constant(applied, tf.int64)),
                               trainable=False, name="lazy_noise_done") for t in tables]
      self.ahead = [tf.Variable(tf.zeros([t.shape[0]], tf.int8), trainable=False,
                                name="lazy_noise_ahead") if self.momentum else None
                    for t in tables]

  def _velocity(self, table):
    velocity = getattr(self.optimizer, "velocity", None)
    return velocity(table) if velocity is not None else None

  def materialise(self, f, rows, upto, read=False):
    """Adds to rows `rows` (local ids [n], distinct) of table f their noise of the steps after
    `done` up to step `upto` (and the momentum drift of the steps skipped); `done` ← `upto`.
    `read`: the rows are about to be updated by step upto + 1 (whose noise stays pending)."""
    table, velocity = self.tables[f], self._velocity(self.tables[f])
    pending = upto - tf.gather(self.done[f], rows)
    if self.seed is not None:
      move_w, move_v = self._replayed(f, rows, pending, upto)
    else:
      move_w, move_v = self._one_gaussian(pending, velocity is not None, table.dtype,
                                          table.shape[1])
    if velocity is not None:
      skipped = pending - tf.cast(tf.gather(self.ahead[f], rows), tf.int64)
      old_v = tf.gather(velocity, rows)
      mu_k = tf.cast(tf.pow(tf.constant(self.momentum, tf.float64),
                            tf.cast(skipped, tf.float64)), table.dtype)[:, tf.newaxis]
      move_w += old_v * (self.momentum * (1.0 - mu_k) / (1.0 - self.momentum))
      velocity.scatter_add(tf.IndexedSlices((mu_k - 1.0) * old_v + move_v, rows))
      self.ahead[f].scatter_update(tf.IndexedSlices(
          tf.fill(tf.shape(rows), tf.constant(int(read), tf.int8)), rows))
    self.done[f].scatter_update(tf.IndexedSlices(
        tf.fill(tf.shape(rows), tf.cast(upto, tf.int64)), rows))
    return table.scatter_add(tf.IndexedSlices(move_w, rows))

  def _one_gaussian(self, pending, with_velocity, dtype, width):
    """(Δ rows, Δ velocities) [n, d] of the pending noise: one draw of its covariance."""
    var_w, cov, var_v = pending_covariance(pending, self.momentum)
    scale = self.learning_rate * self.step_std
    z = gaussian.normal(self.generator, tf.stack([1 + int(with_velocity), tf.size(pending),
                                                  width]), 1.0, dtype)
    col = lambda c: tf.cast(scale * c, dtype)[:, tf.newaxis]
    if not with_velocity:
      return col(tf.sqrt(var_w)) * z[0], None
    # Cholesky of [[A, X], [X, V]]: Δv = √V·z1, Δw = (X/√V)·z1 + √(A − X²/V)·z0.
    root_v = tf.sqrt(var_v)
    lower = tf.math.divide_no_nan(cov, root_v)
    rest = tf.sqrt(tf.maximum(var_w - lower * lower, 0.0))
    return col(lower) * z[1] + col(rest) * z[0], col(root_v) * z[1]

  def _replayed(self, f, rows, pending, upto):
    """(Δ rows, Δ velocities): each pending step's keyed draw replayed through SGD/momentum
    from zero (the noise's part of the row's state, by linearity)."""
    table = self.tables[f]
    shape, lr, mu = table.shape, self.learning_rate, self.momentum
    first = upto - pending + 1  # each row's first pending step
    zeros = tf.zeros([tf.size(rows), shape[1]], table.dtype)

    def body(step, w, v):
      noise = tf.gather(row_step_noise(self.seed, f, step, shape, self.step_std, table.dtype),
                        rows)
      live = tf.cast(step >= first, table.dtype)[:, tf.newaxis]
      v = live * (mu * v - lr * noise)
      return step + 1, w + v, v

    start = tf.reduce_min(tf.concat([first, [tf.cast(upto, tf.int64) + 1]], 0))
    _, w, v = tf.while_loop(lambda step, *_: step <= upto, body, (start, zeros, zeros))
    return w, v

  def flush(self):
    """Brings every row of every table up to the optimizer's step (before any release), in
    blocks of at most `FLUSH_ELEMENTS` coordinates (a 10M-row table's draw at once would hold
    several table-sized buffers)."""
    upto = tf.cast(self.optimizer.iterations, tf.int64)
    for f, table in enumerate(self.tables):
      rows, block = table.shape[0], max(1, FLUSH_ELEMENTS // table.shape[1])
      for start in range(0, rows, block):
        self.materialise(f, tf.range(start, min(start + block, rows), dtype=tf.int64), upto)
