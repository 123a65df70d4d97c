"""Privacy units: the rows of one user clipped as one (user-level DP).

A user-level batch is the flat rows of the sampled users with one more int feature, `UNIT_KEY`:
each row's unit index in [0, U), U the number of users in the batch, the rows of one unit
contiguous and the units in increasing order. The DP step pops it from the features before the
forward pass and clips each unit's summed gradient Σ_{i∈u} g_i to C2 as one, every row of u
weighted by c_u = min(1, C2/‖Σ_{i∈u} g_i‖) (user-level sampling, ULS: Charles et al. 2024,
"Fine-tuning large language models with user-level differential privacy", arXiv:2407.07737,
Algorithm 2; Chua et al. 2024, "Mind the privacy unit! User-level differential privacy for
language model fine-tuning", arXiv:2406.14322). Without the feature every row is its own unit.
"""
import tensorflow as tf

from dprec.errors import DprecError
from dprec.privacy_unit import UNIT_KEY


class Units:
  """The unit of every row of a batch, and the maps between rows and units.

  `unit` [B]: each row's unit; `count` U; `position` [B]: each row's index within its unit;
  `most`: the most rows of a unit in the batch (k_max)."""

  def __init__(self, unit):
    unit = tf.reshape(tf.cast(unit, tf.int64), [-1])
    ordered = tf.debugging.assert_non_negative(
        unit[1:] - unit[:-1], message=f"the feature {UNIT_KEY!r} must list each unit's rows "
        "together, units in increasing order")
    with tf.control_dependencies([ordered]):
      self.unit = tf.identity(unit)
    self.count = tf.reduce_max(tf.concat([self.unit + 1, [0]], axis=0))
    starts = tf.searchsorted(self.unit, tf.range(self.count), side="left", out_type=tf.int64)
    self.position = tf.range(tf.size(self.unit, out_type=tf.int64)) - tf.gather(starts, self.unit)
    self.most = tf.reduce_max(tf.concat([self.position + 1, [0]], axis=0))

  def sum(self, tensor):
    """[B, ...] → [U, ...]: each unit's rows summed."""
    return tf.math.unsorted_segment_sum(tensor, self.unit, self.count)

  def pad(self, tensor):
    """[B, ...] → [U, k_max, ...]: each unit's rows in order, zeros after its last."""
    shape = tf.concat([tf.stack([self.count, self.most]),
                       tf.shape(tensor, out_type=tf.int64)[1:]], axis=0)
    return tf.scatter_nd(tf.stack([self.unit, self.position], axis=1), tensor, shape)

  def of(self, rows):
    """The units of `rows` (row indices)."""
    return tf.gather(self.unit, rows)

  def of_rows(self, per_unit):
    """[U] → [B]: each row gets its unit's value."""
    return tf.gather(per_unit, self.unit)


def split_units(features):
  """(features without `UNIT_KEY`, their `Units`), or (features, None) at row level: features
  that are not a dict, or a dict without the key."""
  if not isinstance(features, dict) or UNIT_KEY not in features:
    return features, None
  rest = {name: value for name, value in features.items() if name != UNIT_KEY}
  unit = features[UNIT_KEY]
  if not isinstance(unit, (tf.RaggedTensor, tf.SparseTensor)):
    unit = tf.convert_to_tensor(unit)
  if isinstance(unit, (tf.RaggedTensor, tf.SparseTensor)) or not unit.dtype.is_integer:
    raise DprecError(f"the feature {UNIT_KEY!r} must be a dense integer tensor (each row's "
                     f"unit index), got {type(unit).__name__} of {unit.dtype.name}")
  return rest, Units(unit)

