"""The privacy ledger: exact ε from its charges, atomic writes that survive kills, budget
refusal."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import dp_accounting
import pytest

from dprec import privacy
from dprec.errors import BudgetExceededError
from dprec.errors import DprecError

DELTA = 1e-5


def _direct_pld(events):
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  return accountant.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(DELTA)


def test_new_ledger_needs_budget_and_reloads(tmp_path):
  path = tmp_path / "ledger.json"
  with pytest.raises(DprecError, match="needs a budget"):
    privacy.PrivacyLedger(path)
  ledger = privacy.PrivacyLedger(path, epsilon_budget=5.0, delta=DELTA)
  assert path.exists() and ledger.epsilon_spent() == 0.0 and ledger.remaining() == 5.0
  spent = ledger.charge_gaussian(1.0, 0.01, 200, label="day 0")
  again = privacy.PrivacyLedger(path)
  assert again.epsilon_budget == 5.0 and again.delta == DELTA
  assert again.epsilon_spent() == spent == again.charges[-1]["epsilon_so_far"]
  with pytest.raises(DprecError, match="field delta"):
    privacy.PrivacyLedger(path, epsilon_budget=5.0, delta=1e-6)


@pytest.mark.parametrize("accountant,charges", [("rdp", 10), ("pld", 3)])
def test_identical_charges_merge_and_equal_dp_accounting(tmp_path, accountant, charges):
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=10.0, delta=DELTA,
                                 accountant=accountant)
  for _ in range(charges):
    ledger.charge_gaussian(1.0, 0.01, 100, label="period 0")
  assert len(ledger.charges) == 1
  entry = ledger.charges[0]
  assert entry["steps"] == 100 * charges and entry["merged"] == charges
  if accountant == "rdp":
    expected = dp_accounting.rdp.RdpAccountant().compose(
        privacy.dp_sgd_event(1.0, 0.01, 100 * charges)).get_epsilon(DELTA)
  else:
    expected = _direct_pld([privacy.dp_sgd_event(1.0, 0.01, 100 * charges)])
  assert ledger.epsilon_spent() == pytest.approx(expected, rel=1e-9)
  assert entry["epsilon_so_far"] == pytest.approx(expected, rel=1e-9)


def test_periods_and_selection_compose_into_one_total(tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=10.0, delta=DELTA)
  ledger.charge_pure(0.1, label="top-k")
  ledger.charge_gaussian(1.0, 0.01, 100, label="day 0")
  ledger.charge_gaussian(1.2, 0.02, 50, poisson=False, label="day 1")
  ledger.charge_pure(0.05, label="top-k refresh")
  ledger.charge_gaussian(1.0, 0.01, 100, label="day 2")  # same (σ, q) as day 0: one period
  training = _direct_pld([privacy.dp_sgd_event(1.0, 0.01, 200),
                          privacy.dp_sgd_event(1.2, 0.02, 50)])
  summary = ledger.summary()
  assert summary["training_epsilon"] == pytest.approx(training, rel=1e-6)
  assert summary["selection_epsilon"] == pytest.approx(0.15)
  assert summary["epsilon_spent"] == pytest.approx(training + 0.15, rel=1e-6)
  assert summary["note"] == privacy.NOT_POISSON_NOTE
  assert [c["epsilon_so_far"] for c in ledger.charges] == sorted(
      c["epsilon_so_far"] for c in ledger.charges)
  periods = [privacy.TrainingPeriod(1.0, 0.01, 200), privacy.TrainingPeriod(1.2, 0.02, 50)]
  direct = privacy.compose_periods(periods, DELTA, selections=[(0.1, 0), (0.05, 0)])
  assert direct.epsilon == pytest.approx(summary["epsilon_spent"], rel=1e-12)


def test_over_budget_charge_is_refused_and_nothing_recorded(tmp_path):
  path = tmp_path / "l.json"
  ledger = privacy.PrivacyLedger(path, epsilon_budget=1.0, delta=DELTA)
  spent = ledger.charge_gaussian(1.0, 0.01, 100)
  before = path.read_bytes()
  assert ledger.epsilon_if_charged(1.0, 0.01, 100000) > 1.0
  with pytest.raises(BudgetExceededError, match=r"left") as error:
    ledger.charge_gaussian(1.0, 0.01, 100000)
  assert f"{1.0 - spent:.6g} left" in str(error.value)
  with pytest.raises(BudgetExceededError):
    ledger.charge_pure(1.0 - spent + 1e-6, label="top-k")
  assert path.read_bytes() == before
  assert ledger.charges[0]["steps"] == 100 and len(ledger.charges) == 1
  assert ledger.charge_pure(0.5 * (1.0 - spent)) <= 1.0  # what is left can still be spent


def test_leftover_temp_file_from_a_kill_is_ignored(tmp_path):
  path = tmp_path / "ledger.json"
  ledger = privacy.PrivacyLedger(path, epsilon_budget=3.0, delta=DELTA)
  spent = ledger.charge_gaussian(1.0, 0.01, 100)
  torn = tmp_path / "ledger.json.abc123.tmp"  # a second write killed before its rename
  torn.write_text('{"format": "dprec-privacy-ledger-v1", "charges": [{"mech')
  reloaded = privacy.PrivacyLedger(path, epsilon_budget=3.0, delta=DELTA)
  assert reloaded.epsilon_spent() == spent and reloaded.charges == ledger.charges
  assert not torn.exists()


def test_failed_rename_keeps_old_ledger(tmp_path, monkeypatch):
  path = tmp_path / "ledger.json"
  ledger = privacy.PrivacyLedger(path, epsilon_budget=3.0, delta=DELTA)
  ledger.charge_gaussian(1.0, 0.01, 100)
  before = path.read_bytes()

  def crash(src, dst):
    raise OSError("disk full")

  monkeypatch.setattr(os, "replace", crash)
  with pytest.raises(OSError):
    ledger.charge_gaussian(1.0, 0.01, 100)
  monkeypatch.undo()
  assert path.read_bytes() == before and ledger.charges[0]["steps"] == 100
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json", "ledger.json.lock"]


def test_ledger_survives_sigkill_during_writes(tmp_path):
  path = tmp_path / "ledger.json"
  script = textwrap.dedent(f"""
      from dprec.privacy import PrivacyLedger
      ledger = PrivacyLedger({str(path)!r}, epsilon_budget=1e9, delta={DELTA}, accountant="rdp")
      i = 0
      while True:
        ledger.charge_gaussian(1.0, 0.01, 10, label=str(i % 2))
        i += 1
      """)
  child = subprocess.Popen([sys.executable, "-c", script])
  try:
    deadline = time.time() + 60
    while time.time() < deadline:
      try:
        if len(json.loads(path.read_text())["charges"]) >= 20:
          break
      except (OSError, ValueError, KeyError):
        pass  # not created yet: a reader never sees a torn file once it exists
      time.sleep(0.05)
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  reloaded = privacy.PrivacyLedger(path)
  assert len(reloaded.charges) >= 20
  steps = sum(c["steps"] for c in reloaded.charges)
  expected = privacy.compute_epsilon(1.0, 0.01, steps, DELTA, accountant="rdp").epsilon
  assert reloaded.epsilon_spent() == pytest.approx(expected, rel=1e-12)
  assert reloaded.charges[-1]["epsilon_so_far"] == pytest.approx(expected, rel=1e-12)
  assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_ledger_is_an_error_not_a_fresh_start(tmp_path):
  path = tmp_path / "ledger.json"
  path.write_text('{"format": "dprec-privacy-ledger-v1", "charg')
  with pytest.raises(DprecError, match="cannot read the privacy ledger"):
    privacy.PrivacyLedger(path, epsilon_budget=1.0, delta=DELTA)


def test_snapshot_copies_the_ledger(tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=3.0, delta=DELTA)
  ledger.charge_pure(0.2, label="top-k")
  ledger.snapshot(tmp_path / "ckpt.json")
  copy = privacy.PrivacyLedger(tmp_path / "ckpt.json")
  assert copy.charges == ledger.charges and copy.epsilon_spent() == pytest.approx(0.2)


def test_approximate_selection_charge_takes_its_delta_from_training(tmp_path):
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=5.0, delta=DELTA,
                                 accountant="rdp")
  ledger.charge_approximate(0.2, DELTA / 10, label="top-k (zCDP)")
  spent = ledger.charge_gaussian(1.0, 0.01, 300)
  training = dp_accounting.rdp.RdpAccountant().compose(
      privacy.dp_sgd_event(1.0, 0.01, 300)).get_epsilon(DELTA - DELTA / 10)
  assert spent == pytest.approx(training + 0.2, rel=1e-12)
  summary = ledger.summary()
  assert summary["training_delta"] == pytest.approx(0.9 * DELTA)
  assert summary["selection_delta"] == pytest.approx(DELTA / 10)
  with pytest.raises(DprecError):
    ledger.charge_approximate(0.1, DELTA)  # would leave no δ for training


DATA = {"path": "/data/out", "id": "a1"}


def _for_run(path, run_id, dataset=DATA, stage=None):
  """The ledger at `path` as run `run_id` on `dataset` opens it (reloaded: one writer at a time)."""
  marks = {"dataset": dataset, **({"stage": stage} if stage else {})}
  return privacy.PrivacyLedger(path, run_id=run_id, marks=marks)


def test_spent_before_a_run_is_what_preceded_its_first_charge(tmp_path):
  path = tmp_path / "l.json"
  privacy.PrivacyLedger(path, epsilon_budget=10.0, delta=DELTA)
  _for_run(path, "pre", stage="preprocessing").charge_pure(0.2, label="dp top-k vocabulary")
  _for_run(path, "first").charge_gaussian(1.0, 0.01, 100, label="first")
  _for_run(path, "second").charge_gaussian(2.0, 0.01, 50, label="second")
  _for_run(path, "first").charge_gaussian(1.0, 0.01, 100, label="first")  # resumed
  ledger = privacy.PrivacyLedger(path)
  vocabulary = ((0.2, 0.0),)
  assert ledger.spent_before("pre") == privacy.Spent()
  # A resumed run composes what it found when it started, not another run's later charge...
  assert ledger.spent_before("first") == privacy.Spent(selections=vocabulary)
  assert ledger.spent_before("second") == privacy.Spent(
      periods=(privacy.TrainingPeriod(1.0, 0.01, 100),), selections=vocabulary)
  # ... which a new run composes with everything else, as the ledger's total does.
  everything = ledger.spent_before("new")
  assert everything == privacy.Spent(periods=(privacy.TrainingPeriod(1.0, 0.01, 200),
                                              privacy.TrainingPeriod(2.0, 0.01, 50)),
                                     selections=vocabulary)
  direct = _direct_pld([privacy.dp_sgd_event(1.0, 0.01, 200), privacy.dp_sgd_event(2.0, 0.01, 50)])
  assert ledger.epsilon_spent() == pytest.approx(direct + 0.2, rel=1e-6)


def test_parts_split_preprocessing_from_training_and_add_up(tmp_path):
  path = tmp_path / "l.json"
  privacy.PrivacyLedger(path, epsilon_budget=10.0, delta=DELTA)
  _for_run(path, "pre", stage="preprocessing").charge_pure(0.2, label="dp top-k vocabulary")
  run = _for_run(path, "run")
  run.charge_gaussian(1.0, 0.01, 100, label="training")
  run.charge_pure(0.1, label="dp-fest top-k")
  parts = run.parts()
  preprocessing, training = parts["preprocessing_selection"], parts["training"]
  assert preprocessing["epsilon"] == 0.2 and preprocessing["delta"] == 0.0
  assert [c["dataset"] for c in preprocessing["charges"]] == [DATA]
  gaussian = _direct_pld([privacy.dp_sgd_event(1.0, 0.01, 100)])
  assert training["epsilon"] == pytest.approx(gaussian + 0.1, rel=1e-9)
  assert training["delta"] == DELTA and training["runs"] == ["run"]
  assert preprocessing["epsilon"] + training["epsilon"] == pytest.approx(run.epsilon_spent())


def test_charges_for_another_data_set_are_refused(tmp_path):
  path = tmp_path / "l.json"
  privacy.PrivacyLedger(path, epsilon_budget=10.0, delta=DELTA)
  _for_run(path, "pre", stage="preprocessing").charge_pure(0.2, label="dp top-k vocabulary")
  ledger = privacy.PrivacyLedger(path)
  for same in (DATA, {"path": "/moved/out", "id": "a1"}, {"path": "/data/out", "id": None}, None):
    ledger.check_dataset(same)  # the same id, or the same path where an id is missing
  for other in ({"path": "/data/out", "id": "b2"}, {"path": "/data/other", "id": None}):
    with pytest.raises(DprecError, match=r"another data set: dp top-k vocabulary \(run pre\) "
                                         r"for /data/out \(id a1\)"):
      ledger.check_dataset(other)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_selections_alone_spend_exactly_their_sum(tmp_path, accountant):
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=1.0, delta=DELTA,
                                 accountant=accountant)
  ledger.charge_pure(0.2, label="dp top-k vocabulary")
  assert ledger.epsilon_spent() == 0.2  # no Gaussian release: no RDP conversion slack


def test_two_processes_sharing_a_ledger_lose_no_charge(tmp_path):
  """Two runs charging one ledger file (each with its own, stale, copy in memory): both charges
  are kept and the budget counts both; a charge over it is refused."""
  path = tmp_path / "ledger.json"
  first = privacy.PrivacyLedger(path, epsilon_budget=1.0, delta=DELTA, run_id="a")
  second = privacy.PrivacyLedger(path, run_id="b")
  first.charge_pure(0.4, label="a")
  second.charge_pure(0.4, label="b")  # `second` has not seen a's charge in memory
  on_disk = privacy.PrivacyLedger(path)
  assert [c["run_id"] for c in on_disk.charges] == ["a", "b"]
  assert on_disk.epsilon_spent() == pytest.approx(0.8) == second.epsilon_spent()
  with pytest.raises(BudgetExceededError):
    first.charge_pure(0.4, label="a")  # 0.4 + 0.4 + 0.4 > 1, though `first` knew only 0.4
  assert len(privacy.PrivacyLedger(path).charges) == 2


def test_charges_of_disjoint_days_compose_in_parallel(tmp_path):
  """A row lives in one day: ε is the worst day's charges composed with those reading every day
  (a row-level stream), computed by dp_accounting directly."""
  ledger = privacy.PrivacyLedger(tmp_path / "l.json", epsilon_budget=10.0, delta=DELTA)
  ledger.charge_pure(0.1, label="dp top-k refresh")  # running counts: every day
  ledger.charge_gaussian_mechanism(20.0, label="base rate", days=[0])
  for day in range(3):
    ledger.charge_gaussian(1.0, 0.01, 100, label=f"period {day}", days=[day])
  worst = _direct_pld([dp_accounting.GaussianDpEvent(20.0), privacy.dp_sgd_event(1.0, 0.01, 100)])
  other = _direct_pld([privacy.dp_sgd_event(1.0, 0.01, 100)])
  assert ledger.epsilon_spent() == pytest.approx(worst + 0.1, rel=1e-9)
  by_days = ledger.parts()["training"]["by_days"]
  assert [d["days"] for d in by_days] == [[0], [1], [2]]
  assert [d["epsilon"] for d in by_days] == pytest.approx([worst + 0.1] + [other + 0.1] * 2,
                                                         rel=1e-9)
  reloaded = privacy.PrivacyLedger(tmp_path / "l.json")  # the days are on disk
  assert reloaded.epsilon_spent() == pytest.approx(worst + 0.1, rel=1e-9)
  # Sequential charges of the same releases cost more: the parallel total is below it.
  sequential = _direct_pld([dp_accounting.GaussianDpEvent(20.0),
                            privacy.dp_sgd_event(1.0, 0.01, 300)]) + 0.1
  assert ledger.epsilon_spent() < sequential
  # A release reading days 1 and 2 composes with both days' charges.
  ledger.charge_gaussian(1.0, 0.01, 100, label="days 1-2", days=[1, 2])
  both = _direct_pld([privacy.dp_sgd_event(1.0, 0.01, 200)])
  assert ledger.epsilon_spent() == pytest.approx(max(worst, both) + 0.1, rel=1e-9)
  assert ledger.spent_before("someone else").periods  # a plan composes them all (upper bound)
