"""What `fit` of a private model takes as data: in-memory arrays, dicts or a finite dataset,
flattened to `{input_i: array}` for Poisson sampling and packed back into the model's structure."""
import numpy as np
import tensorflow as tf

from dprec.errors import DprecError
from dprec.workflows.private_options import PREDICT_BATCH


def keys(structure):
  """The flat feature names of a structure of inputs: input_0, input_1, …"""
  return [f"input_{i}" for i in range(len(tf.nest.flatten(structure)))]


def packer(structure, with_labels):
  """features {input_i: tensor} (and labels) → the model's input structure (and labels)."""
  names = keys(structure)

  def pack(features, labels=None):
    packed = tf.nest.pack_sequence_as(structure, [features[k] for k in names])
    return (packed, labels) if with_labels else packed

  return pack


def in_memory(x, y):
  """(features {input_i: array}, labels or None, the structure of x) of in-memory data or a
  finite dataset of (x, y) or of features (a TFRS model's, labels inside)."""
  if isinstance(x, tf.data.Dataset):
    if y is not None:
      raise DprecError("give y inside the dataset, not beside it")
    dataset = x
    leaves = tf.nest.flatten(dataset.element_spec)
    if not all(spec.shape.rank and spec.shape[0] is None for spec in leaves):
      dataset = dataset.batch(PREDICT_BATCH)  # unbatched elements
    parts = list(dataset.as_numpy_iterator())
    if not parts:
      raise DprecError("the training dataset is empty")
    element = tf.nest.map_structure(lambda *a: np.concatenate(a), *parts)
    if isinstance(element, tuple) and len(element) == 2:
      x, y = element
    elif isinstance(element, tuple) and len(element) == 3:
      raise DprecError("make_private's fit does not take sample weights")
    else:
      x = element
  leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(x)]
  if not leaves:
    raise DprecError("fit needs training features")
  structure = tf.nest.map_structure(lambda _: 0, x)
  features = dict(zip(keys(structure), leaves))
  for key, leaf in features.items():
    if leaf.dtype.kind in "OU":  # str → bytes, which tf.data holds as tf.string
      features[key] = leaf.astype(bytes)
  return features, (None if y is None else np.asarray(y)), structure
