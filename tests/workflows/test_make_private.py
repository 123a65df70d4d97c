"""`dprec.make_private`: the conversion keeps weights and names and saves/loads; the
DP step it makes bounds one example's influence by C2 (functional, TFRS ranking and full-softmax
two-tower models; in-batch negatives do not); ε equals dp_accounting's; training stops at the
budget; the refusals name what they refuse. Tests taking `keras_api` run on a tf.keras and a
Keras 3 model (`import keras`, skipped where `keras` is Keras 2), and a whole private `fit` of
one model gives the same weights in both."""
import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import dprec
from dprec.errors import DprecError
from dprec.layers.embedding import DPEmbedding
from dprec.models import retrieval
from dprec.models.dp_model import DPModel
from dprec.optimizers import DPOptimizer
from dprec.optimizers import config as config_lib
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.sparse import selection
from dprec.training import poisson
from dprec.workflows import ctr as ctr_workflow
from dprec.workflows import private_inputs
from dprec.workflows import private_options
from dprec.workflows import private_training

tfrs = pytest.importorskip("tensorflow_recommenders")

USERS, ITEMS, N, CLIP = 30, 40, 256, 0.5


def _is_tf_keras(keras_api):
  return keras_api is tf.keras


def _data(seed=0):
  rng = np.random.default_rng(seed)
  users = rng.integers(0, USERS, N).astype(np.int32)
  items = rng.integers(0, ITEMS, N).astype(np.int32)
  ratings = (1 + (users + items) % 5).astype(np.float32)
  return {"user": users, "item": items}, ratings


def _functional(keras_api=tf.keras):
  keras_api.utils.set_random_seed(0)
  layers = keras_api.layers
  user = keras_api.Input((), dtype="int32", name="user")
  item = keras_api.Input((), dtype="int32", name="item")
  joined = layers.Concatenate()([layers.Embedding(USERS, 4, name="user_table")(user),
                                 layers.Embedding(ITEMS, 4, name="item_table")(item)])
  hidden = layers.Dense(8, activation="relu", name="hidden")(joined)
  return keras_api.Model({"user": user, "item": item}, layers.Dense(1, name="rating")(hidden))


class _Ranking(tfrs.models.Model):
  """The TFRS tutorial's shape: Sequential towers of embeddings, a Ranking task."""

  def __init__(self):
    super().__init__()
    self.users = tf.keras.Sequential([tf.keras.layers.Embedding(USERS, 4)])
    self.items = tf.keras.Sequential([tf.keras.layers.Embedding(ITEMS, 4)])
    self.head = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"),
                                     tf.keras.layers.Dense(1)])
    self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError(),
                                   metrics=[tf.keras.metrics.RootMeanSquaredError()])

  def call(self, features):
    return self.head(tf.concat([self.users(features["user"]), self.items(features["item"])], 1))

  def compute_loss(self, features, training=False):
    labels = features.pop("rating")
    return self.task(labels=labels, predictions=self(features))


def _private(model, **options):
  options = dict(dict(epsilon=1.0, train_size=N, batch_size=32, algorithm="dp_sgd",
                      l2_norm_clip=CLIP, insecure_noise_seed=0), **options)
  with warnings.catch_warnings():  # the insecure seed (reproducible tests) is flagged
    warnings.simplefilter("ignore", InsecureNoiseWarning)
    return dprec.make_private(model, **options)


def _table_class(keras_api):
  """What an Embedding of `keras_api` is after make_private: a DPEmbedding (tf.keras), itself
  (Keras 3)."""
  return DPEmbedding if _is_tf_keras(keras_api) else keras_api.layers.Embedding


