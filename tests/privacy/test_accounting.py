"""ε and σ from dprec.privacy against dp_accounting and tensorflow_privacy called directly."""
import math
import re

import dp_accounting
import pytest

from dprec import privacy
from dprec.errors import BudgetExceededError
from dprec.errors import DprecError

CRITEO_N = 45_840_617


def _pld_direct(sigma, q, steps, delta):
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
  return accountant.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("sigma,q,steps,delta", [
    (1.1, 256 / 60000, 704, 1e-5),
    (0.8, 0.01, 300, 1e-6),
    (3.0, 1.0, 5, 1e-5),
])
def test_pld_epsilon_equals_dp_accounting(sigma, q, steps, delta):
  result = privacy.compute_epsilon(sigma, q, steps, delta)
  assert result.accountant == "pld" and result.poisson and result.note == ""
  assert result.epsilon == pytest.approx(_pld_direct(sigma, q, steps, delta), rel=1e-9)


RDP_CASE = (60000, 256, 3, 1.1, 1e-5)  # n, batch, epochs, σ, δ


def _rdp_epsilon(n, batch, epochs, sigma, delta):
  q, steps = privacy.dataset_sampling(n, batch, epochs)
  return privacy.compute_epsilon(sigma, q, steps, delta, accountant="rdp").epsilon


def test_rdp_epsilon_equals_dp_accounting():
  n, batch, epochs, sigma, delta = RDP_CASE
  q, steps = privacy.dataset_sampling(n, batch, epochs)
  direct = dp_accounting.rdp.RdpAccountant().compose(
      privacy.dp_sgd_event(sigma, q, steps)).get_epsilon(delta)
  assert _rdp_epsilon(*RDP_CASE) == pytest.approx(direct, rel=1e-12)


def test_rdp_epsilon_equals_tensorflow_privacy(tensorflow_privacy):
  """Peer test (TF 2.15 + tensorflow_privacy)."""
  del tensorflow_privacy  # imported: its submodule below loads
  from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib as tfp_lib
  n, batch, epochs, sigma, delta = RDP_CASE
  ours = _rdp_epsilon(*RDP_CASE)
  # The statement uses dp_accounting's default orders, as we do: equal to its printed digits.
  statement = tfp_lib.compute_dp_sgd_privacy_statement(
      n, batch, epochs, sigma, delta, used_microbatching=False)
  printed = float(re.search(r"Poisson sampling \(\*\):\s+([0-9.]+)", statement).group(1))
  assert ours == pytest.approx(printed, abs=5e-4)
  # The deprecated helper uses a coarser order grid: same ε up to the grid.
  legacy, _ = tfp_lib.compute_dp_sgd_privacy(n, batch, sigma, epochs, delta)
  assert ours == pytest.approx(legacy, rel=1e-2)


def test_rdp_is_looser_than_pld():
  q, steps, delta = 0.01, 500, 1e-6
  pld = privacy.compute_epsilon(1.0, q, steps, delta).epsilon
  rdp = privacy.compute_epsilon(1.0, q, steps, delta, accountant="rdp").epsilon
  assert pld < rdp


def test_fixed_batches_are_flagged_and_accounted_as_poisson():
  poisson = privacy.compute_epsilon(1.0, 0.01, 100, 1e-5)
  fixed = privacy.compute_epsilon(1.0, 0.01, 100, 1e-5, poisson=False)
  assert fixed.epsilon == poisson.epsilon
  assert not fixed.poisson and fixed.note == privacy.NOT_POISSON_NOTE


def test_coarse_grid_epsilon_equals_dp_accounting():
  """The calibration search's grid: the same ε as dp_accounting's PLDAccountant on that grid."""
  periods = [privacy.TrainingPeriod(0.9, 0.01, 300), privacy.TrainingPeriod(2.0, 1.0, 1)]
  direct = privacy.make_accountant("pld", 1e-3).compose(dp_accounting.ComposedDpEvent(
      [privacy.dp_sgd_event(p.noise_multiplier, p.sampling_rate, p.steps) for p in periods]))
  ours = privacy.accounting.gaussian_epsilon(periods, 1e-6, pld_discretization=1e-3)
  assert ours == pytest.approx(direct.get_epsilon(1e-6), rel=1e-9)
  assert ours >= privacy.accounting.gaussian_epsilon(periods, 1e-6)  # pessimistic here


