"""The public users of `--public-users`: a public rule of the user index and a salt, not of
their data, that splits the users in two."""
import numpy as np
import pytest

from dprec.data import public_users
from dprec.data.sequences import SequenceData
from dprec.errors import DprecError


def _data(users):
  rng = np.random.default_rng(0)
  return SequenceData(users=np.arange(1, users + 1), train=[rng.integers(1, 6, 3)
                                                            for _ in range(users)],
                      valid_items=np.ones(users, np.int64), test_items=np.ones(users, np.int64),
                      item_frequencies=np.zeros(6), stats={})


def test_the_rule_picks_about_the_fraction_from_the_index_and_salt_only():
  users = np.arange(1, 5001)
  picked = public_users.is_public(users, 0.1)
  assert 0.09 < picked.mean() < 0.11
  np.testing.assert_array_equal(picked, public_users.is_public(users, 0.1))
  assert (picked != public_users.is_public(users, 0.1, salt=1)).any()
  assert not (picked & ~public_users.is_public(users, 0.2)).any()  # nested in larger fractions
  with pytest.raises(DprecError, match="public-users"):
    public_users.is_public(users, 1.0)


def test_split_partitions_the_users():
  data = _data(200)
  private, public = public_users.split(data, 0.25)
  assert sorted(np.concatenate([private.users, public.users]).tolist()) == list(range(1, 201))
  picked = public_users.is_public(data.users, 0.25)
  np.testing.assert_array_equal(public.users, data.users[picked])
  assert all(np.array_equal(a, data.train[u - 1]) for a, u in zip(public.train, public.users))
  assert public_users.split(data, 0.0) == (data, None)