def test_conversion_keeps_weights_and_names_and_a_saved_model_predicts_the_same(tmp_path,
                                                                                keras_api):
  model = _functional(keras_api)
  original = type(model)
  before = {layer.name: [w.copy() for w in layer.get_weights()] for layer in model.layers}
  private = _private(model)
  assert private is model
  assert type(model.get_layer("user_table")) is _table_class(keras_api)
  for layer in model.layers:
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in before[layer.name]] or [[]]),
                                  np.concatenate([w.ravel() for w in layer.get_weights()] or [[]]))
  model.compile(optimizer="adam", loss="mse")
  x, y = _data()
  model.fit(x, y, epochs=1, verbose=0)
  model.save(tmp_path / "model.keras")
  loaded = keras_api.models.load_model(tmp_path / "model.keras")
  assert type(loaded) is original
  if not _is_tf_keras(keras_api):  # Keras 3's LazyAdam is saved as the Adam it replaced
    assert type(loaded.optimizer) is keras_api.optimizers.Adam
  assert type(loaded.get_layer("item_table")) is _table_class(keras_api)
  np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                             rtol=1e-6)


def _dense(gradient):
  return tf.convert_to_tensor(gradient).numpy().ravel()


@pytest.mark.parametrize("kind", ["functional", "tfrs", "adaptive"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c2(kind, keras_api):
  if kind == "tfrs" and not _is_tf_keras(keras_api):
    pytest.skip("TFRS models are tf.keras models")
  adaptive = dict(target_quantile=0.5, l2_norm_clip=7.0) if kind == "adaptive" else {}
  model = _private(_Ranking() if kind == "tfrs" else _functional(keras_api), **adaptive)
  model.compile(optimizer="sgd", loss=None if kind == "tfrs" else "mse")
  if kind == "adaptive":  # C2 from the clip variable (set to CLIP), without noise
    model.dp_optimizer.config = dataclasses.replace(model.dp_optimizer.config,
                                                    noise_multiplier=0.0)
    model.dp_optimizer.clip.assign(CLIP)
    model._update_clip = lambda *args: None
  else:
    model.dp_optimizer.config = config_lib.DPSGD(l2_norm_clip=CLIP, noise_multiplier=0.0)
  x, y = _data()
  x = {k: v[:16] for k, v in x.items()}
  y = 100 * y[:16]
  # Builds it, as the first fit does; far from the predictions: every example is clipped to C2.
  model._initialise(*private_inputs.in_memory(x, y))

  def clipped_sum(rows):
    features = {k: tf.constant(v[rows]) for k, v in x.items()}
    if kind == "tfrs":
      features["rating"] = tf.constant(y[rows])
      grads = model.dp_gradients(features, None)
    else:
      grads = model.dp_gradients(features, tf.constant(y[rows]))
    order = sorted(range(len(grads)), key=lambda i: grads[i][1].name)
    return np.concatenate([_dense(grads[i][0]) for i in order]) * model.dp_optimizer \
        .expected_batch_size

  full = clipped_sum(np.arange(16))
  for removed in (0, 7):
    difference = np.linalg.norm(full - clipped_sum(np.delete(np.arange(16), removed)))
    assert difference <= CLIP * (1 + 1e-4)
    assert difference >= 0.9 * CLIP  # the removed example's whole clipped gradient


def test_epsilon_equals_dp_accounting_and_training_stops_at_the_budget(keras_api):
  model = _private(_functional(keras_api), epochs=1, label_range=(1.0, 5.0))
  model.compile(optimizer="adagrad", loss="mse")
  plan = model.privacy_plan
  assert plan.steps == N // 32 and plan.sampling_rate == 32 / N
  x, y = _data()
  history = model.fit(x, y, epochs=3, verbose=0)  # asks for three planned epochs' steps
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  for label in (private_options.LABEL_STATISTICS_LABEL, private_options.RECALIBRATION_LABEL):
    accountant.compose(dp_accounting.GaussianDpEvent(plan.mechanisms[label]))
  accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      plan.sampling_rate, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), plan.steps))
  expected = accountant.get_epsilon(1 / N)
  assert model.epsilon_spent == pytest.approx(expected, rel=1e-3)
  assert expected == pytest.approx(1.0, rel=2e-3)
  assert history.history["epsilon"][-1] == pytest.approx(model.epsilon_spent)
  assert model._private.steps == plan.steps  # stopped at the budget, not after 3 epochs
  with pytest.raises(DprecError, match="budget"):
    model.fit(x, y, epochs=1, verbose=0)