def test_criteo_known_value_sigma(monkeypatch):
  """Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
  arXiv:2311.08357: N=45,840,617, B=2048, one epoch, δ=1/N, ε=1 → σ ≈ 0.5765 (PLD), with two
  evaluations on the accounting grid (σ and σ·(1 − rtol)) and a short search on the coarse one."""
  q, steps = privacy.dataset_sampling(CRITEO_N, 2048, 1)
  assert steps == 22384
  grids = []
  accounted = privacy.accounting.gaussian_epsilon

  def counted(periods, delta, accountant="pld", pld_discretization=1e-4):
    grids.append(pld_discretization)
    return accounted(periods, delta, accountant, pld_discretization)

  monkeypatch.setattr(privacy.accounting, "gaussian_epsilon", counted)
  sigma = privacy.calibrate_noise_multiplier(1.0, 1 / CRITEO_N, q, steps)
  assert grids.count(privacy.accounting.PLD_DISCRETIZATION) == 2 and len(grids) <= 10
  assert sigma == pytest.approx(0.5765, rel=1e-3)
  epsilon = _pld_direct(sigma, q, steps, 1 / CRITEO_N)
  assert epsilon <= 1.0
  # Within 1e-3 relative of the optimum: 0.1% less noise already overspends.
  assert _pld_direct(sigma * (1 - 1e-3), q, steps, 1 / CRITEO_N) > 1.0


@pytest.mark.parametrize("accountant,q,steps,target", [
    ("pld", 1.0, 10, 2.0),
    ("rdp", 1024 / 67349, 66, 3.0),
    ("rdp", 2048 / CRITEO_N, 22384, 1.0),
])
def test_calibrated_sigma_reproduces_target(accountant, q, steps, target):
  delta = 1e-5
  sigma = privacy.calibrate_noise_multiplier(target, delta, q, steps, accountant=accountant)
  epsilon = privacy.compute_epsilon(sigma, q, steps, delta, accountant=accountant).epsilon
  assert epsilon <= target
  worse = privacy.compute_epsilon(sigma * (1 - 1e-3), q, steps, delta, accountant=accountant)
  assert worse.epsilon > target


def test_calibration_falls_back_to_the_accounting_grid(monkeypatch):
  """A search grid so coarse that its σ is valid but not within rtol of the optimum must not be
  returned: the search reruns on the accounting grid."""
  q, steps, delta, target = 1024 / 67349, 66, 1e-5, 3.0
  monkeypatch.setattr("dprec.privacy.calibration.COARSE_PLD_FACTOR", 2000)  # a grid of 0.2
  coarse = dp_accounting.calibrate_dp_mechanism(
      lambda: privacy.make_accountant("pld", 0.2),
      lambda s: privacy.dp_sgd_event(s, q, steps), target, delta)
  sigma = privacy.calibrate_noise_multiplier(target, delta, q, steps)
  assert coarse * (1 - 1e-3) > sigma  # the coarse answer alone was not within rtol
  assert _pld_direct(sigma, q, steps, delta) <= target
  assert _pld_direct(sigma * (1 - 1e-3), q, steps, delta) > target


def test_adafest_split_composes_back():
  for sigma, ratio in [(0.5765, 5.0), (1.0, 0.1), (2.0, 10.0)]:
    sigma1, sigma2 = privacy.adafest_noise_multipliers(sigma, ratio)
    assert sigma1 == pytest.approx(ratio * sigma2)
    assert privacy.composed_noise_multiplier(sigma1, sigma2) == pytest.approx(sigma)
  # Ghazi et al. 2023, §3.2: r=5 → σ2 = 1.0198σ, σ1 = 5.099σ.
  assert privacy.adafest_noise_multipliers(1.0, 5.0) == pytest.approx((5.099, 1.0198), abs=1e-4)


