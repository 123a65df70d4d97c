"""The budget callback pays the ledger before steps run and stops exactly at the budget."""
import glob

import numpy as np
import pytest
import tensorflow as tf

from dprec import privacy
from dprec.errors import BudgetExceededError
from dprec.training import callbacks

SIGMA, Q, DELTA = 1.0, 0.1, 1e-5


def _tiny_model():
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
  model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
  return model


def _data():
  return tf.data.Dataset.from_tensors((np.ones((4, 2), np.float32), np.ones((4, 1)))).repeat()


def _epsilon(steps):
  return privacy.compute_epsilon(SIGMA, Q, steps, DELTA).epsilon


def _ledger_steps(ledger):
  return sum(c["steps"] for c in ledger.charges if "steps" in c)


def test_stops_before_the_first_unaffordable_step(tmp_path):
  budget = (_epsilon(23) + _epsilon(24)) / 2  # affords exactly 23 steps
  ledger = privacy.PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=budget, delta=DELTA)
  budget_callback = callbacks.PrivacyBudgetCallback(ledger, SIGMA, Q, charge_every=10)
  timer = callbacks.StepTimer()
  history = _tiny_model().fit(_data(), epochs=1, steps_per_epoch=100,
                              callbacks=[budget_callback, timer], verbose=0)
  assert timer.steps == budget_callback.steps_taken == 23
  assert budget_callback.stopped_at_budget
  reloaded = privacy.PrivacyLedger(tmp_path / "ledger.json")
  assert _ledger_steps(reloaded) == 23
  assert reloaded.epsilon_spent() == pytest.approx(_epsilon(23), rel=1e-9)
  assert history.history["epsilon"][-1] == pytest.approx(_epsilon(23), rel=1e-9)


def test_a_full_run_charges_exactly_its_steps(tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=10.0, delta=DELTA)
  budget_callback = callbacks.PrivacyBudgetCallback(ledger, SIGMA, Q, poisson=False,
                                                    charge_every=7, label="run")
  _tiny_model().fit(_data(), epochs=1, steps_per_epoch=30, callbacks=[budget_callback],
                    verbose=0)
  assert budget_callback.steps_taken == _ledger_steps(ledger) == 30
  assert not budget_callback.stopped_at_budget
  assert all(c["poisson"] is False for c in ledger.charges)  # fixed batches are flagged
  assert ledger.epsilon_spent() == pytest.approx(_epsilon(30), rel=1e-9)


def test_refuses_to_start_when_not_one_step_fits(tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=_epsilon(1) / 2,
                                 delta=DELTA)
  model = _tiny_model()
  before = model.get_weights()
  with pytest.raises(BudgetExceededError, match="single step"):
    model.fit(_data(), epochs=1, steps_per_epoch=5,
              callbacks=[callbacks.PrivacyBudgetCallback(ledger, SIGMA, Q)], verbose=0)
  for old, new in zip(before, model.get_weights()):
    np.testing.assert_array_equal(old, new)
  assert ledger.charges == []


def test_writes_epsilon_and_gradient_size_to_tensorboard(tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=10.0, delta=DELTA)

  class FakeGradientSize(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      logs["gradient_size_reduction"] = 2.0

  budget_callback = callbacks.PrivacyBudgetCallback(ledger, SIGMA, Q, charge_every=3,
                                                    log_dir=str(tmp_path / "tb"))
  _tiny_model().fit(_data(), epochs=1, steps_per_epoch=4,
                    callbacks=[FakeGradientSize(), budget_callback], verbose=0)
  tags = set()
  for path in glob.glob(str(tmp_path / "tb" / "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(value.tag for value in event.summary.value)
  assert {"privacy/epsilon", "gradient_size/gradient_size_reduction"} <= tags


def test_a_resumed_run_counts_the_paid_steps_it_trains_again_and_pays_none_of_them(tmp_path):
  """Resumed at step 4 with 6 steps paid (charged ahead, then a fault): steps 4 and 5 are
  re-run, not charged again (the summary's `rerun_steps`); charging resumes at step 6."""
  ledger = privacy.PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=100.0, delta=DELTA)
  ledger.charge_gaussian(SIGMA, Q, 6, label="train")
  budget_callback = callbacks.PrivacyBudgetCallback(ledger, SIGMA, Q, charge_every=1,
                                                    steps_taken=4, steps_charged=6, label="train")
  assert budget_callback.rerun_steps == 2
  _tiny_model().fit(_data(), epochs=1, steps_per_epoch=4, callbacks=[budget_callback], verbose=0)
  assert _ledger_steps(ledger) == 8
