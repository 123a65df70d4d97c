"""`dprec.make_private(privacy_unit="user")` in both Kerases (and a TFRS ranking model): the
plan is over users, the batches the model trains on hold at most k rows of each sampled user
with the unit feature, the one-off releases read at most k rows per user at k times the planned
σ, ε on the user-level ledger equals dp_accounting's, and what cannot be done at user level is
refused before anything is paid."""
import types
import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import dprec
from dprec.distribute import replicas as replicas_lib
from dprec.errors import DprecError
from dprec.models.dp_model import ExtraNorms
from dprec.privacy.ledger import PrivacyLedger
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.privacy_unit import UNIT_KEY
from dprec.training import output_layer
from dprec.training import user_sampling
from dprec.workflows import private_options

USERS, ITEMS, K, USERS_PER_BATCH = 50, 20, 4, 16


def _data(seed=0):
  """~50 users of 1..30 rows each: features (the user id is also a model input), ratings and
  each row's user id."""
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(USERS), rng.integers(1, 31, USERS)).astype(np.int64)
  ids = ids[rng.permutation(len(ids))]  # a user's rows need not be together
  items = rng.integers(0, ITEMS, len(ids)).astype(np.int32)
  ratings = (1 + (ids + items) % 5).astype(np.float32)
  return {"user": ids.astype(np.int32), "item": items}, ratings, ids


def _model(keras_api=tf.keras):
  keras_api.utils.set_random_seed(0)
  layers = keras_api.layers
  user = keras_api.Input((), dtype="int32", name="user")
  item = keras_api.Input((), dtype="int32", name="item")
  joined = layers.Concatenate()([layers.Embedding(USERS, 4, name="user_table")(user),
                                 layers.Embedding(ITEMS, 4, name="item_table")(item)])
  return keras_api.Model({"user": user, "item": item}, layers.Dense(1, name="rating")(joined))


def _private(model, ids, ledger, **options):
  options = dict(dict(epsilon=2.0, train_size=len(ids), batch_size=USERS_PER_BATCH,
                      epochs=0.75, algorithm="dp_sgd", insecure_noise_seed=0, ledger=ledger,
                      label_range=(1.0, 5.0), privacy_unit="user", user_id=ids,
                      max_rows_per_user=K), **options)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", InsecureNoiseWarning)
    return dprec.make_private(model, **options)


def _recording(monkeypatch):
  """Records every user-level batch `fit` draws, and the σ and rows of each one-off release."""
  batches, releases = [], []
  draw = user_sampling.user_batches

  def recorded(*args, **kwargs):
    for batch in draw(*args, **kwargs):
      batches.append(batch)
      yield batch

  monkeypatch.setattr(user_sampling, "user_batches", recorded)
  for name in ("initial_bias", "recalibrate"):
    release = getattr(output_layer, name)

    def recorded_release(*args, release=release, name=name, **kwargs):
      if name == "initial_bias":
        _, labels, sigma = args[:3]
      else:
        _, _, _, labels, sigma = args[:5]
      releases.append((name, sigma, len(labels)))
      return release(*args, **kwargs)

    monkeypatch.setattr(output_layer, name, recorded_release)
  return batches, releases


def test_user_level_fit_samples_users_and_spends_dp_accountings_user_epsilon(
    keras_api, tmp_path, monkeypatch):
  x, y, ids = _data()
  batches, releases = _recording(monkeypatch)
  model = _private(_model(keras_api), ids, str(tmp_path / "ledger.json"))
  model.compile(optimizer="sgd", loss="mse")
  plan = model.privacy_plan
  assert plan.sampling_rate == USERS_PER_BATCH / USERS and plan.examples_per_period == USERS
  assert plan.steps == 3 and plan.delta == 1 / USERS  # ⌈0.75·50/16⌉ steps, δ = 1/U
  history = model.fit(x, y, epochs=1, verbose=0)

  ledger = PrivacyLedger.read(str(tmp_path / "ledger.json"))
  assert ledger.unit == "user" and {c["unit"] for c in ledger.charges} == {"user"}
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  for label in (private_options.LABEL_STATISTICS_LABEL, private_options.RECALIBRATION_LABEL):
    accountant.compose(dp_accounting.GaussianDpEvent(plan.mechanisms[label]))
  accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      USERS_PER_BATCH / USERS, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), 3))
  expected = accountant.get_epsilon(1 / USERS)
  assert model.epsilon_spent == pytest.approx(expected, rel=1e-3)
  assert expected == pytest.approx(2.0, rel=2e-3)
  assert history.history["epsilon"][-1] == pytest.approx(model.epsilon_spent)

  # The batches: each sampled user's rows together, at most k of them, under one unit.
  assert len(batches) >= 3 and all(UNIT_KEY in features for features, _ in batches)
  for features, labels in batches:
    unit, user = features[UNIT_KEY], features["input_1"]  # input_1: "user", sorted keys
    assert len(labels) == len(unit) and np.all(np.diff(unit) >= 0)
    for u in np.unique(unit):
      assert len(np.unique(user[unit == u])) == 1 and np.sum(unit == u) <= K
    assert len(np.unique(user)) == len(np.unique(unit))  # one unit per user
  assert max(np.bincount(f[UNIT_KEY]).max() for f, _ in batches) == K  # users of > k rows

  # The releases: at most k rows of every user, noise k·σ per row (σ per user).
  read = int(np.minimum(np.bincount(ids), K).sum())
  assert releases == [
      ("initial_bias", K * plan.mechanisms[private_options.LABEL_STATISTICS_LABEL], read),
      ("recalibrate", K * plan.mechanisms[private_options.RECALIBRATION_LABEL], read)]