def test_composed_multiplier_equals_two_gaussians_in_pld():
  """One step with σ1 and σ2 on the same sample costs exactly one Gaussian with composed σ."""
  from dp_accounting.pld import privacy_loss_distribution as pld_lib
  sigma1, sigma2 = 2.0, 1.5
  two = pld_lib.from_gaussian_mechanism(sigma1).compose(pld_lib.from_gaussian_mechanism(sigma2))
  one = pld_lib.from_gaussian_mechanism(privacy.composed_noise_multiplier(sigma1, sigma2))
  for delta in (1e-3, 1e-6):
    assert two.get_epsilon_for_delta(delta) == pytest.approx(one.get_epsilon_for_delta(delta),
                                                             rel=2e-3)


def test_edge_cases_and_bad_input():
  assert privacy.compute_epsilon(1.0, 0.01, 0, 1e-5).epsilon == 0.0
  assert math.isinf(privacy.compute_epsilon(0.0, 0.01, 10, 1e-5).epsilon)
  for kwargs in ({"delta": 0.0}, {"sampling_rate": 1.5}, {"steps": -1}, {"accountant": "gdp"}):
    args = {"noise_multiplier": 1.0, "sampling_rate": 0.1, "steps": 10, "delta": 1e-5, **kwargs}
    with pytest.raises(DprecError):
      privacy.compute_epsilon(**args)
  with pytest.raises(DprecError):
    privacy.calibrate_noise_multiplier(-1.0, 1e-5, 0.1, 10)
  with pytest.raises(DprecError):
    privacy.dataset_sampling(100, 200, 1)


def test_plan_training_fits_periods_and_selection_into_the_target():
  periods, delta = [(0.01, 500), (0.02, 200)], 1e-5
  tried = []
  plan = privacy.plan_training(2.0, delta, periods, selection_epsilon=0.2, accountant="rdp",
                               progress=tried.append)
  assert len(tried) >= 3 and min(abs(s - plan.noise_multiplier) for s in tried) < 1e-3

  def direct(sigma):
    events = [privacy.dp_sgd_event(sigma, q, steps) for q, steps in periods]
    return dp_accounting.rdp.RdpAccountant().compose(
        dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)

  sigma = plan.noise_multiplier
  assert plan.composition.training_epsilon == pytest.approx(direct(sigma), rel=1e-12)
  assert plan.composition.selection_epsilon == 0.2
  assert plan.epsilon == pytest.approx(direct(sigma) + 0.2) and plan.epsilon <= 2.0
  assert direct(sigma * (1 - 1e-3)) > 1.8
  with pytest.raises(DprecError):
    privacy.plan_training(1.0, delta, periods, selection_epsilon=1.0)


def test_plan_training_composes_what_the_ledger_spent_before():
  """A DP top-k vocabulary (pure ε) and another run's steps recorded before this run: σ is
  calibrated for what they leave, and the total is their composition with the new steps."""
  delta, spent = 1e-5, privacy.Spent(periods=(privacy.TrainingPeriod(1.5, 0.02, 300),),
                                     selections=((0.2, 0.0),))
  plan = privacy.plan_training(2.0, delta, [(0.01, 500)], accountant="rdp", spent=spent)

  def direct(sigma):
    events = [privacy.dp_sgd_event(1.5, 0.02, 300), privacy.dp_sgd_event(sigma, 0.01, 500)]
    return dp_accounting.rdp.RdpAccountant().compose(
        dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)

  sigma = plan.noise_multiplier
  assert plan.epsilon == pytest.approx(direct(sigma) + 0.2, rel=1e-12) and plan.epsilon <= 2.0
  assert direct(sigma * (1 - 1e-3)) > 1.8  # calibrated for what is left, not merely safe
  alone = privacy.plan_training(2.0, delta, [(0.01, 500)], accountant="rdp").noise_multiplier
  assert sigma > alone
  with pytest.raises(BudgetExceededError, match="already spent epsilon 1.99.*nothing useful"):
    privacy.plan_training(2.0, delta, [(0.01, 500)], accountant="rdp",
                          spent=privacy.Spent(selections=((1.99, 0.0),)))
