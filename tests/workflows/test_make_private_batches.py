"""`make_private`'s fit from the run's Poisson batches on disk: the streamed fit ends
where the in-memory fit given the same batches ends, in tf.keras and Keras 3; `write_batches`
runs the Beam job and a cap B_max truncates its batches at the δ the ledger is charged; a fit
asking for more steps than the batches hold stops after the last shard, paying for none beyond;
each bad input is refused in one line naming it."""
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import dprec
from dprec.errors import DprecError
from dprec.privacy import truncation
from dprec.training import batch_shards
from dprec.training import poisson
from dprec.workflows import plan as plan_lib
from dprec.workflows import private_batches

N, VOCAB, BATCH, SEED = 240, 30, 24, 3
IN_PROCESS = ["--direct_num_workers=1", "--direct_running_mode=in_memory"]
FEATURES = {"ids": tf.io.FixedLenFeature([2], tf.int64),
            "x": tf.io.FixedLenFeature([3], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.float32)}


def _data():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, VOCAB, (N, 2))
  x = rng.normal(size=(N, 3)).astype(np.float32)
  label = ((ids[:, 0] % 3 == 0) ^ (x[:, 0] > 1)).astype(np.float32)
  return {"ids": ids, "x": x}, label


def _records(features, label):
  return [tf.train.Example(features=tf.train.Features(feature={
      "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=features["ids"][i])),
      "x": tf.train.Feature(float_list=tf.train.FloatList(value=features["x"][i])),
      "label": tf.train.Feature(float_list=tf.train.FloatList(value=[label[i]])),
  })).SerializeToString() for i in range(len(label))]


def parse(serialized):
  row = tf.io.parse_example(serialized, FEATURES)
  return {"ids": row["ids"], "x": row["x"]}, row["label"]


def _model(keras):
  keras.utils.set_random_seed(0)  # the same initial weights in every model
  ids = keras.Input((2,), dtype="int64", name="ids")
  x = keras.Input((3,), name="x")
  joined = keras.layers.Concatenate()([
      keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4, name="table")(ids)), x])
  return keras.Model({"ids": ids, "x": x}, keras.layers.Dense(1, name="logit")(joined))


