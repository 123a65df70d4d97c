"""User-level accounting: ULS is the sampled Gaussian at q over users; ELS protects a user of at
most k rows as a group (mixture of Gaussians, or the generic (kε, k·e^((k−1)ε)·δ) conversion);
the ledger keeps one unit and refuses unconverted row-level charges on a user-level budget."""
import json
import math

import dp_accounting
import pytest
from scipy import stats

from dprec import privacy
from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import calibration
from dprec.privacy.ledger import PrivacyLedger

# dp-accounting 0.4.3 (the legacy stack's pin) has no mixture of Gaussians (0.4.4 has).
needs_mixture = pytest.mark.skipif(
    not hasattr(dp_accounting.dp_event, "MixtureOfGaussiansDpEvent"),
    reason="dp-accounting < 0.4.4: no mixture of Gaussians PLD")

DELTA = 1e-6
# (σ, q, T, k): σ large enough for the mixture's PLD to build quickly.
GROUP_CASE = (4.0, 0.02, 200, 4)


def _direct(event, delta=DELTA):
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  return accountant.compose(event).get_epsilon(delta)


def test_user_level_sampling_epsilon_equals_dp_accounting():
  """ULS: q over users, T from the users per batch and epochs; σ calibrated for ε = 2."""
  users, users_per_batch = 5_000, 100
  q, steps = privacy.dataset_sampling(users, users_per_batch, epochs=2)
  sigma = privacy.calibrate_noise_multiplier(2.0, DELTA, q, steps)
  direct = _direct(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
  assert privacy.compute_epsilon(sigma, q, steps, DELTA).epsilon == pytest.approx(direct, rel=1e-9)
  assert direct <= 2.0


@needs_mixture
def test_example_level_group_epsilon_equals_dp_accounting_mixture():
  sigma, q, steps, k = GROUP_CASE
  counts = list(range(k + 1))
  mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
      sigma, [float(m) for m in counts], list(stats.binom.pmf(counts, k, q)))
  direct = _direct(dp_accounting.SelfComposedDpEvent(mixture, steps))
  assert accounting.group_epsilon(sigma, q, steps, k, DELTA) == pytest.approx(direct, rel=1e-9)


def test_group_privacy_is_the_formula():
  assert accounting.group_privacy(0.5, 1e-7, 3) == pytest.approx((1.5, 3 * math.exp(1.0) * 1e-7))
  assert accounting.group_privacy(0.5, 0.0, 3) == (1.5, 0.0)
  assert accounting.group_privacy(0.7, 1e-7, 1) == (0.7, 1e-7)


@needs_mixture
def test_group_conversion_meets_the_formula_and_bounds_exceed_the_row_level():
  sigma, q, steps, k = GROUP_CASE
  row = privacy.compute_epsilon(sigma, q, steps, DELTA).epsilon
  converted = accounting.group_epsilon(sigma, q, steps, k, DELTA, method="conversion")
  mixture = accounting.group_epsilon(sigma, q, steps, k, DELTA)
  # kε at a δ_row with k·e^((k−1)ε)·δ_row <= δ: the row's PLD at ε = converted / k.
  row_pld = accounting._period_pld(sigma, q, steps, accounting.PLD_DISCRETIZATION)
  row_epsilon = converted / k
  row_delta = row_pld.get_delta_for_epsilon(row_epsilon)
  assert k * math.exp((k - 1) * row_epsilon) * row_delta <= DELTA * (1 + 1e-9)
  assert row < mixture <= converted * (1 + 1e-3)  # the mixture is exact for the worst user
  one = accounting.group_epsilon(sigma, q, steps, 1, DELTA, method="conversion")
  assert one == pytest.approx(row, rel=1e-9)
  assert accounting.group_epsilon(sigma, q, steps, 1, DELTA) == pytest.approx(row, rel=1e-9)


@needs_mixture
def test_calibrated_sigma_for_a_user_under_example_level_sampling():
  _, q, steps, k = GROUP_CASE
  target, rtol = 1.5, 1e-3
  sigma = calibration.calibrate_noise_multiplier(target, DELTA, q, steps, rtol=rtol, group_size=k)
  assert accounting.group_epsilon(sigma, q, steps, k, DELTA) <= target
  assert accounting.group_epsilon(sigma * (1 - rtol), q, steps, k, DELTA) > target
  assert sigma > calibration.calibrate_noise_multiplier(target, DELTA, q, steps)


