"""Poisson batches are i.i.d. Bernoulli(q) inclusions; fixed batches are exact-size epochs."""
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dprec.training import poisson


def _inclusion_matrix(num_examples, q, steps, seed):
  rng = np.random.default_rng(seed)
  included = np.zeros((steps, num_examples), dtype=bool)
  for step, indices in enumerate(poisson.poisson_batch_indices(num_examples, q, steps, rng)):
    assert np.all(np.diff(indices) > 0), "indices must be distinct"
    included[step, indices] = True
  return included


def test_poisson_inclusions_are_independent_bernoulli():
  num_examples, q, steps = 200, 0.05, 4000
  included = _inclusion_matrix(num_examples, q, steps, seed=1)
  # Every example's inclusion count over the steps is Binomial(steps, q): chi-square over examples.
  counts = included.sum(axis=0)
  expected = steps * q
  chi2 = np.sum((counts - expected) ** 2 / (expected * (1 - q)))
  assert stats.chi2.sf(chi2, df=num_examples) > 1e-3
  # Pairs of examples are included independently: P(both) = q².
  both = np.mean(included[:, 0] & included[:, 1])
  assert stats.binomtest(int(both * steps), steps, q * q).pvalue > 1e-3


def test_poisson_batch_size_distribution():
  rng = np.random.default_rng(2)
  sizes = np.array([len(b) for b in poisson.poisson_batch_indices(10 ** 6, 1e-3, 3000, rng)])
  binom = stats.binom(10 ** 6, 1e-3)
  assert abs(sizes.mean() - binom.mean()) < 4 * binom.std() / np.sqrt(len(sizes))
  assert abs(sizes.var() / binom.var() - 1) < 0.1


def test_fixed_batches_cover_each_epoch_exactly_once():
  sampling = poisson.BatchSampling(batch_size=10, poisson=False, entropy=3)
  batches = list(poisson.batch_indices(35, sampling, steps=7))
  assert [len(b) for b in batches] == [10] * 7
  for epoch in range(2):  # 3 full batches per epoch; the 5 left over are dropped
    seen = np.concatenate(batches[3 * epoch:3 * epoch + 3])
    assert len(np.unique(seen)) == 30


def test_sampling_rate_and_validation():
  assert poisson.BatchSampling(batch_size=8).sampling_rate(64) == 0.125
  with pytest.raises(ValueError, match="exceeds"):
    poisson.BatchSampling(batch_size=8).sampling_rate(4)
  with pytest.raises(ValueError):
    poisson.BatchSampling(batch_size=0)
  with pytest.raises(ValueError, match="equal length"):
    poisson.sampled_dataset({"a": np.zeros(3), "b": np.zeros(4)}, None,
                            poisson.BatchSampling(batch_size=1), steps=1)


def test_sampled_dataset_has_variable_batch_and_matching_rows():
  features = {"x": np.arange(100, dtype=np.int64)[:, None] * np.ones((1, 3), np.int64)}
  labels = np.arange(100, dtype=np.float32)
  dataset = poisson.sampled_dataset(features, labels, poisson.BatchSampling(10, entropy=4),
                                    steps=20)
  assert dataset.element_spec[0]["x"].shape.as_list() == [None, 3]
  sizes = []
  for batch, label in dataset:
    np.testing.assert_array_equal(batch["x"][:, 0].numpy(), label.numpy().astype(np.int64))
    sizes.append(len(label))
  assert len(sizes) == 20 and len(set(sizes)) > 1


def test_dataset_to_arrays_round_trip():
  source = tf.data.Dataset.from_tensor_slices({"a": np.arange(10), "b": np.ones((10, 2))}).batch(3)
  arrays = poisson.dataset_to_arrays(source)
  np.testing.assert_array_equal(arrays["a"], np.arange(10))
  assert arrays["b"].shape == (10, 2)


def test_a_cap_truncates_poisson_batches_to_a_uniform_subset():
  num_examples, q, steps, cap = 400, 0.05, 2000, 22
  capped = list(poisson.poisson_batch_indices(num_examples, q, steps, np.random.default_rng(3),
                                              max_batch_size=cap))
  sizes = np.array([len(b) for b in capped])
  # min(Binomial(N, q), B_max): the capped sizes' histogram against the truncated Binomial's.
  expected = np.append(stats.binom.pmf(np.arange(cap), num_examples, q),
                       stats.binom.sf(cap - 1, num_examples, q)) * steps
  observed = np.bincount(sizes, minlength=cap + 1)
  keep = expected >= 5
  chi2 = np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep])
  assert sizes.max() == cap and stats.chi2.sf(chi2, df=keep.sum() - 1) > 1e-3
  # Within a truncated batch every example is as likely to stay.
  kept = np.bincount(np.concatenate([b for b in capped if len(b) == cap]), minlength=num_examples)
  assert stats.chisquare(kept).pvalue > 1e-3