def _private(keras, **options):
  model = dprec.make_private(_model(keras), epsilon=2.0, train_size=N, batch_size=BATCH,
                             algorithm="dp_sgd", insecure_noise_seed=SEED, **options)
  model.compile(optimizer=keras.optimizers.SGD(0.5),
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  return model


def _input_file(tmp_path):
  path = str(tmp_path / "rows.tfrecord")
  with tf.io.TFRecordWriter(path) as writer:
    for record in _records(*_data()):
      writer.write(record)
  return path


def _write_directory(model, directory, batches, inputs):
  """`batches` (index arrays, one a step) of the rows as this model's run's batch directory."""
  records = _records(*_data())
  os.makedirs(directory, exist_ok=True)
  entries = [batch_shards.write_shard(directory, step, [records[i] for i in batch])
             for step, batch in enumerate(batches)]
  run, plan = model._private.run, model.privacy_plan
  manifest = batch_shards.manifest_of(run.run_id, batch_shards.key_fingerprint(run.key),
                                      False, private_batches.plan_fields(plan), [inputs], entries)
  with open(os.path.join(directory, batch_shards.MANIFEST), "w", encoding="utf-8") as stream:
    json.dump(manifest, stream)


def test_a_streamed_fit_ends_where_the_in_memory_fit_on_the_same_batches_ends(keras_api,
                                                                             tmp_path):
  keras = keras_api
  with pytest.warns(UserWarning):
    in_memory = _private(keras)
    streamed = _private(keras)
  for got, expected in zip(streamed.get_weights(), in_memory.get_weights()):
    np.testing.assert_array_equal(got, expected)
  plan = in_memory.privacy_plan
  entropy = in_memory._private.run.key.entropy("poisson", 0)
  drawn = list(poisson.batch_indices(N, poisson.BatchSampling(BATCH, True, entropy), plan.steps))
  directory = str(tmp_path / "batches")
  _write_directory(streamed, directory, drawn, _input_file(tmp_path))

  in_memory.fit(*_data(), epochs=1, verbose=0)
  streamed.fit(dprec.PoissonBatches(directory, parse), epochs=1, verbose=0)
  for got, expected in zip(streamed.get_weights(), in_memory.get_weights()):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert streamed.epsilon_spent == pytest.approx(in_memory.epsilon_spent)
  assert streamed.privacy_ledger.charges[-1]["steps"] == plan.steps


def test_write_batches_truncated_to_a_cap_charge_its_delta_and_train(tmp_path):
  unbounded = _private(tf.keras)
  plan = unbounded.privacy_plan
  cap = truncation.smallest_max_batch_size(N, plan.sampling_rate, plan.steps, 2.0,
                                           truncation.MAX_DELTA_SHARE * plan.delta)
  with pytest.warns(UserWarning):
    model = _private(tf.keras, max_batch_size=cap)
  capped = model.privacy_plan
  assert capped.truncation_delta == pytest.approx(truncation.truncation_delta(
      N, plan.sampling_rate, plan.steps, cap, 2.0)) and 0 < capped.truncation_delta
  assert capped.noise_multiplier > plan.noise_multiplier  # training keeps δ − δ_trunc

  batches = model.write_batches([_input_file(tmp_path)], str(tmp_path / "batches"), parse,
                                IN_PROCESS)
  with open(os.path.join(batches.directory, batch_shards.MANIFEST), encoding="utf-8") as stream:
    manifest = json.load(stream)
  assert manifest["plan"]["max_batch_size"] == cap
  assert manifest["peak_batch_size"] <= cap and manifest["run_id"] == model._private.run.run_id
  model.fit(batches, verbose=0)
  charges = {c["label"]: c for c in model.privacy_ledger.charges}
  assert charges[truncation.LABEL]["delta"] == capped.truncation_delta
  assert charges["make_private training"]["steps"] == capped.steps
  assert model.epsilon_spent <= 2.0 * (1 + 1e-6)


def _model_and_its_batches(tmp_path):
  """A private model and a valid batch directory of its run, in `tmp_path`: step s holds rows
  s, s + T, s + 2T, ..."""
  with pytest.warns(UserWarning):
    model = _private(tf.keras)
  steps = model.privacy_plan.steps
  directory = str(tmp_path / "batches")
  _write_directory(model, directory, [np.arange(s, N, steps) for s in range(steps)],
                   _input_file(tmp_path))
  return model, directory


def test_a_fit_asking_for_more_steps_than_the_batches_hold_stops_after_the_last_shard(
    tmp_path, monkeypatch, caplog):
  """Budget to spare (σ 1.5 times the calibrated one; at thousands of steps ε(T + k) fits the
  calibration's slack for some k > 0): fit(epochs=2) of a one-epoch plan trains its T shards
  once, pays for T steps, stops with a warning naming the directory, the steps held and asked
  (not Keras' "ran out of data"), and a further fit is refused."""
  calibrated = plan_lib._calibrated
  monkeypatch.setattr(plan_lib, "_calibrated", lambda *args: 1.5 * calibrated(*args))
  model, directory = _model_and_its_batches(tmp_path)
  steps = model.privacy_plan.steps
  with pytest.warns(UserWarning) as warned:
    model.fit(dprec.PoissonBatches(directory, parse), epochs=2, verbose=0)
  assert [str(w.message) for w in warned if directory in str(w.message)] == [
      f"{directory}: fit asked for {2 * steps} steps from step 0, but the run's batches hold "
      f"its {steps} planned steps: training stopped after the last shard (step {steps - 1})"]
  assert "ran out of data" not in caplog.text
  assert model._private.steps == steps
  charges = {c["label"]: c for c in model.privacy_ledger.charges}
  assert charges["make_private training"]["steps"] == steps
  with pytest.raises(DprecError, match=f"all {steps} planned steps are trained"):
    model.fit(dprec.PoissonBatches(directory, parse), verbose=0)


def _another_run(manifest):
  manifest["run_id"] = "0" * 16


def _another_key(manifest):
  manifest["key_fingerprint"] = "0" * 64


def _another_plan(manifest):
  manifest["plan"]["batch_size"] += 1


@pytest.fixture(scope="module")
def drawn_directory(tmp_path_factory):
  """A model and a valid batch directory of its run (module-wide: each case copies it)."""
  return _model_and_its_batches(tmp_path_factory.mktemp("drawn"))


@pytest.mark.parametrize("break_it, message", [
    (_another_run, "batches of run 0000000000000000, not of this run"),
    (_another_key, "batches drawn with another key than this run's"),
    (_another_plan, "batches drawn for the plan"),
    ("unfinished", "no manifest: the batch job did not finish"),
    ("missing", "step-00000002.tfrecord: missing: the shard of step 2"),
    ("truncated", "step-00000001.tfrecord: 10 bytes, the manifest says"),
    ("inputs", "its inputs hold 120 records, but make_private was planned for train_size=240"),
    ("y", "fit on Poisson batches takes no y"),
])
def test_bad_batches_are_refused_in_one_line(drawn_directory, tmp_path, break_it, message):
  model, original = drawn_directory
  directory = str(tmp_path / "copy")
  shutil.copytree(original, directory)
  path = os.path.join(directory, batch_shards.MANIFEST)
  y = None
  if callable(break_it):
    with open(path, encoding="utf-8") as stream:
      manifest = json.load(stream)
    break_it(manifest)
    with open(path, "w", encoding="utf-8") as stream:
      json.dump(manifest, stream)
  elif break_it == "unfinished":
    os.remove(path)
  elif break_it == "missing":
    os.remove(os.path.join(directory, batch_shards.shard_name(2)))
  elif break_it == "truncated":
    with open(os.path.join(directory, batch_shards.shard_name(1)), "r+b") as stream:
      stream.truncate(10)
  elif break_it == "inputs":
    with open(path, encoding="utf-8") as stream:
      manifest = json.load(stream)
    half = str(tmp_path / "half.tfrecord")
    with tf.io.TFRecordWriter(half) as writer:
      for record in _records(*_data())[:N // 2]:
        writer.write(record)
    manifest["inputs"] = [half]
    with open(path, "w", encoding="utf-8") as stream:
      json.dump(manifest, stream)
  else:
    y = _data()[1]
  with pytest.raises(DprecError) as refused:
    model.fit(dprec.PoissonBatches(directory, parse), y, verbose=0)
  assert message in str(refused.value) and "\n" not in str(refused.value)
  assert model._private.steps == 0 and not model._private.initialised


def test_write_batches_before_compile_and_a_cap_the_plan_cannot_afford_are_refused():
  model = dprec.make_private(_model(tf.keras), epsilon=2.0, train_size=N, batch_size=BATCH,
                             insecure_noise_seed=SEED)
  with pytest.raises(DprecError, match="compile the private model before write_batches"):
    model.write_batches(["rows.tfrecord"], "batches")
  with pytest.raises(DprecError) as refused, pytest.warns(UserWarning):
    _private(tf.keras, max_batch_size=BATCH)
  assert "the plan allows a cap of at least" in str(refused.value)
  assert "\n" not in str(refused.value)
