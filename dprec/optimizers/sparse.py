"""Optimizers whose update for a `tf.IndexedSlices` gradient touches only its rows.

Stock Keras 2.15 optimizers compile their update with XLA by default, which turns a row
scatter into a copy of the whole table (a 10M×55 embedding: SGD 11.7 s, Adam 16.4 s per step
here), and Adam decays every row's moments on every step. These run without XLA: SGD with a
row scatter, Keras' own row-sparse Adagrad update, and a lazy Adam that updates the moments
of the gradient's rows only (dense variables get the ordinary Adam update), SGD or momentum on
the tables beside Adam on the rest (`TableSGD`), and DP-AdamBC. A DP step's row gradients
(`dprec.sparse.noise.DistinctRows`) skip Keras' sum over duplicate indices.
"""
import tensorflow as tf

from dprec.optimizers.defaults import ADAMBC_FLOOR
from dprec.sparse.noise import DistinctRows


class _AppliesDistinctRows:
  """Keras sums every IndexedSlices gradient's duplicate indices before the update (a unique and
  a segment sum over all its values: for lazy DP-SGD, every row the batch touched); a
  `DistinctRows` gradient has none and is applied as it is."""

  def _deduplicate_sparse_grad(self, grads):
    summed = super()._deduplicate_sparse_grad
    return [g if isinstance(g, DistinctRows) else summed([g])[0] for g in grads]


class SparseSGD(_AppliesDistinctRows, tf.keras.optimizers.SGD):
  """SGD without momentum; an IndexedSlices gradient updates its rows only (scatter_sub).
  (Keras' SGD keeps a momentum slot even at momentum 0 and rescales it densely every step.)"""

  def __init__(self, learning_rate=0.01, name="SparseSGD", **kwargs):
    if kwargs.pop("momentum", 0.0):
      raise ValueError("SparseSGD has no momentum: it would decay every row on every step")
    kwargs["jit_compile"] = False
    super().__init__(learning_rate=learning_rate, name=name, **kwargs)

  def build(self, var_list):
    tf.keras.optimizers.Optimizer.build(self, var_list)  # no momentum slots

  def update_step(self, gradient, variable):
    lr = tf.cast(self.learning_rate, variable.dtype)
    if isinstance(gradient, tf.IndexedSlices):
      return variable.scatter_sub(tf.IndexedSlices(lr * gradient.values, gradient.indices))
    # In place, without an lr·gradient temporary the size of the variable.
    return tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=gradient)


class SparseAdagrad(_AppliesDistinctRows, tf.keras.optimizers.Adagrad):
  """Adagrad; an IndexedSlices gradient updates its rows and their accumulators only."""

  def __init__(self, learning_rate=0.05, name="SparseAdagrad", **kwargs):
    kwargs["jit_compile"] = False
    super().__init__(learning_rate=learning_rate, name=name, **kwargs)


class LazyAdam(_AppliesDistinctRows, tf.keras.optimizers.Adam):
  """Adam whose IndexedSlices update reads and writes only the gradient's rows of m, v and the
  variable ("lazy": rows absent from a step keep stale moments); dense gradients: Adam."""

  def __init__(self, learning_rate=0.001, name="LazyAdam", **kwargs):
    if kwargs.get("amsgrad"):
      raise ValueError("LazyAdam does not support amsgrad")
    kwargs["jit_compile"] = False
    super().__init__(learning_rate=learning_rate, name=name, **kwargs)

  def update_step(self, gradient, variable):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable)
    index = self._index_dict[self._var_key(variable)]
    return lazy_adam_rows(self, gradient, variable, self._momentums[index],
                          self._velocities[index], self.learning_rate)


