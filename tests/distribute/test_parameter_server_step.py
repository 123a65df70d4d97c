"""One DP step with the tables sharded by rows over 2 parameter servers (ParameterServerStrategy,
2 workers, in-process servers in a process of their own: `ps_steps.py`), scheduled by the
coordinator, equals the one-device step with the same insecure key and batch; rows outside the
kept set and their optimizer slots are bit-identical before and after it."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from dprec.distribute import parameter_server
from dprec.models import dp_step

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture
def saved(once_per_session):
  """The arrays `ps_steps.py` saves: its process runs once a session."""
  def run(out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])), TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, os.path.join(HERE, "ps_steps.py"), str(out / "steps.npz")],
                   env=env, check=True, timeout=300)

  out, _ = once_per_session("parameter_server_steps", run)
  with np.load(out / "steps.npz") as data:
    return dict(data)


def _state(saved, config, tag):
  prefix = f"{config}/{tag}/"
  return {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["dp_sgd", "dp_adafest", "dp_adafest_adam",
                                    "dp_adafest_stacked"])
def test_parameter_server_step_equals_one_device_step(saved, config):
  single, sharded = _state(saved, config, "single_after"), _state(saved, config, "ps_after")
  assert sorted(single) == sorted(sharded) and len(single) >= 6
  for name, want in single.items():
    np.testing.assert_allclose(sharded[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert not np.array_equal(want, _state(saved, config, "single_before")[name]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["dp_adafest_adam", "dp_sgd"])
def test_rows_outside_the_kept_set_and_their_slots_are_untouched(saved, config):
  before, after = _state(saved, config, "ps_before"), _state(saved, config, "ps_after")
  for f in range(2):
    kept = saved[f"{config}/kept{f}"]
    rows = before[f"table{f}"].shape[0]
    outside = np.setdiff1d(np.arange(rows), kept)
    if config == "dp_sgd":
      assert outside.size == 0  # every row is noised: the dense baseline
    else:  # some kept rows on each of the table's two shards, most rows outside
      assert kept.min() < rows // 2 <= kept.max() and outside.size > rows // 2
    for name in [n for n in (f"table{f}", f"table{f}_m", f"table{f}_v") if n in before]:
      np.testing.assert_array_equal(after[name][outside], before[name][outside], err_msg=name)
      assert np.all(np.any(after[name][kept] != before[name][kept], axis=1)), name


@pytest.mark.multiprocess
def test_concurrent_steps_lose_no_update(saved):
  """8 steps on 2 workers: the chief applies every step's update once, one at a time, so the
  step count is 8 and, under SGD, each table moved by exactly −lr × Σ applied updates (under
  Hogwild two steps' read-modify-writes of one row could overwrite each other)."""
  assert saved["concurrent/iterations"] == 8
  for f in range(2):
    before, after = saved[f"concurrent/before/table{f}"], saved[f"concurrent/after/table{f}"]
    applied = saved[f"concurrent/applied/table{f}"]
    assert np.count_nonzero(applied.any(axis=1)) > 0
    learning_rate = saved["concurrent/learning_rate"]
    np.testing.assert_allclose(after, before - learning_rate * applied, rtol=1e-5, atol=1e-6)


def test_shard_gradients_route_rows_to_their_shard():
  shards = [tf.Variable(tf.zeros([3, 2])), tf.Variable(tf.zeros([2, 2]))]
  table = tf.__internal__.distribute.ShardedVariable(shards)
  values = tf.constant([[1., 1.], [2., 2.], [3., 3.]])
  pairs = dp_step.shard_gradients(
      tf.IndexedSlices(values, tf.constant([0, 3, 4], tf.int64), tf.constant([5, 2], tf.int64)),
      table)
  assert [v is s for (_, v), s in zip(pairs, shards)] == [True, True]
  np.testing.assert_array_equal(pairs[0][0].indices, [0])
  np.testing.assert_array_equal(pairs[1][0].indices, [0, 1])
  np.testing.assert_array_equal(pairs[1][0].values, [[2., 2.], [3., 3.]])
  dense = dp_step.shard_gradients(tf.reshape(tf.range(10.), [5, 2]), table)
  assert [g.shape.as_list() for g, _ in dense] == [[3, 2], [2, 2]]


def test_the_scheduled_step_is_traced_once_for_every_batch_size(steps):
  """Poisson batches vary in size: the step's signature leaves the batch dimension open, so a
  run traces it once (it retraced for every new size: minutes of a short run), and so does the
  chief's apply of its update (the kept rows' count varies)."""
  model = steps.build_model(steps.CONFIGS["dp_adafest"])
  features, labels = steps.data()
  state = tf.constant(model.dp_optimizer.generator.state)
  step = parameter_server._ScheduledStep(
      model, ({"cat": features["cat"][:20]}, labels[:20]), state)
  for index, size in enumerate((20, 23, 17, 29)):
    _, update = step.run(({"cat": features["cat"][:size]}, labels[:size]), state,
                         tf.constant(index, tf.int64))
    step.apply(update)
  assert step.run.experimental_get_tracing_count() == 1
  assert step._apply_function.experimental_get_tracing_count() == 1


def test_the_step_defers_its_update_to_the_caller(steps):
  """Run on a worker, the step computes its noisy update and applies nothing: the weights and
  the optimizer's slots change only when the chief applies the update, once."""
  model = steps.build_model(steps.CONFIGS["dp_adafest"])
  features, labels = steps.data()
  state = tf.constant(model.dp_optimizer.generator.state)
  step = parameter_server._ScheduledStep(
      model, ({"cat": features["cat"][:20]}, labels[:20]), state)
  before = [v.numpy() for v in model.variables]
  _, update = step.run(({"cat": features["cat"]}, labels), state, tf.constant(0, tf.int64))
  _, again = step.run(({"cat": features["cat"]}, labels), state, tf.constant(0, tf.int64))
  for b, v in zip(before, model.variables):
    if "gradient_size" not in v.name and "count" not in v.name and "total" not in v.name:
      np.testing.assert_array_equal(b, v.numpy(), err_msg=v.name)
  for first, second in zip(tf.nest.flatten(update), tf.nest.flatten(again)):  # a re-run: same
    np.testing.assert_array_equal(first, second)
  step.apply(update)
  assert model.optimizer.iterations.numpy() == 1
  assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