@pytest.mark.parametrize("options, message", [
    (dict(privacy_unit="person"), "privacy_unit must be one of row, user"),
    (dict(user_id=None), "privacy_unit='user' needs user_id"),
    (dict(user_id="user"), "user ids must be integers"),
    (dict(user_id=np.arange(10)), r"\(10,\) user ids for \d+ rows"),
    (dict(user_id=np.r_[-1, _data()[2][1:]]), "row 0 .* has user id -1"),
    (dict(max_rows_per_user=0), "max rows per user .* must be an integer >= 1"),
    (dict(privacy_unit="row"), "user_id and max_rows_per_user go with privacy_unit='user'"),
    (dict(batch_size=USERS + 1), "batch_size must be in \\[1, the number of users=50\\]"),
    (dict(max_batch_size=64), "max_batch_size caps row-level Poisson batches"),
])
def test_bad_user_level_options_are_refused_in_one_line(options, message, tmp_path):
  _, _, ids = _data()
  ledger = tmp_path / "ledger.json"
  with pytest.raises(DprecError, match=message) as refused:
    _private(_model(), ids, str(ledger), **options)
  assert "\n" not in str(refused.value) and not ledger.exists()


def _without_per_unit_dense(model):
  from dprec.clipping import layer_norms
  registry = layer_norms.make_layer_registry()
  registry.insert(tf.keras.layers.Dense, layer_norms.dense_computation)  # per-example only
  object.__setattr__(model, "layer_registry", registry)


def _extra_norms(model):
  object.__setattr__(model, "extra_squared_norms", lambda: [
      ExtraNorms([], tf.zeros([2]), lambda grads: grads)])


def _two_replicas(monkeypatch):
  monkeypatch.setattr(replicas_lib, "Replicas", lambda: types.SimpleNamespace(count=2))


@pytest.mark.parametrize("break_step, message", [
    (_without_per_unit_dense, r"'rating' \(Dense\) has a per-example norm function only"),
    (_extra_norms, "extra_squared_norms gives per-example norms only"),
    ("replicas", "replicas could split a unit's rows"),
])
def test_a_step_that_cannot_clip_per_user_is_refused_before_anything_is_paid(
    break_step, message, tmp_path, monkeypatch):
  x, y, ids = _data()
  model = _private(_model(), ids, str(tmp_path / "ledger.json"))
  model.compile(optimizer="sgd", loss="mse")
  if break_step == "replicas":
    _two_replicas(monkeypatch)
  else:
    break_step(model)
  with pytest.raises(DprecError, match=message):
    model.fit(x, y, verbose=0)
  assert model.privacy_ledger.charges == [] and model.epsilon_spent == 0


def test_a_model_without_dict_inputs_and_batches_on_disk_are_refused(tmp_path):
  x, y, ids = _data()
  layers = tf.keras.layers
  sequential = tf.keras.Sequential([tf.keras.Input((1,), dtype="int32"),
                                    layers.Embedding(USERS, 4), layers.Flatten(),
                                    layers.Dense(1)])
  model = _private(sequential, ids, str(tmp_path / "ledger.json"))
  model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(DprecError, match="needs a model whose input is a dict of features"):
    model.fit(x["user"][:, None], y, verbose=0)
  with pytest.raises(DprecError, match="trains on in-memory data"):
    model.fit(str(tmp_path), verbose=0)
  assert model.privacy_ledger.charges == []


def test_a_row_level_run_refuses_a_user_level_ledger(tmp_path):
  x, y, ids = _data()
  ledger = str(tmp_path / "ledger.json")
  PrivacyLedger(ledger, epsilon_budget=2.0, delta=1 / USERS, unit="user")
  model = _private(_model(), ids, ledger, privacy_unit="row", user_id=None,
                   max_rows_per_user=None, batch_size=64)
  with pytest.raises(DprecError, match="privacy_unit: the ledger has 'user'"):
    model.compile(optimizer="sgd", loss="mse")


def test_a_release_at_k_sigma_on_k_rows_per_user_is_the_gaussian_at_sigma_per_user(tmp_path):
  """What `make_private` charges for a one-off release at user level (the Gaussian at the planned
  σ, unit user) equals the ledger's conversion of the row-level release it makes (noise k·σ)
  for a group of k rows."""
  sigma, delta = 10.0, 1e-5  # a large σ: the mixture's PLD builds in seconds
  charged = PrivacyLedger(str(tmp_path / "a.json"), 10.0, delta, unit="user")
  converted = PrivacyLedger(str(tmp_path / "b.json"), 10.0, delta, unit="user")
  assert charged.charge_gaussian_mechanism(sigma) == pytest.approx(
      converted.charge_gaussian_mechanism(K * sigma, unit="row", group_size=K), rel=1e-6)


def test_a_tfrs_ranking_model_trains_at_user_level(tmp_path, monkeypatch):
  tfrs = pytest.importorskip("tensorflow_recommenders")

  class Ranking(tfrs.models.Model):
    def __init__(self):
      super().__init__()
      self.model = _model()
      self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError())

    def call(self, features):
      return self.model(features)

    def compute_loss(self, features, training=False):
      labels = features.pop("rating")
      return self.task(labels=labels, predictions=self(features))

  x, y, ids = _data()
  batches, _ = _recording(monkeypatch)
  model = _private(Ranking(), ids, str(tmp_path / "ledger.json"))
  model.compile(optimizer="sgd")
  model.fit(dict(x, rating=y), epochs=1, verbose=0)
  assert model.privacy_ledger.unit == "user" and model._private.steps == 3
  assert model.epsilon_spent == pytest.approx(2.0, rel=2e-3)
  assert all(UNIT_KEY in batch for batch in batches)