class TableSGD(LazyAdam):
  """SGD, with or without momentum μ (heavy ball, Keras' convention v ← μ·v − η·g, w ← w + v), at
  `table_learning_rate` on the embedding tables named by `train_tables`, and `LazyAdam` at
  `learning_rate` on every other (dense) variable. DP-SGD's noise passes through SGD linearly,
  which lazy noise (`dprec.optimizers.config.DPSGDLazy`) needs; the small dense tower keeps Adam.
  An IndexedSlices gradient updates its rows (and their velocities) only: rows absent from a
  step neither decay nor move (the lazy algorithm applies those moves when it materialises the
  rows); a dense one updates every row."""

  def __init__(self, learning_rate=0.001, table_learning_rate=0.1, momentum=0.0,
               name="TableSGD", **kwargs):
    if not 0.0 <= momentum < 1.0:
      raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    super().__init__(learning_rate=learning_rate, name=name, **kwargs)
    self.table_learning_rate, self.momentum = float(table_learning_rate), float(momentum)
    self._table_ids = set()

  def train_tables(self, variables):
    """Marks the table variables (before `build`)."""
    self._table_ids = {id(v) for v in variables}

  def trains_with_sgd(self, variable):
    """Whether `variable` is one of the tables marked by `train_tables` (SGD, not Adam)."""
    return id(variable) in self._table_ids

  def build(self, var_list):
    """Adam's m and v for the dense variables; for a table, its velocity (with momentum) in m's
    place and empty placeholders, so that no table-sized slot goes unused."""
    tf.keras.optimizers.Optimizer.build(self, var_list)
    if getattr(self, "_built", False):
      return
    self._built = True
    self._momentums, self._velocities = [], []
    for var in var_list:
      if id(var) not in self._table_ids:
        self._momentums.append(self.add_variable_from_reference(var, "m"))
        self._velocities.append(self.add_variable_from_reference(var, "v"))
        continue
      self._momentums.append(self.add_variable_from_reference(var, "table_velocity")
                             if self.momentum else self.add_variable([0], name="unused"))
      self._velocities.append(self.add_variable([0], name="unused"))

  def velocity(self, variable):
    """The momentum slot of a table variable (None without momentum)."""
    if not self.momentum or id(variable) not in self._table_ids:
      return None
    return self._momentums[self._index_dict[self._var_key(variable)]]

  def update_step(self, gradient, variable):
    if id(variable) not in self._table_ids:
      return super().update_step(gradient, variable)
    lr = tf.constant(self.table_learning_rate, variable.dtype)
    velocity = self.velocity(variable)
    if isinstance(gradient, tf.IndexedSlices):
      rows, step = gradient.indices, -lr * gradient.values
      if velocity is not None:
        step = self.momentum * tf.gather(velocity, rows) + step
        velocity.scatter_update(tf.IndexedSlices(step, rows))
      return variable.scatter_add(tf.IndexedSlices(step, rows))
    if velocity is None:
      return tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr,
                                                     delta=gradient)
    velocity.assign(self.momentum * velocity - lr * gradient)
    return variable.assign_add(velocity)

  def get_config(self):
    config = super().get_config()
    config.update(table_learning_rate=self.table_learning_rate, momentum=self.momentum)
    return config


def lazy_adam_rows(adam, gradient, variable, m, v, learning_rate):
  """Adam's step (`adam`'s β1, β2, ε and iterations) on the rows of the IndexedSlices `gradient`
  only: those rows of the moments m, v and of `variable` (tf.Variables) are read and written,
  the others keep stale moments. Shared by tf.keras' `LazyAdam` and Keras 3's
  (`dprec.models.keras3.LazyAdam`)."""
  dtype = variable.dtype
  step = tf.cast(adam.iterations + 1, dtype)
  beta_1 = tf.cast(adam.beta_1, dtype)
  beta_2 = tf.cast(adam.beta_2, dtype)
  alpha = (tf.cast(learning_rate, dtype) * tf.sqrt(1 - tf.pow(beta_2, step))
           / (1 - tf.pow(beta_1, step)))
  rows, values = gradient.indices, gradient.values
  m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
  v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
  m.scatter_update(tf.IndexedSlices(m_rows, rows))
  v.scatter_update(tf.IndexedSlices(v_rows, rows))
  return variable.scatter_sub(
      tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + adam.epsilon), rows))


