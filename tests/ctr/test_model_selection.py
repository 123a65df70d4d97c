"""The non-private baseline's model selection on validation (`--select-on-validation`): the best
step's weights are kept, and a private run refuses it."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.training import callbacks
from dprec.workflows import ctr


def test_best_on_validation_keeps_the_weights_of_the_lowest_score():
  model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1, use_bias=False)])
  model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
  # The target is 1 at every x: the weight climbs towards 1 and past the score's optimum 0.3.
  x, y = np.ones((8, 1), np.float32), np.ones((8, 1), np.float32)
  timer = callbacks.StepTimer()
  chooser = callbacks.BestOnValidation(
      lambda m: abs(float(m.layers[0].kernel.numpy()[0, 0]) - 0.3), every=1, timer=timer)
  model.fit(x, y, batch_size=8, epochs=10, verbose=0, callbacks=[timer, chooser])
  weights = [float(model.layers[0].kernel.numpy()[0, 0])]
  chooser.restore(model)
  kept = float(model.layers[0].kernel.numpy()[0, 0])
  assert len(chooser.scores) == 10 and weights[0] > 0.5
  assert abs(kept - 0.3) == min(chooser.scores.values()) == chooser.scores[chooser.best_step]


@pytest.mark.parametrize("change", [{"algorithm": "dp_sgd", "epsilon": 1.0},
                                    {"run_dir": "run"}, {"select_on_validation": 1.0}])
def test_selection_is_for_a_non_private_run_in_memory(change):
  options = ctr.CTRTrainOptions(data="d", algorithm="non_private", select_on_validation=0.1)
  options.validate()
  with pytest.raises(DprecError, match="--select-on-validation"):
    ctr.CTRTrainOptions(**dict(vars(options), **change)).validate()
