"""DPFormer through the shared DP step: C = ∞ and σ = 0 is the non-private step; with clipping
the update equals brute-force per-example clipping (Opacus-style reference, Ding et al., "DPFormer:
Learning Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633)."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.models.seqrec import NextItemLoss, SeqRecConfig, SeqRecModel
from dprec.optimizers.config import DPSGD
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.sparse.fest import threshold_vocabulary
from dprec.workflows.item_frequencies import popularity_weights

ITEMS = np.array([[0, 0, 3, 5, 3, 3], [1, 2, 4, 2, 7, 8], [0, 0, 0, 0, 0, 9],
                  [13, 12, 13, 1, 5, 6]], np.int32)
LABELS = np.array([[0, 0, 5, 3, 3, 5], [2, 4, 2, 7, 8, 2], [0, 0, 0, 0, 0, 9],
                   [12, 13, 1, 5, 6, 13]], np.int32)

ROW_WEIGHTS = np.linspace(0.25, 3.0, 14).astype(np.float32)  # w of rows 0..13


def _model(weights=None, noise_multiplier=1.0, vocabulary=None, **config):
  tf.keras.utils.set_random_seed(0)
  model = SeqRecModel(SeqRecConfig(num_items=13, max_len=6, dim=8, ffn_dim=12, dropout=0.0,
                                   **config))
  model({"items": ITEMS})
  if weights is None:
    rng = np.random.default_rng(1)
    weights = [rng.normal(0, 0.5, w.shape).astype(np.float32) for w in model.get_weights()]
  model.set_weights(weights)
  if vocabulary is not None:
    model.set_item_vocabulary(vocabulary)
  if config.get("popularity_weights"):
    model.set_popularity_weights(ROW_WEIGHTS[:model.config.table_rows + 1],
                                 keep_effective_table=False)
  model.set_error_model(np.linspace(0.05, 1.0, 14), noise_multiplier, 1.0, 4, 100)
  return model


def _step(model, optimizer):
  model.compile(optimizer=optimizer, run_eagerly=True)  # no tracing: fast on tiny shapes
  before = [v.numpy() for v in model.trainable_variables]
  model.train_on_batch({"items": ITEMS}, LABELS)
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


def test_dp_step_without_clipping_or_noise_is_the_non_private_step():
  reference = _model()
  weights = reference.get_weights()
  plain = _step(reference, tf.keras.optimizers.SGD(0.1))
  private = _step(_model(weights), DPOptimizer(DPSGD(float("inf"), 0.0),
                                               tf.keras.optimizers.SGD(0.1),
                                               expected_batch_size=len(ITEMS),
                                               insecure_noise_seed=0))
  for a, b in zip(plain, private):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert max(np.abs(a).max() for a in plain) > 1e-3


@pytest.mark.parametrize("config", [
    {}, {"score_padding": True}, {"loss_positions": "last"}, {"tied": False},
    {"item_rank": 3}, {"item_rank": 3, "score_padding": True},
    {"item_rank": 3, "loss_positions": "last"}],
                         ids=["packed", "padded", "last", "untied", "rank3", "rank3-padded",
                              "rank3-last"])
def test_clipped_dp_step_equals_brute_force_per_example_clipping(config):
  """The clipped sum is book-kept from the norm pass (`tied_embedding_clipped_loss_fn`):
  no second backward pass through the softmax, same update."""
  model = _model(**config)
  weights = model.get_weights()
  per_example = []
  for i in range(len(ITEMS)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(NextItemLoss(reduction="none")(LABELS[i:i + 1],
                                                          model({"items": ITEMS[i:i + 1]})))
    per_example.append([tf.convert_to_tensor(g).numpy()
                        for g in tape.gradient(loss, model.trainable_variables)])
  norms = np.sqrt([sum((g.astype(np.float64) ** 2).sum() for g in grads) for grads in per_example])
  clip = min(1.0, norms.min() / 2)  # every example is clipped, so wrong norms would show
  factors = np.minimum(1.0, clip / norms)
  expected = [sum(f * grads[k] for f, grads in zip(factors, per_example)) / len(ITEMS)
              for k in range(len(per_example[0]))]
  optimizer = DPOptimizer(DPSGD(clip, 0.0), tf.keras.optimizers.SGD(1.0),
                          expected_batch_size=len(ITEMS), insecure_noise_seed=0)
  update = _step(_model(weights, **config), optimizer)
  for got, want in zip(update, expected):
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
def test_noised_step_adds_gaussian_noise_of_std_sigma_c(secure):
  """The noisy update minus the noise-free one is N(0, (σC/B)²) on every coordinate (the
  Phantom-clipped tied table included), in default and in secure (exact) noise mode."""
  weights = _model().get_weights()
  clip, sigma, batch = 0.5, 2.0, len(ITEMS)
  updates = [_step(_model(weights), DPOptimizer(
      DPSGD(clip, noise), tf.keras.optimizers.SGD(1.0), expected_batch_size=batch,
      insecure_noise_seed=0, secure_noise=secure and noise > 0)) for noise in (0.0, sigma)]
  noise = np.concatenate([(a - b).ravel() for a, b in zip(updates[1], updates[0])]) * batch
  assert noise.size > 1000 and np.std(noise) == pytest.approx(sigma * clip, rel=0.1)
  assert abs(np.mean(noise)) < 5 * sigma * clip / np.sqrt(noise.size)


def _per_example_gradients(model, labels=LABELS):
  per_example = []
  for i in range(len(ITEMS)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(NextItemLoss(reduction="none")(labels[i:i + 1],
                                                          model({"items": ITEMS[i:i + 1]})))
    per_example.append([tf.convert_to_tensor(g).numpy().astype(np.float64)
                        for g in tape.gradient(loss, model.trainable_variables)])
  return per_example


@pytest.mark.parametrize("config", [
    {"item_norm_share": 0.8}, {"item_norm_share": 0.3, "tied": False},
    {"item_norm_share": 0.8, "item_rank": 3}, {"item_norm_share": 0.5, "loss_positions": "last"}],
                         ids=["tied", "untied", "rank3", "last"])
@pytest.mark.parametrize("normalize", [False, True], ids=["clip", "normalize"])
def test_item_norm_share_clips_the_item_table_and_the_rest_separately(config, normalize):
  """`item_norm_share` F: per-user norms of the item table and of the rest equal brute force;
  the step equals brute-force clipping of the item table to C√F and the rest to C√(1−F), and
  every user's clipped gradient has norm ≤ C (the sensitivity, hence the accounting, unchanged)."""
  model = _model(**config)
  weights = model.get_weights()
  table = {id(v) for v in model.item_embedding.trainable_weights}
  in_table = [id(v) in table for v in model.trainable_variables]
  per_example = _per_example_gradients(model)
  group_norms = np.array([[np.sqrt(sum((g ** 2).sum() for g, t in zip(grads, in_table)
                                       if t == group)) for group in (False, True)]
                          for grads in per_example])  # [B, (rest, table)]
  share = config["item_norm_share"]
  clip = min(1.0, group_norms.min() / 2)
  bounds = clip * np.sqrt([1 - share, share])
  offset = 0.01 if normalize else None
  factors = (bounds / (group_norms + offset) if normalize
             else np.minimum(1.0, bounds / group_norms))
  clipped = [[f[int(t)] * g for g, t in zip(grads, in_table)]
             for f, grads in zip(factors, per_example)]
  assert all(np.sqrt(sum((g ** 2).sum() for g in c)) <= clip * (1 + 1e-6) for c in clipped)
  expected = [sum(c[k] for c in clipped) / len(ITEMS) for k in range(len(in_table))]
  dp_model = _model(weights, **config)
  optimizer = DPOptimizer(DPSGD(clip, 0.0, normalization_offset=offset),
                          tf.keras.optimizers.SGD(1.0), expected_batch_size=len(ITEMS),
                          insecure_noise_seed=0)
  dp_model.compile(optimizer=optimizer, run_eagerly=True)
  rest, items = dp_model.per_example_squared_norms({"items": ITEMS}, LABELS, by_group=True)
  np.testing.assert_allclose(np.sqrt(rest), group_norms[:, 0], rtol=1e-5)
  np.testing.assert_allclose(np.sqrt(items), group_norms[:, 1], rtol=1e-5)
  update = _step(dp_model, optimizer)
  for got, want in zip(update, expected):
    np.testing.assert_allclose(got, want, atol=2e-6)


