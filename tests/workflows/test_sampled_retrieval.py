"""`dprec.models.retrieval.SampledTwoTower` through `dprec.make_private`: with
per-example sampled negatives, removing one example moves the clipped sum by ≤ C2; the DP item
histogram's ε equals dp_accounting's; the logits carry the logQ correction, the fixed prior and
the accidental-hit mask; negatives follow Q."""
import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import dprec
from dprec.models import retrieval
from dprec.optimizers import config as config_lib
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.workflows import private_inputs
from dprec.workflows import private_options

USERS, ITEMS, N, K, CLIP = 30, 40, 256, 6, 0.05
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data():
  rng = np.random.default_rng(0)
  return {"user": rng.integers(0, USERS, N), "item": rng.zipf(1.5, N) % ITEMS}


def _private_model(**options):
  tf.keras.utils.set_random_seed(0)
  model = retrieval.SampledTwoTower(USERS, ITEMS, dim=4, hidden_units=(8,), num_negatives=K,
                                    sampling_exponent=1.0, seed=0)
  with warnings.catch_warnings():  # the insecure seed (reproducible tests) is flagged
    warnings.simplefilter("ignore", InsecureNoiseWarning)
    model = dprec.make_private(model, **dict(dict(
        epsilon=1.0, train_size=N, batch_size=32, algorithm="dp_sgd", l2_norm_clip=CLIP,
        insecure_noise_seed=0), **options))
  model.compile(optimizer="sgd", loss=LOSS)
  return model


def test_sampled_negatives_bound_one_example_by_c2():
  x = _data()
  model = _private_model()
  model._initialise(*private_inputs.in_memory(x, retrieval.positive_labels(N)))  # DP Q
  model.dp_optimizer.config = config_lib.DPSGD(l2_norm_clip=CLIP, noise_multiplier=0.0)

  def clipped_sum(rows):
    model.reset_negative_sampling(1)  # the remaining examples draw the same negatives
    grads = model.dp_gradients({k: tf.constant(v[rows]) for k, v in x.items()},
                               tf.constant(retrieval.positive_labels(len(rows))))
    grads = sorted(grads, key=lambda pair: pair[1].name)
    return np.concatenate([tf.convert_to_tensor(g).numpy().ravel() for g, _ in grads]) * (
        model.dp_optimizer.expected_batch_size)

  for removed in (0, 7):
    rows = np.append(np.delete(np.arange(16), removed), removed)  # the removed one drawn last
    difference = np.linalg.norm(clipped_sum(rows) - clipped_sum(rows[:-1]))
    assert difference <= CLIP * (1 + 1e-4)
    assert difference >= 0.9 * CLIP  # the removed example's whole clipped gradient


def test_dp_item_histogram_epsilon_equals_dp_accounting():
  x = _data()
  model = _private_model()
  model._initialise(*private_inputs.in_memory(x, retrieval.positive_labels(N)))
  sigma = model.privacy_plan.mechanisms[private_options.LABEL_STATISTICS_LABEL]
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  accountant.compose(dp_accounting.GaussianDpEvent(sigma))
  assert model.epsilon_spent == pytest.approx(accountant.get_epsilon(1 / N), rel=1e-3)
  assert model.epsilon_spent == pytest.approx(0.02, rel=0.02)  # the output-bias share of ε
  # Q and the prior come from the noisy histogram, not from the exact counts.
  exact = np.maximum(np.bincount(x["item"], minlength=ITEMS), 1.0)
  prior = np.exp(model.log_prior.numpy())
  assert not np.allclose(prior, exact / exact.sum(), atol=1e-3)
  np.testing.assert_allclose(model.log_q.numpy(), model.log_prior.numpy(), atol=1e-5)  # α = 1


def test_logits_carry_the_logq_correction_the_prior_and_the_hit_mask():
  model = retrieval.SampledTwoTower(5, 4, dim=2, hidden_units=(), num_negatives=50,
                                    sampling_exponent=0.5, seed=3)
  users = tf.constant([0, 1, 2], tf.int64)
  items = tf.constant([0, 3, 1], tf.int64)
  model({"user": users, "item": items})
  counts = np.array([1.0, 4.0, 9.0, 16.0])
  model.set_item_counts(counts)
  model.item_bias.embeddings.assign([[0.1], [0.2], [0.3], [0.4]])
  model.reset_negative_sampling(7)
  logits = model({"user": users, "item": items}).numpy()
  model.reset_negative_sampling(7)
  negatives = model.sample_negatives(3).numpy()
  candidates = np.concatenate([items.numpy()[:, None], negatives], axis=1)
  q = counts ** 0.5 / (counts ** 0.5).sum()
  query = model.query(users).numpy()
  table = model.item_embedding.embeddings.numpy()
  expected = (np.einsum("nd,ncd->nc", query, table[candidates])
              + np.array([0.1, 0.2, 0.3, 0.4])[candidates]
              + np.log(counts / counts.sum())[candidates] - np.log(q)[candidates])
  hits = np.zeros_like(candidates, bool)
  hits[:, 1:] = negatives == items.numpy()[:, None]
  assert hits.any() and (~hits[:, 1:]).any()
  np.testing.assert_allclose(logits[~hits], expected[~hits], rtol=1e-5, atol=1e-5)
  assert (logits[hits] == retrieval.MASKED_LOGIT).all()
  # The full-corpus score is the uncorrected s(u, j).
  scores = model.score_items(users).numpy()
  np.testing.assert_allclose(
      scores, query @ table.T + np.array([0.1, 0.2, 0.3, 0.4])
      + np.log(counts / counts.sum()), rtol=1e-5, atol=1e-5)


def test_negatives_follow_q():
  model = retrieval.SampledTwoTower(5, 4, dim=2, hidden_units=(), num_negatives=1000,
                                    sampling_exponent=1.0, seed=0)
  model.set_item_counts([1.0, 2.0, 3.0, 4.0])
  frequencies = np.bincount(model.sample_negatives(20).numpy().ravel(), minlength=4) / 20000
  np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.3, 0.4], atol=0.01)
