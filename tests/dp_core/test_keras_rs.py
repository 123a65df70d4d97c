"""KerasRS layers under DP: `FeatureCross` (its Dense sublayers are the registry's,
also low-rank) and `DotInteraction` (no weights) give per-example norms equal to brute-force
per-example gradients and train through `make_private`; a retrieval model trains privately and is
evaluated with `BruteForceRetrieval`; a `compute_loss` of the model's own, where KerasRS' retrieval
examples put the loss, is refused in one line."""
import importlib.metadata
import warnings

import numpy as np
import pytest
import tensorflow as tf

# The TF 2.15 stack (make test-legacy) has Keras 2 as `keras` and no KerasRS: skipped there
# without importing keras (its classes would shadow tf-keras' in later tests).
if int(importlib.metadata.version("keras").split(".")[0]) < 3:
  pytest.skip("Keras 3 is not installed", allow_module_level=True)

import keras

import dprec
from dprec.errors import DprecError
from dprec.models import keras3 as keras3_binding
from dprec.optimizers import DPSGD, DPOptimizer
from dprec.privacy.noise_key import InsecureNoiseWarning

keras_rs = pytest.importorskip("keras_rs")

BATCH, USERS, ITEMS, N, CLIP = 6, 9, 11, 256, 0.5


def _ranking(seed=0):
  """user, item ids → embeddings → FeatureCross (full rank), FeatureCross (low rank, diagonal
  scale, pre-activation) → with DotInteraction of the embeddings and a projection → Dense."""
  keras.utils.set_random_seed(seed)
  layers = keras.layers
  user = keras.Input((), dtype="int32", name="user")
  item = keras.Input((), dtype="int32", name="item")
  users, items = layers.Embedding(USERS, 4)(user), layers.Embedding(ITEMS, 4)(item)
  x0 = layers.Concatenate()([users, items])
  x1 = keras_rs.layers.FeatureCross(name="cross")(x0)
  x2 = keras_rs.layers.FeatureCross(projection_dim=2, diag_scale=0.5, pre_activation="tanh",
                                    name="low_rank_cross")(x0, x1)
  dot = keras_rs.layers.DotInteraction()([users, items, layers.Dense(4)(x2)])
  output = layers.Dense(1)(layers.Concatenate()([x2, dot]))
  return keras.Model({"user": user, "item": item}, output)


def _data(n, seed=1):
  rng = np.random.default_rng(seed)
  x = {"user": rng.integers(0, USERS, n).astype(np.int32),
       "item": rng.integers(0, ITEMS, n).astype(np.int32)}
  return x, ((x["user"] + x["item"]) % 5 + 1).astype(np.float32)[:, None]


def _private(model, **options):
  with warnings.catch_warnings():  # the insecure seed (reproducible tests) is flagged
    warnings.simplefilter("ignore", InsecureNoiseWarning)
    return dprec.make_private(model, **dict(dict(
        epsilon=1.0, train_size=N, batch_size=32, algorithm="dp_sgd", l2_norm_clip=CLIP,
        insecure_noise_seed=0), **options))


def test_norms_equal_brute_force_per_example_gradients():
  model = keras3_binding.dp_model(_ranking())
  rng = np.random.default_rng(0)  # away from the zero biases and initial kernels
  model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
  model.compile(DPOptimizer(DPSGD(1.0, 0.0), keras.optimizers.SGD(0.1), insecure_noise_seed=0),
                loss="mse")
  x, y = _data(BATCH)
  expected = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model({k: v[i:i + 1] for k, v in x.items()}) - y[i:i + 1]))
    expected.append(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
                        for g in tape.gradient(loss, model.trainable_variables)))
  np.testing.assert_allclose(model.per_example_squared_norms(x, y), expected, rtol=1e-4)