COUNTS = np.array([0, 9, 1, 8, -2, 7, 3, 6, 0.5, 2, 5, 1, 4, 10], np.float64)  # items 1..13


def test_threshold_vocabulary_gives_rare_items_one_shared_row_and_their_share_of_it():
  vocabulary = threshold_vocabulary(COUNTS, 5.0)
  kept = [1, 3, 5, 7, 10, 13]
  assert vocabulary.own_rows == 6 and vocabulary.num_rows == 7
  np.testing.assert_array_equal(vocabulary.row_of[kept], np.arange(1, 7))
  shared = [2, 4, 6, 8, 9, 11, 12]
  assert (vocabulary.row_of[shared] == 7).all() and vocabulary.row_of[0] == 0
  floored = np.maximum(COUNTS[shared], 1.0)  # DP counts may be ≤ 0
  np.testing.assert_allclose(vocabulary.log_share[shared], np.log(floored / floored.sum()))
  assert (vocabulary.log_share[kept] == 0).all()


def _vocabulary_model(weights=None, **config):
  vocabulary = threshold_vocabulary(COUNTS, 5.0)
  return _model(weights, vocabulary=vocabulary, item_table_rows=vocabulary.num_rows,
                **config), vocabulary


@pytest.mark.parametrize("config", [{}, {"item_norm_share": 0.6}, {"item_rank": 3}],
                         ids=["joint", "share", "rank3"])