def test_quantile_clipping_costs_the_planned_sigma_and_moves_the_clip_in_fit():
  """`target_quantile`: the gradient's σ_Δ and the count's 2σ_b compose to the plan's σ, ε
  equals dp_accounting's for it, and fit (traced) moves C2 away from its start."""
  model = _private(_functional(), epochs=1, label_range=(1.0, 5.0), target_quantile=0.5)
  model.compile(optimizer="adagrad", loss="mse")
  plan, config = model.privacy_plan, model.dp_optimizer.config
  sigma_b = config.quantile_clipping.count_noise_multiplier
  assert sigma_b == max(32 / 20, plan.noise_multiplier)
  assert config.noise_multiplier == pytest.approx(
      (plan.noise_multiplier ** -2 - (2 * sigma_b) ** -2) ** -0.5)
  assert config.accounting_noise_multiplier == pytest.approx(plan.noise_multiplier)
  history = model.fit(*_data(), epochs=1, verbose=0)
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  for label in (private_options.LABEL_STATISTICS_LABEL, private_options.RECALIBRATION_LABEL):
    accountant.compose(dp_accounting.GaussianDpEvent(plan.mechanisms[label]))
  accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      plan.sampling_rate, dp_accounting.GaussianDpEvent(  # the pair as one Gaussian
          (config.noise_multiplier ** -2 + (2 * sigma_b) ** -2) ** -0.5)), plan.steps))
  assert model.epsilon_spent == pytest.approx(accountant.get_epsilon(1 / N), rel=2e-3)
  clip = float(model.dp_optimizer.clip)
  assert history.history["l2_norm_clip"][-1] == pytest.approx(clip)
  assert clip != CLIP


def _large_tables(vocab):
  """A functional model whose one table (vocab × 16 floats) is above `AUTO_DENSE_LIMIT`."""
  ids = tf.keras.Input((), dtype=tf.int32, name="id")
  return tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.keras.layers.Embedding(vocab, 16)(ids)))


def test_auto_on_large_tables_selects_few_rows_by_noise_alone():
  """Tables above `AUTO_DENSE_LIMIT` floats train with DP-AdaFEST at `train ctr`'s (r, τ); a row
  no example touched passes the threshold with probability Ψ(τ/(σ1·C1)): under 1e-3 at ε = 1
  for a data set of 100k, where r = 5, τ = 5 (the old default) kept one row in eight."""
  vocab = private_options.AUTO_DENSE_LIMIT // 16 + 1
  model = dprec.make_private(_large_tables(vocab), epsilon=1.0, train_size=100_000)
  model.compile(loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  config = model.dp_optimizer.config
  assert isinstance(config, config_lib.DPAdaFEST)
  assert config.threshold == ctr_workflow.CTRTrainOptions.threshold
  assert config.contribution_noise_multiplier == pytest.approx(
      ctr_workflow.CTRTrainOptions.ratio * config.noise_multiplier)
  assert selection.false_positive_rate(
      config.threshold, config.contribution_noise_multiplier * config.contribution_clip) < 1e-3
  old = config_lib.DPAdaFEST.from_noise_multiplier(1.0, model.privacy_plan.noise_multiplier,
                                                   ratio=5.0, threshold=5.0,
                                                   contribution_clip=1.0)
  assert selection.false_positive_rate(old.threshold, old.contribution_noise_multiplier) > 0.1


def test_adam_that_cannot_leave_its_initialisation_is_flagged_at_compile():
  """lr·T < `SHORT_ADAM_PATH` warns (Keras' Adam default over 8 planned steps); a larger lr,
  another optimizer or a schedule does not."""
  def warned(optimizer):
    model = _private(_functional())
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      model.compile(optimizer=optimizer, loss="mse")
    assert model.privacy_plan.steps_per_period == N // 32
    return [str(w.message) for w in caught if "lr·steps" in str(w.message)]

  message, = warned(tf.keras.optimizers.Adam())
  assert "learning rate 0.001 over the 8 planned DP steps" in message
  assert not warned(tf.keras.optimizers.Adam(0.1))
  assert not warned(tf.keras.optimizers.Adagrad(1e-3))
  assert not warned(tf.keras.optimizers.Adam(
      tf.keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.9)))