def test_a_keras_rs_ranking_model_trains_privately_and_bounds_one_example():
  model = _private(_ranking(), epochs=2)
  model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
  cross = model.get_layer("low_rank_cross").get_weights()
  history = model.fit(*_data(N), epochs=2, verbose=0)
  assert history.history["epsilon"][-1] == pytest.approx(1.0, rel=2e-3)
  assert history.history["loss"][-1] < history.history["loss"][0]
  for before, after in zip(cross, model.get_layer("low_rank_cross").get_weights()):
    assert not np.allclose(before, after)

  model.dp_optimizer.config = DPSGD(l2_norm_clip=CLIP, noise_multiplier=0.0)
  x, y = _data(16)

  def clipped_sum(rows):  # far from the predictions: every example is clipped to C2
    grads = model.dp_gradients({k: tf.constant(v[rows]) for k, v in x.items()},
                               tf.constant(100 * y[rows]))
    return np.concatenate([tf.convert_to_tensor(g).numpy().ravel() for g, _ in grads]
                          ) * model.dp_optimizer.expected_batch_size

  moved = np.linalg.norm(clipped_sum(np.arange(16)) - clipped_sum(np.arange(1, 16)))
  assert 0.9 * CLIP <= moved <= CLIP * (1 + 1e-4)


class _OwnLoss(keras.Model):
  """KerasRS' basic retrieval example: the loss in `compute_loss`."""

  def __init__(self):
    super().__init__()
    self.users = keras.layers.Embedding(USERS, 4)
    self.items = keras.layers.Embedding(ITEMS, 4)

  def call(self, inputs):
    return self.users(inputs["user"])

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    return keras.ops.mean(keras.ops.square(
        keras.ops.sum(y_pred * self.items(x["item"]), axis=1) - y))


def test_a_retrieval_model_trains_privately_and_retrieves_with_brute_force():
  """The two towers' score trained through make_private; its item table is the candidates of a
  `BruteForceRetrieval`, which ranks them by the trained score."""
  keras.utils.set_random_seed(0)
  user = keras.Input((), dtype="int32", name="user")
  item = keras.Input((), dtype="int32", name="item")
  users = keras.layers.Embedding(USERS, 4, name="users")
  items = keras.layers.Embedding(ITEMS, 4, name="items")
  score = keras.layers.Dot(axes=1)([users(user), items(item)])
  model = _private(keras.Model({"user": user, "item": item}, score), epsilon=8.0,
                   init_output_bias=False, recalibrate=False)  # no output layer
  model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
  model.fit(*_data(N), epochs=1, verbose=0)
  retrieval = keras_rs.layers.BruteForceRetrieval(
      candidate_embeddings=items.embeddings, k=3, return_scores=False)
  queries = np.arange(USERS, dtype=np.int32)
  top = keras.ops.convert_to_numpy(retrieval(users(queries)))
  scores = keras.ops.convert_to_numpy(users.embeddings) @ keras.ops.convert_to_numpy(
      items.embeddings).T  # the trained model's score of every pair
  np.testing.assert_array_equal(top, np.argsort(-scores, axis=1, kind="stable")[:, :3])


def test_a_model_with_its_own_compute_loss_is_refused_in_one_line():
  model = _OwnLoss()
  with pytest.raises(DprecError) as error:
    _private(model)
  assert "_OwnLoss overrides compute_loss" in str(error.value)
  assert "\n" not in str(error.value) and type(model) is _OwnLoss  # left as it was


def test_a_feature_cross_called_twice_is_refused_in_one_line():
  x0 = keras.Input((4,))
  cross = keras_rs.layers.FeatureCross()
  model = _private(keras.Model(x0, keras.layers.Dense(1)(cross(x0, cross(x0)))),
                   train_size=16, batch_size=4)
  model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(DprecError, match="called more than once per step") as error:
    model.fit(np.ones((16, 4), np.float32), np.ones((16, 1), np.float32), verbose=0)
  assert "\n" not in str(error.value)  # Keras adds no call context to dprec's refusals