def test_vocabulary_step_equals_brute_force_and_every_item_is_ranked(config):
  """With a DP-FEST vocabulary the table has 7 rows, not 13; the clipped step on row labels
  equals brute force, and `score_items` ranks all 13 items: row score + log share."""
  model, vocabulary = _vocabulary_model(**config)
  assert model.item_embedding.embeddings.shape[0] == 8
  labels = vocabulary.row_of[LABELS]
  weights = model.get_weights()
  per_example = _per_example_gradients(model, labels)
  norms = np.sqrt([sum((g ** 2).sum() for g in grads) for grads in per_example])
  clip = min(1.0, norms.min() / 2)
  share = config.get("item_norm_share")
  if share is None:
    factors = [[c] * len(per_example[0]) for c in np.minimum(1.0, clip / norms)]
  else:
    table = [any(v is w for w in model.item_embedding.trainable_weights)
             for v in model.trainable_variables]
    group = lambda grads, t: np.sqrt(sum((g ** 2).sum() for g, u in zip(grads, table) if u == t))
    factors = [[min(1.0, clip * np.sqrt(share if t else 1 - share) / group(grads, t))
                for t in table] for grads in per_example]
  expected = [sum(f[k] * grads[k] for f, grads in zip(factors, per_example)) / len(ITEMS)
              for k in range(len(per_example[0]))]
  dp_model, _ = _vocabulary_model(weights, **config)
  dp_model.compile(optimizer=DPOptimizer(DPSGD(clip, 0.0), tf.keras.optimizers.SGD(1.0),
                                         expected_batch_size=len(ITEMS), insecure_noise_seed=0),
                   run_eagerly=True)
  before = [v.numpy() for v in dp_model.trainable_variables]
  dp_model.train_on_batch({"items": ITEMS}, labels)
  for b, v, want in zip(before, dp_model.trainable_variables, expected):
    np.testing.assert_allclose(b - v.numpy(), want, atol=2e-6)
  scores = dp_model.score_items(ITEMS).numpy()
  row_scores = dp_model.forward(ITEMS, last_only=True)[0].flat_values.numpy()
  assert scores.shape == (len(ITEMS), 13)
  np.testing.assert_allclose(
      scores, row_scores[:, vocabulary.row_of[1:] - 1] + vocabulary.log_share[1:], rtol=1e-5)


def _clipped_brute_force(model, per_example, clip, share):
  """Σ_i clipped g_i / B (per group with `share`), asserting each clipped g_i has norm ≤ C."""
  table = [any(v is w for w in model.item_embedding.trainable_weights)
           for v in model.trainable_variables]
  group = lambda grads, t: np.sqrt(sum((g ** 2).sum() for g, u in zip(grads, table) if u == t))
  if share is None:
    factors = [[min(1.0, clip / np.sqrt(group(g, True) ** 2 + group(g, False) ** 2))] * len(g)
               for g in per_example]
  else:
    factors = [[min(1.0, clip * np.sqrt(share if t else 1 - share) / group(grads, t))
                for t in table] for grads in per_example]
  clipped = [[f * g for f, g in zip(fs, grads)] for fs, grads in zip(factors, per_example)]
  assert all(np.sqrt(sum((g ** 2).sum() for g in c)) <= clip * (1 + 1e-6) for c in clipped)
  return [sum(c[k] for c in clipped) / len(ITEMS) for k in range(len(table))]


