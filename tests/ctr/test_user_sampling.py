"""User-level Poisson batches: each user joins each step with probability q, brings at most k of
their rows, and the rows carry their unit index (contiguous, increasing)."""
import numpy as np
import pytest
from scipy import stats

from dprec.errors import DprecError
from dprec.training import user_sampling

# An insecure, fixed seed: tests only (runs pass bits of their secret key).
SEED = 20241207


def _users(num_users=300, seed=3):
  """User ids of a shuffled log where user u has 1..12 rows (ids sparse, not 0..U-1)."""
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(num_users) * 7 + 5, rng.integers(1, 13, num_users))
  return rng.permutation(ids)


def test_steps_joined_per_user_is_binomial():
  ids, q, steps = _users(), 0.1, 40
  sampling = user_sampling.UserSampling(q * 300, max_rows_per_user=3, entropy=SEED)
  users = user_sampling.UserRows.group(ids)
  joined, sizes = np.zeros(users.num_users, dtype=int), []
  for rows, unit in user_sampling.user_batch_indices(users, sampling, steps):
    present = np.unique(ids[rows])
    assert len(present) == (unit[-1] + 1 if unit.size else 0)
    joined[np.searchsorted(np.unique(ids), present)] += 1
    sizes.append(len(present))
  # Users per batch vary as Binomial(U, q) (a fixed-size sample would not vary).
  assert np.var(sizes) > 0.3 * users.num_users * q * (1 - q)
  # Chi-square goodness of fit of the users' join counts to Binomial(T, q), tails pooled.
  support = np.arange(steps + 1)
  expected = stats.binom.pmf(support, steps, q) * users.num_users
  low, high = np.searchsorted(np.cumsum(expected), 5), np.searchsorted(
      np.cumsum(expected[::-1]), 5)
  edges = [low, steps - high]
  observed = np.array([np.sum(joined <= edges[0])]
                      + [np.sum(joined == j) for j in range(edges[0] + 1, edges[1])]
                      + [np.sum(joined >= edges[1])])
  pooled = np.array([expected[:edges[0] + 1].sum()] + list(expected[edges[0] + 1:edges[1]])
                    + [expected[edges[1]:].sum()])
  assert stats.chisquare(observed, pooled * observed.sum() / pooled.sum()).pvalue > 1e-3


def test_batches_keep_at_most_k_rows_per_user_with_contiguous_increasing_units():
  ids, k = _users(), 4
  labels = np.arange(len(ids))
  features = {"x": np.arange(len(ids)) * 10, "user": ids}
  sampling = user_sampling.UserSampling(60, max_rows_per_user=k, entropy=SEED)
  rows_of = {u: set(np.flatnonzero(ids == u)) for u in np.unique(ids)}
  seen_all = set()
  for batch, y in user_sampling.user_batches(features, labels, ids, sampling, steps=30):
    unit = batch[user_sampling.UNIT_KEY]
    assert unit.dtype == np.int32
    assert np.all(np.diff(unit) >= 0) and (unit.size == 0 or (unit[0] == 0 and np.all(
        np.diff(unit) <= 1)))  # contiguous, increasing, every index in [0, U) present
    assert np.array_equal(batch["x"], y * 10)
    for index in range(unit[-1] + 1 if unit.size else 0):
      members = batch["user"][unit == index]
      assert len(set(members)) == 1  # one user per unit
      user = members[0]
      assert len(members) == min(k, len(rows_of[user]))
      assert set(y[unit == index]) <= rows_of[user]
      seen_all |= set(y[unit == index])
    assert len(set(batch["user"])) == (unit[-1] + 1 if unit.size else 0)  # a user in one unit
  heavy = [u for u, rows in rows_of.items() if len(rows) > k]
  assert any(rows_of[u] <= seen_all for u in heavy)  # rows drawn afresh: more than k over time


def test_rows_of_a_user_are_a_uniform_k_subset():
  ids = np.repeat([1, 2], [5, 1])
  users = user_sampling.UserRows.group(ids)
  rng = np.random.default_rng(SEED)
  counts = np.zeros(5)
  for _ in range(3000):
    rows, _ = user_sampling.user_batch(users, 1.0, 2, rng)
    counts[rows[rows < 5]] += 1
  assert stats.chisquare(counts).pvalue > 1e-3


def test_a_resumed_run_draws_the_same_batches():
  ids = _users()
  sampling = user_sampling.UserSampling(40, max_rows_per_user=2, entropy=SEED)
  users = user_sampling.UserRows.group(ids)
  whole = list(user_sampling.user_batch_indices(users, sampling, 6))
  resumed = list(user_sampling.user_batch_indices(users, sampling, 6, start=4))
  for (a, b), (c, d) in zip(whole[4:], resumed):
    assert np.array_equal(a, c) and np.array_equal(b, d)


@pytest.mark.parametrize("ids,match", [
    (None, "needs a 'user_id' column"),
    (np.array([1.0, 2.0, 3.0]), "user ids must be integers"),
    (np.array([1, 2]), "every row needs one user id"),
    (np.array([1, -1, 3]), "row 1 .* non-negative id"),
])
def test_refuses_rows_without_integer_user_ids(ids, match):
  with pytest.raises(DprecError, match=match) as raised:
    list(user_sampling.user_batches({"x": np.zeros(3)}, None, ids,
                                    user_sampling.UserSampling(1, entropy=SEED), steps=1))
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize("k", [0, -2, 1.5])
def test_refuses_k_below_one(k):
  with pytest.raises(DprecError, match="--max-rows-per-user 1 or more") as raised:
    user_sampling.UserSampling(2, max_rows_per_user=k, entropy=SEED)
  assert "\n" not in str(raised.value)
