"""What the make_private tests share: the Keras a test builds its model with."""
import importlib.metadata

import pytest
import tensorflow as tf


@pytest.fixture
def keras3():
  """Keras 3 (`import keras`), skipping the test where `keras` is Keras 2 (TF 2.15), unimported:
  there the keras package's classes would shadow tf-keras' when a saved model loads."""
  if int(importlib.metadata.version("keras").split(".")[0]) < 3:
    pytest.skip("Keras 3 is not installed")
  import keras
  return keras


@pytest.fixture(params=["tf_keras", "keras3"])
def keras_api(request):
  """The Keras a test builds its model with: tf.keras (Keras 2), or Keras 3."""
  return tf.keras if request.param == "tf_keras" else request.getfixturevalue("keras3")
