"""The DP histogram of users per item (Re-Attention's p_i): sensitivity, noise scale, accounting."""
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.privacy import PrivacyLedger, accounting, calibration, user_histogram


def _rows(rng, users, max_items, num_items):
  """Left-padded rows of ≤ L items with repeats (0 = padding), as `train seqrec` builds them."""
  rows = rng.integers(1, num_items + 1, size=(users, max_items))
  lengths = rng.integers(1, max_items + 1, size=users)
  rows[np.arange(max_items)[None, :] < (max_items - lengths)[:, None]] = 0
  return rows


def test_counts_distinct_items_per_user_by_brute_force():
  rows = _rows(np.random.default_rng(0), 50, 6, 9)
  expected = np.zeros(10, np.int64)
  for row in rows:
    for item in set(row.tolist()) - {0}:
      expected[item] += 1
  np.testing.assert_array_equal(user_histogram.users_per_item(rows, 9), expected)
  with pytest.raises(DprecError, match="0..9"):
    user_histogram.users_per_item(rows + 10, 9)


def test_adding_or_removing_one_user_moves_it_by_at_most_sqrt_l():
  max_items, num_items = 7, 12
  rows = _rows(np.random.default_rng(1), 40, max_items, num_items)
  rows[0] = np.arange(1, max_items + 1)  # L distinct items: the bound is reached
  full = user_histogram.users_per_item(rows, num_items)
  moves = [np.linalg.norm(full - user_histogram.users_per_item(np.delete(rows, u, axis=0),
                                                               num_items))
           for u in range(len(rows))]
  assert max(moves) <= user_histogram.sensitivity(max_items) + 1e-12
  assert moves[0] == pytest.approx(math.sqrt(max_items))


@pytest.mark.parametrize("kind", ["numpy", "tf"])
def test_noise_std_is_sigma_sqrt_l_from_samples(kind):
  max_items, num_items, sigma = 4, 20_000, 1.5
  rows = _rows(np.random.default_rng(2), 30, max_items, num_items)
  generator = (np.random.default_rng(3) if kind == "numpy"
               else tf.random.Generator.from_seed(3))
  noise = (user_histogram.noisy_users_per_item(rows, num_items, sigma, generator)
           - user_histogram.users_per_item(rows, num_items))
  assert noise[0] == 0.0
  assert abs(noise[1:].mean()) < 0.05
  # 20,000 samples: the std's relative standard error is 0.5%.
  assert noise[1:].std() == pytest.approx(sigma * math.sqrt(max_items), rel=0.03)


def test_frequencies_are_clamped_to_one_over_n_and_one():
  rows = np.ones((10, 3), np.int64)  # every user holds item 1 only
  p = user_histogram.dp_item_frequencies(rows, 5, 0.01, np.random.default_rng(0))
  assert p[0] == 0.0 and p[1] == pytest.approx(1.0) and np.all(p[2:] == 0.1)
  with pytest.raises(DprecError, match="must be > 0"):
    user_histogram.dp_item_frequencies(rows, 5, 0.0, np.random.default_rng(0))


def test_histogram_composed_with_training_equals_dp_accounting(tmp_path):
  delta, q, steps, target = 1e-5, 0.01, 500, 3.0
  histogram_sigma = calibration.calibrate_gaussian_mechanism(0.05 * target, delta)
  alone = dp_accounting.pld.PLDAccountant().compose(
      dp_accounting.GaussianDpEvent(histogram_sigma)).get_epsilon(delta)
  assert alone == pytest.approx(0.05 * target, rel=2e-3) and alone <= 0.05 * target
  plan = calibration.plan_training(target, delta, [(q, steps)],
                                   gaussian_mechanisms=[histogram_sigma])
  direct = dp_accounting.pld.PLDAccountant()
  direct.compose(dp_accounting.GaussianDpEvent(histogram_sigma))
  direct.compose(accounting.dp_sgd_event(plan.noise_multiplier, q, steps))
  assert plan.epsilon == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
  assert plan.epsilon == pytest.approx(target, rel=2e-3) and plan.epsilon <= target
  # Training alone at that σ spends less than the target: the histogram's part is real.
  assert accounting.compute_epsilon(plan.noise_multiplier, q, steps, delta).epsilon < target
  ledger = PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=target, delta=delta)
  planned = ledger.epsilon_if_charged(plan.noise_multiplier, q, steps,
                                      gaussian_mechanisms=[(histogram_sigma, "hist")])
  ledger.charge_gaussian_mechanism(histogram_sigma, "hist")
  assert ledger.epsilon_spent() == pytest.approx(alone, rel=1e-9)
  ledger.charge_gaussian(plan.noise_multiplier, q, steps, label="train")
  assert ledger.epsilon_spent() == pytest.approx(direct.get_epsilon(delta), rel=1e-9) == planned
  rdp = accounting.make_accountant("rdp")
  rdp.compose(dp_accounting.GaussianDpEvent(histogram_sigma))
  rdp.compose(accounting.dp_sgd_event(plan.noise_multiplier, q, steps))
  assert accounting.gaussian_epsilon(
      [accounting.gaussian_mechanism_period(histogram_sigma),
       accounting.TrainingPeriod(plan.noise_multiplier, q, steps)], delta, "rdp") == \
      pytest.approx(rdp.get_epsilon(delta), rel=1e-12)