def test_recalibration_is_planned_by_default_when_it_can_run():
  """MSE recalibrates by default given a label range (given, or found with the output bias);
  without one it is skipped by default and refused at compile when asked for."""
  for options, planned in ((dict(), True), (dict(init_output_bias=False), False),
                           (dict(init_output_bias=False, label_range=(1.0, 5.0)), True),
                           (dict(recalibrate=False), False)):
    model = _private(_functional(), **options)
    model.compile(optimizer="sgd", loss="mse")
    assert (private_options.RECALIBRATION_LABEL in model.privacy_plan.mechanisms) == planned
  model = _private(_functional(), init_output_bias=False, recalibrate=True)
  with pytest.raises(DprecError, match="label range"):
    model.compile(optimizer="sgd", loss="mse")


def test_data_sized_batch_and_dp_output_bias():
  x, y = _data()
  model = _private(_functional(), batch_size=None, epsilon=50.0, label_range=(1.0, 5.0),
                   accountant="rdp")  # PLD at σ this small takes minutes
  model.compile(optimizer="sgd", loss="mse")
  assert model.privacy_plan.batch_size == poisson.data_sized_batch_size(N)
  model._initialise(*private_inputs.in_memory(x, y))  # what the first fit does
  assert model.get_layer("rating").bias.numpy()[0] == pytest.approx(y.mean(), abs=0.1)


def _scalar(keras_api):
  """A layer class of `keras_api` that no norm function covers."""

  class _Scalar(keras_api.layers.Layer):
    def build(self, input_shape):
      self.scale = self.add_weight(name="scale", shape=(), initializer="ones")

    def call(self, inputs):
      return inputs * self.scale

  return _Scalar


def _with(keras_api, layer):
  inputs = keras_api.Input((3,))
  return keras_api.Model(inputs, keras_api.layers.Dense(1)(layer(inputs)))


@pytest.mark.parametrize("build, named", [
    (lambda k: _with(k, k.layers.BatchNormalization(name="bn")), "stateful layer(s) bn"),
    (lambda k: _with(k, _scalar(k)(name="odd")), "cannot clip layer(s) odd (_Scalar)"),
])
def test_refusals_name_the_layer_in_one_line(build, named, keras_api):
  model = build(keras_api)
  with pytest.raises(DprecError) as error:
    _private(model)
  assert named in str(error.value) and "\n" not in str(error.value)
  assert not isinstance(model, private_training.PrivateTraining)  # left as it was


def test_a_retrieval_task_is_refused_for_its_in_batch_negatives():
  class Retrieval(tfrs.models.Model):
    def __init__(self):
      super().__init__()
      self.task = tfrs.tasks.Retrieval()

  with pytest.raises(DprecError) as error:
    _private(Retrieval())
  assert "in-batch negatives" in str(error.value) and "\n" not in str(error.value)


def test_a_loss_that_is_not_per_example_is_refused(keras_api):
  model = _private(_functional(keras_api))
  model.compile(optimizer="sgd", loss=lambda y, p: tf.reduce_mean(tf.square(y - p)))
  with pytest.raises(DprecError, match="one value per batch, not one per example"):
    model.fit(*_data(), epochs=1, verbose=0)


