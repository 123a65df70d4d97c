"""Optimizers whose update for a `tf.IndexedSlices` gradient touches only its rows.

Stock Keras 2.15 optimizers compile their update with XLA by default, which turns a row
scatter into a copy of the whole table (a 10M×55 embedding: SGD 11.7 s, Adam 16.4 s per step
here), and Adam decays every row's moments on every step. These run without XLA: SGD with a
row scatter, Keras' own row-sparse Adagrad update, and a lazy Adam that updates the moments
of the gradient's rows only (dense variables get the ordinary Adam update).
"""
import tensorflow as tf


class SparseSGD(tf.keras.optimizers.SGD):
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


class SparseAdagrad(tf.keras.optimizers.Adagrad):
  """Adagrad; an IndexedSlices gradient updates its rows and their accumulators only."""

  def __init__(self, learning_rate=0.05, name="SparseAdagrad", **kwargs):
    kwargs["jit_compile"] = False
    super().__init__(learning_rate=learning_rate, name=name, **kwargs)


class LazyAdam(tf.keras.optimizers.Adam):
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
    dtype = variable.dtype
    step = tf.cast(self.iterations + 1, dtype)
    beta_1 = tf.cast(self.beta_1, dtype)
    beta_2 = tf.cast(self.beta_2, dtype)
    alpha = (tf.cast(self.learning_rate, dtype) * tf.sqrt(1 - tf.pow(beta_2, step))
             / (1 - tf.pow(beta_1, step)))
    index = self._index_dict[self._var_key(variable)]
    m, v = self._momentums[index], self._velocities[index]
    rows, values = gradient.indices, gradient.values
    m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
    v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
    m.scatter_update(tf.IndexedSlices(m_rows, rows))
    v.scatter_update(tf.IndexedSlices(v_rows, rows))
    return variable.scatter_sub(
        tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + self.epsilon), rows))