@pytest.mark.parametrize("config", [
    {}, {"tied": False}, {"item_rank": 3}, {"loss_positions": "last"},
    {"item_norm_share": 0.7}], ids=["tied", "untied", "rank3", "last", "share"])
def test_popularity_weights_norms_and_step_equal_brute_force(config):
  """`popularity_weights`: E[j] = w_j·Ẽ[j]; Phantom's per-user norms of Ẽ (on the unweighted
  lookup and scores) equal brute force, they differ from the unweighted model's, and the step
  equals brute-force clipping to C (every user's clipped gradient ≤ C: sensitivity unchanged)."""
  config = dict(config, popularity_weights=True)
  model = _model(**config)
  weights = model.get_weights()
  per_example = _per_example_gradients(model)
  clip = 0.5 * min(np.sqrt(sum((g ** 2).sum() for g in grads)) for grads in per_example)
  expected = _clipped_brute_force(model, per_example, clip,
                                  config.get("item_norm_share"))
  dp_model = _model(weights, **config)
  optimizer = DPOptimizer(DPSGD(clip, 0.0), tf.keras.optimizers.SGD(1.0),
                          expected_batch_size=len(ITEMS), insecure_noise_seed=0)
  dp_model.compile(optimizer=optimizer, run_eagerly=True)
  norms = dp_model.per_example_squared_norms({"items": ITEMS}, LABELS).numpy()
  want = [sum((g ** 2).sum() for g in grads) for grads in per_example]
  np.testing.assert_allclose(norms, want, rtol=1e-5)
  unweighted = _model(weights, **config)
  unweighted.set_popularity_weights(np.ones(14, np.float32), keep_effective_table=False)
  unweighted.compile(optimizer=optimizer, run_eagerly=True)
  assert not np.allclose(unweighted.per_example_squared_norms({"items": ITEMS}, LABELS), norms,
                         rtol=1e-2)
  update = _step(dp_model, optimizer)
  for got, want_k in zip(update, expected):
    np.testing.assert_allclose(got, want_k, atol=2e-6)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_popularity_weights_keep_the_effective_table(tied):
  """`set_popularity_weights` divides Ẽ's rows by w: the model computes what it computed before
  (the same initialisation), and its Re-Attention row variances scale by w²."""
  ones = np.ones(14, np.float32)
  plain = _model(tied=tied, popularity_weights=True)
  plain.set_popularity_weights(ones, keep_effective_table=False)
  weighted = _model(plain.get_weights(), tied=tied, popularity_weights=True)
  weighted.set_popularity_weights(ones, keep_effective_table=False)
  weighted.set_popularity_weights(ROW_WEIGHTS)
  np.testing.assert_allclose(weighted.score_items(ITEMS), plain.score_items(ITEMS), rtol=1e-4,
                             atol=1e-5)
  for model in (plain, weighted):
    model.set_error_model(np.linspace(0.05, 1.0, 14), 1.0, 1.0, 4, 100)
  np.testing.assert_allclose(weighted.item_variance.numpy(),
                             plain.item_variance.numpy() * ROW_WEIGHTS ** 2, rtol=1e-6)


def test_popularity_weights_follow_inverse_root_counts_floored_and_keep_the_mean_share():
  counts = np.array([0.0, 400.0, 100.0, 25.0, 3.0, -4.0])
  w = popularity_weights(counts, floor=10.0)
  floored = np.array([400.0, 100.0, 25.0, 10.0, 10.0])
  assert w[0] == 1.0
  np.testing.assert_allclose(w[1:3] / w[2:4], [0.5, 0.5])  # ∝ n^(-1/2)
  assert w[4] == w[5] == w[1:].max()  # floored: noise-level counts get the cap
  np.testing.assert_allclose((floored * w[1:] ** 2).sum(), floored.sum())