class _InBatchNegatives(DPModel):
  """tfrs.tasks.Retrieval's loss: each query scored against the batch's positives."""

  def __init__(self):
    super().__init__()
    self.users = DPEmbedding(USERS, 4)
    self.items = DPEmbedding(ITEMS, 4)

  def call(self, x):
    return self.users(x["user"]), self.items(x["item"])

  def forward_losses(self, x, y, sample_weight=None):
    queries, candidates = self(x, training=True)
    logits = tf.matmul(queries, candidates, transpose_b=True)
    return logits, tf.keras.losses.sparse_categorical_crossentropy(
        tf.range(tf.shape(logits)[0]), logits, from_logits=True)


def _removal_distances(model, x, y, removed=(0, 7)):
  """‖clipped sum(D) − clipped sum(D − {i})‖ for two examples i, the noise off."""
  model.dp_optimizer.config = config_lib.DPSGD(l2_norm_clip=CLIP, noise_multiplier=0.0)

  def clipped_sum(rows):
    grads = model.dp_gradients({k: tf.constant(v[rows]) for k, v in x.items()},
                               None if y is None else tf.constant(y[rows]))
    grads = sorted(grads, key=lambda pair: pair[1].name)
    return np.concatenate([_dense(g) for g, _ in grads]) * model.dp_optimizer.expected_batch_size

  full = clipped_sum(np.arange(16))
  return [np.linalg.norm(full - clipped_sum(np.delete(np.arange(16), i))) for i in removed]


def test_two_tower_full_softmax_bounds_one_example_and_in_batch_negatives_do_not():
  x, _ = _data()
  x = {k: v[:16].astype(np.int64) for k, v in x.items()}
  tf.keras.utils.set_random_seed(0)
  model = _private(retrieval.two_tower(USERS, ITEMS, dim=4, hidden_units=(8,)))
  model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  model._initialise(*private_inputs.in_memory({"user": x["user"]}, x["item"]))
  distances = _removal_distances(model, {"user": x["user"]}, x["item"])
  assert max(distances) <= CLIP * (1 + 1e-4) and min(distances) >= 0.9 * CLIP

  in_batch = _InBatchNegatives()
  in_batch.compile(optimizer=DPOptimizer(config_lib.DPSGD(l2_norm_clip=CLIP, noise_multiplier=1.0),
                                         "sgd", expected_batch_size=16, insecure_noise_seed=0))
  in_batch(x)
  # Example 0's item outscores every other positive for every query: each loss is mostly
  # about it, and removing example 0 changes all 15 other clipped gradients.
  in_batch.users.embeddings.assign(tf.ones([USERS, 4]))
  items = np.full([ITEMS, 4], 0.1, np.float32)
  items[x["item"][0]] = 3.0
  in_batch.items.embeddings.assign(items)
  assert _removal_distances(in_batch, x, None, removed=[0])[0] > 3 * CLIP


def test_a_sequential_model_is_converted_in_place(keras_api):
  keras_api.utils.set_random_seed(0)
  model = keras_api.Sequential([keras_api.Input((), dtype="int32"),
                                keras_api.layers.Embedding(USERS, 4, name="table"),
                                keras_api.layers.Dense(1, name="out")])
  before = model.get_weights()
  private = _private(model)
  assert isinstance(private, keras_api.Sequential)
  assert type(private.layers[0]) is _table_class(keras_api) and private.layers[0].name == "table"
  for old, new in zip(before, private.get_weights()):
    np.testing.assert_array_equal(old, new)