def test_rdp_refuses_groups_and_k_below_one_is_refused():
  with pytest.raises(DprecError, match="use --accountant pld"):
    accounting.group_epsilon(*GROUP_CASE, DELTA, accountant="rdp")
  for k in (0, 2.5):
    with pytest.raises(DprecError, match="--max-rows-per-user 1 or more"):
      accounting.TrainingPeriod(1.0, 0.1, 10, group_size=k)


# ---- the ledger's unit --------------------------------------------------------------------


def test_a_ledger_written_before_units_reads_as_row(tmp_path):
  path = tmp_path / "ledger.json"
  PrivacyLedger(path, 8.0, DELTA).charge_gaussian(2.0, 0.01, 100)
  data = json.loads(path.read_text())
  assert data["privacy_unit"] == "row" and data["charges"][0]["unit"] == "row"
  del data["privacy_unit"], data["charges"][0]["unit"]
  path.write_text(json.dumps(data))
  old = PrivacyLedger(path, unit="row")
  assert old.unit == "row" and old.summary()["privacy_unit"] == "row"
  with pytest.raises(DprecError, match="field privacy_unit: the ledger has 'row'"):
    PrivacyLedger(path, unit="user")


def test_user_level_budget_refuses_an_unconverted_row_charge(tmp_path):
  path = tmp_path / "ledger.json"
  ledger = PrivacyLedger(path, 8.0, DELTA, unit="user")
  before = path.read_bytes()
  for charge in (lambda: ledger.charge_gaussian(2.0, 0.01, 100, unit="row"),
                 lambda: ledger.charge_pure(0.1, label="top-k", unit="row")):
    with pytest.raises(DprecError, match="a row-level charge on a user-level budget is refused: "
                                         "convert it as a group of at most k rows") as raised:
      charge()
    assert "\n" not in str(raised.value)
  assert path.read_bytes() == before and ledger.charges == []


def test_row_level_budget_refuses_a_user_charge(tmp_path):
  path = tmp_path / "ledger.json"
  ledger = PrivacyLedger(path, 8.0, DELTA)
  with pytest.raises(DprecError, match="a user-level charge on a row-level budget is refused"):
    ledger.charge_gaussian(2.0, 0.01, 100, unit="user")
  with pytest.raises(DprecError, match="takes none"):
    ledger.charge_gaussian(2.0, 0.01, 100, group_size=3)
  assert ledger.charges == [] and json.loads(path.read_text())["charges"] == []


@needs_mixture
def test_converted_row_charges_on_a_user_budget(tmp_path):
  sigma, q, steps, k = GROUP_CASE
  ledger = PrivacyLedger(tmp_path / "ledger.json", 20.0, DELTA, unit="user")
  spent = ledger.charge_gaussian(sigma, q, steps, unit="row", group_size=k)
  assert spent == pytest.approx(accounting.group_epsilon(sigma, q, steps, k, DELTA), rel=1e-9)
  recorded = ledger.charges[-1]
  assert (recorded["unit"], recorded["group_size"], recorded["converted_from"]) == ("user", k,
                                                                                     "row")
  ledger.charge_pure(0.25, label="top-k", unit="row", group_size=k)
  assert ledger.charges[-1]["epsilon"] == pytest.approx(k * 0.25)
  assert ledger.epsilon_spent() == pytest.approx(spent + k * 0.25, rel=1e-9)
  # A Gaussian mechanism (q = 1) of row sensitivity C is one of sensitivity k·C for the user.
  histogram = PrivacyLedger(tmp_path / "histogram.json", 20.0, DELTA, unit="user")
  assert histogram.charge_gaussian_mechanism(6.0, "histogram", unit="row", group_size=3) == \
      pytest.approx(privacy.compute_epsilon(2.0, 1.0, 1, DELTA).epsilon, rel=1e-9)
  # User-level sampling charges the user unit directly: the plain sampled Gaussian.
  uls = PrivacyLedger(tmp_path / "uls.json", 20.0, DELTA, unit="user")
  assert uls.charge_gaussian(sigma, q, steps) == pytest.approx(
      privacy.compute_epsilon(sigma, q, steps, DELTA).epsilon, rel=1e-9)
  assert uls.charges[-1]["unit"] == "user" and "group_size" not in uls.charges[-1]


def test_a_group_below_one_row_is_refused_before_charging(tmp_path):
  path = tmp_path / "ledger.json"
  ledger = PrivacyLedger(path, 8.0, DELTA, unit="user")
  with pytest.raises(DprecError, match="--max-rows-per-user 1 or more"):
    ledger.charge_gaussian(2.0, 0.01, 100, unit="row", group_size=0)
  assert json.loads(path.read_text())["charges"] == []