class AdamBC(_AppliesDistinctRows, tf.keras.optimizers.Optimizer):
  """DP-AdamBC (Tang et al., "On the Performance of Differentially Private Optimization with
  Heavy-Tail Class Imbalance", arXiv:2411.04205, App. A, Algorithm 2): Adam whose second moment has
  the DP noise variance subtracted, θ ← θ − η·m̂ / sqrt(max(v̂ − Φ̂, γ')).

  Φ̂ is a noise-variance EMA kept per row (one value per slice of the first axis) with Adam's β2
  and bias correction: at every update of a row, φ ← β2^k·φ + (1 − β2)·Φ_t, where Φ_t is the
  per-coordinate variance of the noise in this step's (normalised) gradient, `noise_variance`,
  which `DPModel`'s step sets to (σ2·C2/B)² (0 without noise: AdamBC is then Adam with the floor
  γ' in place of Adam's ε). A dense gradient updates every row each step, so Φ̂ = (σ2·C2/B)²
  exactly (Tang et al. 2024, App. A). An `IndexedSlices` gradient updates its rows only: the DP
  step's IndexedSlices lists exactly the rows it noised (kept rows, false positives included), and a
  row absent for k − 1 steps has m, v and φ decayed by β^k when next updated ("decay
  otherwise", Tang et al. 2024), so its moments equal dense Adam's with zero gradient on the skipped
  steps and φ is exactly the noise variance its v holds; only the momentum-driven moves of the
  skipped steps are not made (lazy). Per step the work is O(rows of the gradient × dim).

  `floor` is γ', a floor on the corrected variance, not an ε added to the root: coordinates
  whose signal is below the noise take steps η·m̂/sqrt(γ'), so tune it with the learning rate
  (Tang et al. 2024). Default `ADAMBC_FLOOR`. Bias
  correction uses only the public σ2, C2, B: post-processing, no privacy cost.
  """

  def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, floor=ADAMBC_FLOOR,
               name="AdamBC",
               **kwargs):
    if not floor > 0:
      raise ValueError(f"AdamBC floor (γ') must be positive, got {floor}")
    kwargs["jit_compile"] = False
    kwargs.setdefault("weight_decay", None)  # the base class's 0 would decay every row densely
    super().__init__(name=name, **kwargs)
    self._learning_rate = self._build_learning_rate(learning_rate)
    self.beta_1, self.beta_2, self.floor = beta_1, beta_2, floor
    with tf.init_scope():
      self.noise_variance = tf.Variable(0.0, trainable=False, dtype=tf.float32,
                                        name="noise_variance")

  def build(self, var_list):
    super().build(var_list)
    if getattr(self, "_built", False):
      return
    self._built = True
    self._slots = []
    for var in var_list:
      rows = var.shape[:1]
      self._slots.append((
          self.add_variable_from_reference(var, "m"),
          self.add_variable_from_reference(var, "v"),
          self.add_variable_from_reference(var, "noise_ema", shape=rows),
          self.add_variable(rows, tf.int64, name=f"last_step/{var._shared_name}")))

  def update_step(self, gradient, variable):
    dtype = variable.dtype
    m, v, phi, last = self._slots[self._index_dict[self._var_key(variable)]]
    step = self.iterations + 1
    beta_1, beta_2 = tf.constant(self.beta_1, dtype), tf.constant(self.beta_2, dtype)
    noise_variance = tf.cast(self.noise_variance, dtype)
    sparse = isinstance(gradient, tf.IndexedSlices)
    if sparse:
      rows, grad = gradient.indices, gradient.values
      read = lambda slot: tf.gather(slot, rows)
    else:
      grad = gradient
      read = tf.convert_to_tensor
    skipped = tf.cast(step - read(last), dtype)  # 1 + steps since the row's last update
    rank = grad.shape.rank
    decay = lambda beta: _per_row(tf.pow(beta, skipped), rank)
    m_new = decay(beta_1) * read(m) + (1 - beta_1) * grad
    v_new = decay(beta_2) * read(v) + (1 - beta_2) * tf.square(grad)
    phi_new = tf.pow(beta_2, skipped) * read(phi) + (1 - beta_2) * noise_variance
    t = tf.cast(step, dtype)
    m_hat = m_new / (1 - tf.pow(beta_1, t))
    corrected = (v_new - _per_row(phi_new, rank)) / (1 - tf.pow(beta_2, t))
    delta = (tf.cast(self.learning_rate, dtype) * m_hat
             / tf.sqrt(tf.maximum(corrected, tf.constant(self.floor, dtype))))
    if sparse:
      for slot, value in ((m, m_new), (v, v_new), (phi, phi_new),
                          (last, tf.fill(tf.shape(rows), step))):
        slot.scatter_update(tf.IndexedSlices(value, rows))
      return variable.scatter_sub(tf.IndexedSlices(delta, rows))
    m.assign(m_new)
    v.assign(v_new)
    phi.assign(phi_new)
    last.assign(tf.fill(tf.shape(last), step))
    return variable.assign_sub(delta)

  def get_config(self):
    config = super().get_config()
    config.update(learning_rate=self._serialize_hyperparameter(self._learning_rate),
                  beta_1=self.beta_1, beta_2=self.beta_2, floor=self.floor)
    return config


def _per_row(values, rank):
  """Broadcasts per-row `values` [rows] against a tensor of `rank` ([rows, ...])."""
  if rank is None or rank <= 1:
    return values
  return tf.reshape(values, tf.concat([tf.shape(values), tf.ones([rank - 1], tf.int32)], 0))