def test_auto_picks_dp_sgd_when_a_row_cannot_reach_the_threshold():
  """With large tables, "auto" still takes DP-SGD when each of an example's k rows gets
  C1/√k of its contribution and a row would need more than a tenth of the batch to reach τ:
  the sampled retriever (1 + 2·101 rows an example); a one-id table keeps DP-AdaFEST."""
  items = private_options.AUTO_DENSE_LIMIT // 16 + 1
  retriever = retrieval.SampledTwoTower(10, items, dim=16, hidden_units=(), seed=0)
  assert retriever.rows_per_example == 203
  model = dprec.make_private(retriever, epsilon=1.0, train_size=100_000, batch_size=512)
  model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  assert isinstance(model.dp_optimizer.config, config_lib.DPSGD)
  ids = tf.keras.Input((4,), dtype=tf.int32, name="ids")
  four = tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(
      tf.keras.layers.Embedding(items, 16)(ids))))
  model = dprec.make_private(four, epsilon=1.0, train_size=100_000, batch_size=512)
  assert private_training.rows_per_example(model) == 4
  model.compile(loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
  assert isinstance(model.dp_optimizer.config, config_lib.DPAdaFEST)


@pytest.mark.parametrize("algorithm, optimizer", [("dp_sgd", "sgd"), ("dp_adafest", "adagrad"),
                                                  ("dp_adafest", "adam")])
def test_a_private_fit_ends_at_the_same_weights_in_both_kerases(algorithm, optimizer, keras3):
  """One model, its initial weights, data and insecure key in tf.keras and in Keras 3:
  make_private's whole fit (Poisson batches, DP output bias, DP steps on kept rows and their
  noise, recalibration) ends at the same weights and logs."""
  weights, logs = [], []
  for keras_api in (tf.keras, keras3):
    model = _functional(keras_api)
    rng = np.random.default_rng(3)
    named = sorted((layer for layer in model.layers if layer.weights), key=lambda l: l.name)
    for layer in named:
      layer.set_weights([rng.normal(size=w.shape).astype(np.float32)
                         for w in layer.get_weights()])
    start = [w for layer in named for w in layer.get_weights()]
    model = _private(model, algorithm=algorithm, label_range=(1.0, 5.0), threshold=1.0)
    optimizers = keras_api.optimizers
    model.compile(optimizer={"sgd": optimizers.SGD, "adagrad": optimizers.Adagrad,
                             "adam": optimizers.Adam}[optimizer](0.05), loss="mse")
    history = model.fit(*_data(), epochs=1, verbose=0).history
    weights.append([w for layer in named for w in layer.get_weights()])
    logs.append({name: history[name] for name in ("loss", "epsilon", "gradient_size_reduction")})
  for name, values in logs[0].items():
    assert logs[1][name] == pytest.approx(values, rel=1e-6)
  for tf_keras_weight, keras3_weight, initial in zip(*weights, start):
    np.testing.assert_allclose(keras3_weight, tf_keras_weight, rtol=1e-6, atol=1e-6)
    assert not np.allclose(keras3_weight, initial)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_keras_3_model_on_another_backend_is_refused_in_one_line(backend, monkeypatch,
                                                                  keras3):
  keras = keras3
  model = _functional(keras)
  monkeypatch.setattr(keras.backend, "backend", lambda: backend)
  with pytest.raises(DprecError) as error:
    _private(model)
  message = str(error.value)
  assert f"TensorFlow backend, not {backend}" in message and "KERAS_BACKEND=tensorflow" in message
  assert "\n" not in message and not isinstance(model, private_training.PrivateTraining)


@pytest.mark.parametrize("outer", ["keras3", "tf_keras"])
def test_a_model_mixing_keras_2_and_keras_3_layers_is_refused_in_one_line(outer, keras3):
  keras = keras3
  model_api, layer_api = (keras, tf.keras) if outer == "keras3" else (tf.keras, keras)

  class Mixed(model_api.Model):
    def __init__(self):
      super().__init__()
      self.table = model_api.layers.Embedding(USERS, 4)
      self.head = layer_api.layers.Dense(1, name="other_head")

    def call(self, ids):
      return self.head(self.table(ids))

  with pytest.raises(DprecError) as error:
    _private(Mixed())
  message = str(error.value)
  assert "holding" in message and "layer(s) other_head" in message and "\n" not in message


def test_a_subclassed_keras_3_model_saves_and_loads_as_its_registered_class(tmp_path,
                                                                           keras3):
  keras = keras3

  @keras.saving.register_keras_serializable(package="dprec_tests")
  class Ratings(keras.Model):
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.users = keras.layers.Embedding(USERS, 4)
      self.items = keras.layers.Embedding(ITEMS, 4)
      self.head = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                    keras.layers.Dense(1)])

    def call(self, x):
      return self.head(keras.ops.concatenate([self.users(x["user"]), self.items(x["item"])], 1))

  keras.utils.set_random_seed(0)
  model = _private(Ratings(), algorithm="dp_adafest", label_range=(1.0, 5.0))
  model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
  x, y = _data()
  model.fit(x, y, epochs=1, verbose=0)
  model.save(tmp_path / "ratings.keras")
  loaded = keras.models.load_model(tmp_path / "ratings.keras")
  assert type(loaded) is Ratings and type(model).__name__ == "Ratings"
  np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                             rtol=1e-6)


