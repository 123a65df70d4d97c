"""`dprec.make_private` for a Keras 3 model (TensorFlow backend): the private class of the Keras 3
binding (`dprec.models.keras3.Keras3DPModel`), imported only when a Keras 3 model is made
private. Every trainable `keras.layers.Embedding` stays as it is and trains as a DP table; the
plan, `fit`, the ledger, the output bias and the recalibration are `PrivateTraining`'s, as for
tf.keras.
"""
import sys

import keras

from dprec.errors import DprecError
from dprec.models import keras3
from dprec.workflows import private_training


class Keras3PrivateModel(private_training.PrivateTraining, keras3.Keras3DPModel):
  """The private class of a Keras 3 model."""

  keras_module = keras

  @staticmethod
  def row_sparse(optimizer):
    """Keras 3's Adam (without AMSGrad) as `keras3.LazyAdam`, same hyperparameters; its SGD and
    Adagrad update an IndexedSlices gradient's rows only already."""
    optimizer = keras.optimizers.get(optimizer)
    if type(optimizer) is not keras.optimizers.Adam or optimizer.amsgrad:
      return optimizer
    return keras3.LazyAdam.from_config(optimizer.get_config())

  def prepare_private(self):
    """Refuses another backend, an overridden `compute_loss`, tf.keras layers inside, and
    stateful layers."""
    keras3.check_backend()
    _refuse_own_compute_loss(type(self).__bases__[1])
    private_training.refuse_mixed_keras([self, *keras3.layers(self)], _tf_keras_layer(),
                                     "Keras 3", "tf.keras (Keras 2)")
    private_training.refuse_stateful(self)
    _keep_registered_name(type(self), type(self).__bases__[1])


def _refuse_own_compute_loss(original):
  """Refuses a model class whose `compute_loss` is its own (KerasRS' retrieval examples put the
  loss there): the DP step takes per-example losses from compile's `loss` and would never call
  it, training on another loss."""
  if original.compute_loss is not keras.Model.compute_loss:
    raise DprecError(f"make_private takes each example's loss from compile(loss=...), and "
                     f"{original.__name__} overrides compute_loss, which the DP step would not "
                     "call: return the scores from call() and compile with a per-example loss")


def _keep_registered_name(private, original):
  """Saves the private class under the name the user registered the original by
  (`keras.saving.register_keras_serializable`), so a saved model loads as the original; the
  name stays the original's."""
  name = keras.saving.get_registered_name(original)
  if name == original.__name__:  # not registered: saved by module and class name
    return
  package, _, short = name.rpartition(">")
  for cls in (private, original):  # the original last: loading finds it
    keras.saving.register_keras_serializable(package, short)(cls)


def _tf_keras_layer():
  """tf-keras' Layer class if the process imported tf-keras, else a tuple of no class (no
  tf.keras layer can exist)."""
  tf_keras = sys.modules.get("tf_keras")
  return tf_keras.layers.Layer if tf_keras is not None else ()
