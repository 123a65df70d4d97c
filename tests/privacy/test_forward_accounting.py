"""SeqLDP accounting of DP-Forward over epochs and randomized response with a prior."""
import itertools
import math

import dp_accounting
import numpy as np
import pytest

from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import analytic_gaussian
from dprec.privacy import composition
from dprec.privacy import forward
from dprec.privacy import label_rr
from dprec.privacy.ledger import PrivacyLedger


@pytest.mark.parametrize("noise_multiplier,epochs", [(1.0, 1), (2.0, 5), (5.0, 30)])
def test_epoch_composition_equals_dp_accounting_directly(noise_multiplier, epochs):
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(noise_multiplier), epochs))
  direct = accountant.get_epsilon(1e-5)
  ours = forward.seqldp_epsilon(noise_multiplier, epochs, 1e-5)
  assert ours == pytest.approx(direct, rel=2e-3)
  # E Gaussian releases compose exactly to one with multiplier z/√E: the analytic answer.
  exact = analytic_gaussian.analytic_gaussian_sigma(ours, 1e-5) * math.sqrt(epochs)
  assert exact == pytest.approx(noise_multiplier, rel=2e-3)


def test_ledger_charging_one_release_per_epoch_reaches_the_same_epsilon(tmp_path):
  ledger = PrivacyLedger(tmp_path / "ledger.json", epsilon_budget=100.0, delta=1e-5)
  for _ in range(7):
    ledger.charge_gaussian(3.0, forward.RELEASE_SAMPLING_RATE, 1, label="dp-forward")
  assert ledger.epsilon_spent() == pytest.approx(forward.seqldp_epsilon(3.0, 7, 1e-5), rel=1e-12)


@pytest.mark.parametrize("epsilon,epochs", [(1.0, 1), (4.0, 3), (8.0, 10)])
def test_calibration_meets_target_over_epochs(epsilon, epochs):
  plan = forward.plan_forward(epsilon, 1e-5, epochs, norm_bound=1.0)
  assert plan.representation_epsilon <= epsilon
  assert plan.representation_epsilon == pytest.approx(epsilon, rel=2e-3)
  exact = analytic_gaussian.analytic_gaussian_sigma(epsilon, 1e-5) * math.sqrt(epochs)
  assert plan.noise_multiplier == pytest.approx(exact, rel=2e-3)
  assert plan.sigma == pytest.approx(2 * plan.noise_multiplier)
  assert plan.to_dict()["privacy_notion"] == "SeqLDP"
  assert "label is sent in the clear" in plan.to_dict()["privacy_note"]


def test_label_epsilon_is_deducted_and_reported():
  plan = forward.plan_forward(4.0, 1e-5, 2, norm_bound=1.0, label_epsilon=1.5)
  assert plan.representation_epsilon == pytest.approx(2.5, rel=2e-3)
  assert plan.epsilon == pytest.approx(4.0, rel=2e-3)
  report = plan.to_dict()
  assert report["privacy_notion"] == "LDP" and report["label_epsilon"] == 1.5


def test_what_a_ledger_spent_before_is_composed_into_the_plan():
  """A selection spent before is deducted; a Gaussian release spent before is composed with the
  E releases in the PLD accountant (checked against dp_accounting called directly)."""
  selection = composition.Spent(selections=((1.0, 0.0),))
  assert forward.plan_forward(4.0, 1e-5, 2, 1.0, spent=selection).noise_multiplier == \
      pytest.approx(forward.plan_forward(3.0, 1e-5, 2, 1.0).noise_multiplier, rel=1e-9)
  earlier = composition.Spent(periods=(accounting.TrainingPeriod(2.0, 1.0, 3),))
  plan = forward.plan_forward(4.0, 1e-5, 2, 1.0, spent=earlier)
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3))
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(plan.noise_multiplier), 2))
  assert 3.99 < accountant.get_epsilon(1e-5) <= 4.0 + 1e-6
  assert plan.noise_multiplier > forward.plan_forward(4.0, 1e-5, 2, 1.0).noise_multiplier


def test_bad_plans():
  with pytest.raises(DprecError, match="whole number"):
    forward.plan_forward(1.0, 1e-5, 1.5, 1.0)
  with pytest.raises(DprecError, match="leaves nothing"):
    forward.plan_forward(1.0, 1e-5, 1, 1.0, label_epsilon=1.0)


def test_rr_with_prior_is_epsilon_ldp_brute_force():
  """Every output's probability ratio over any two inputs is at most e^ε, and reaches it."""
  prior = np.array([0, 0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
  rr = label_rr.rr_with_prior(prior, 1.0)
  assert 1 < rr.k < 6
  rows = np.array([rr.output_probabilities(y) for y in range(1, 7)])
  np.testing.assert_allclose(rows.sum(1), 1.0)
  ratio = max((rows[a] / rows[b]).max() for a, b in itertools.permutations(range(6), 2))
  assert ratio == pytest.approx(math.e, rel=1e-9)


def test_rr_with_prior_chooses_k_by_expected_keep_and_samples_it():
  prior = np.array([0, 0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
  eps = 1.0
  rr = label_rr.rr_with_prior(prior, eps)
  scores = [math.exp(eps) / (math.exp(eps) + k - 1) * prior[1:k + 1].sum() for k in range(1, 7)]
  assert rr.k == int(np.argmax(scores)) + 1
  rng = np.random.default_rng(0)
  for label in (1, 6):
    out = rr.apply(np.full(60000, label), rng)
    empirical = np.array([(out == c).mean() for c in rr.candidates])
    np.testing.assert_allclose(empirical, rr.output_probabilities(label), atol=0.01)
  np.testing.assert_array_equal(rr.apply(np.zeros(5, int), rng), 0)  # no label stays none


def test_rr_with_uniform_prior_is_plain_randomized_response_at_large_epsilon():
  rr = label_rr.rr_with_prior(np.ones(5), 20.0)
  assert rr.k == 4 and rr.keep_probability == pytest.approx(
      math.exp(20) / (math.exp(20) + 3))