@pytest.mark.slow  # a Python process of its own: TensorFlow's import is most of it
@pytest.mark.usefixtures("keras3")  # skips without Keras 3
def test_a_keras_3_model_trains_where_tf_keras_is_keras_3():
  """A process that bound tf.keras to Keras 3 before importing dprec: `import dprec` succeeds
  and make_private trains a Keras 3 model (the tf-keras path is then unavailable)."""
  code = ("import numpy as np, tensorflow as tf, warnings; tf.keras.layers; import dprec, keras; "
          "warnings.simplefilter('ignore'); ids = keras.Input((), dtype='int32'); "
          "model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Embedding(10, 2)(ids))); "
          "model = dprec.make_private(model, epsilon=1.0, train_size=64, batch_size=8, "
          "init_output_bias=False, recalibrate=False); "
          "model.compile(optimizer='sgd', loss='mse'); "
          "history = model.fit(np.arange(64) % 10, np.ones(64, 'float32'), verbose=0); "
          "print(tf.keras.__name__.split('.')[0], sorted(history.history))")
  env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]),
             TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_USE_LEGACY_KERAS", None)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env)
  assert result.stdout.split() == ["keras", "['epsilon',", "'gradient_size',",  # tf.keras: Keras 3
                                   "'gradient_size_reduction',", "'loss']"]


def _running_sum(keras_api):
  """A layer that writes a variable from the batch (as BatchNormalization's statistics)."""

  class _RunningSum(keras_api.layers.Layer):
    def build(self, input_shape):
      self.total = self.add_weight(name="total", shape=(), initializer="zeros", trainable=False)

    def call(self, inputs):
      self.total.assign_add(tf.reduce_sum(inputs))
      return inputs

  return _RunningSum


@pytest.mark.parametrize("layer, refused", [("dropout", False), ("running_sum", True)])
def test_dropout_trains_and_a_forward_pass_writing_from_the_batch_is_refused(layer, refused,
                                                                              keras_api):
  """Keras 3's Dropout advances a seed state each step (no batch in it): it trains; a write
  of batch values is refused at the first step."""
  build = {"dropout": lambda: keras_api.layers.Dropout(0.5),
           "running_sum": lambda: _running_sum(keras_api)(name="running")}[layer]
  model = _private(_with(keras_api, build()), train_size=32, batch_size=8,
                   init_output_bias=False, recalibrate=False)
  model.compile(optimizer="sgd", loss="mse")
  x, y = np.ones([32, 3], np.float32), np.ones([32], np.float32)
  if refused:
    with pytest.raises(DprecError, match="updates variables from the batch in layer"):
      model.fit(x, y, verbose=0)
  else:
    assert model.fit(x, y, verbose=0).history["epsilon"][-1] > 0
