"""The privacy plan of a stream and atomic checkpoints: checked against dp_accounting directly."""
import json
import math
import os

import dp_accounting
import pytest

from dprec import atomic_io
from dprec import privacy
from dprec.errors import DprecError
from dprec.training import checkpoint as ckpt_lib
from dprec.workflows.plan import plan_stream


def _direct_epsilon(sigma, q, steps, delta, accountant="pld"):
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if accountant == "pld":
    accountant = dp_accounting.pld.PLDAccountant(relation, 1e-4)
  else:
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
  accountant.compose(event, steps)
  return accountant.get_epsilon(delta)


def test_row_plan_spends_the_budget_on_one_period():
  """Rows live in one period: the periods compose in parallel, σ is one period's."""
  plan = plan_stream(1.0, 1e-5, expected_periods=4, examples_per_period=200, batch_size=20,
                     epochs_per_period=1.5)
  assert plan.parallel_periods and plan.privacy_unit == "row"
  direct = _direct_epsilon(plan.noise_multiplier, plan.sampling_rate, 15, 1e-5)
  assert direct == pytest.approx(1.0, rel=5e-3) and direct <= 1.0 + 1e-9
  assert plan.planned_epsilon() == pytest.approx(direct, rel=1e-9)
  assert plan.planned_epsilon(7) == plan.planned_epsilon()  # more periods cost no more
  sequential = plan_stream(1.0, 1e-5, expected_periods=4, examples_per_period=200,
                           batch_size=20, epochs_per_period=1.5, privacy_unit="user")
  assert plan.noise_multiplier < sequential.noise_multiplier / 1.5


def test_user_plan_spends_the_budget_over_the_expected_periods():
  plan = plan_stream(1.0, 1e-5, expected_periods=4, examples_per_period=200, batch_size=20,
                     epochs_per_period=1.5, privacy_unit="user")
  assert plan.sampling_rate == pytest.approx(20 / 200)
  assert plan.steps_per_period == 15
  direct = _direct_epsilon(plan.noise_multiplier, plan.sampling_rate, 4 * 15, 1e-5)
  assert direct <= 1.0 + 1e-9
  assert direct == pytest.approx(1.0, rel=5e-3)  # calibrated, not merely safe
  # one period more than planned would overspend: that is where a run must stop
  assert _direct_epsilon(plan.noise_multiplier, plan.sampling_rate, 5 * 15, 1e-5) > 1.0


def test_selection_budget_is_deducted_from_training():
  plan = plan_stream(2.0, 1e-5, expected_periods=3, examples_per_period=200, batch_size=20,
                     selection_epsilon=0.3, accountant="rdp", privacy_unit="user")
  assert plan.selection_epsilon_per_period == pytest.approx(0.1)
  gaussian = _direct_epsilon(plan.noise_multiplier, plan.sampling_rate,
                             3 * plan.steps_per_period, 1e-5, "rdp")
  assert gaussian == pytest.approx(1.7, rel=5e-3) and gaussian <= 1.7 + 1e-9
  assert plan.planned_epsilon() == pytest.approx(gaussian + 0.3, rel=1e-6)


def test_non_private_plan_and_bad_input():
  plan = plan_stream(math.inf, 1e-5, expected_periods=2, examples_per_period=100, batch_size=10)
  assert plan.noise_multiplier == 0 and not plan.private and plan.planned_epsilon() == math.inf
  with pytest.raises(DprecError, match="positive"):
    plan_stream(0.0, 1e-5, 2, 100, 10)
  with pytest.raises(DprecError):
    plan_stream(1.0, 1e-5, 2, 100, 10, selection_epsilon=1.5)


def _write_marker(prefix):
  with open(prefix + ".data", "w", encoding="utf-8") as f:
    f.write(os.path.basename(os.path.dirname(prefix)))


def test_checkpoints_commit_atomically_and_keep_the_newest(tmp_path):
  manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=2)
  assert manager.latest() is None
  ledger = tmp_path / "ledger.json"
  for step in range(3):
    ledger.write_text(json.dumps({"spent": step}))
    manager.commit({"step": step}, _write_marker, {"ledger.json": str(ledger)})
  latest = manager.latest()
  assert manager.read_state(latest) == {"step": 2}
  assert json.loads(open(os.path.join(latest, "ledger.json")).read()) == {"spent": 2}
  assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-")) == [
      "ckpt-000001", "ckpt-000002"]
  assert (tmp_path / ckpt_lib.LATEST).read_text() == "ckpt-000002"


def test_a_crash_mid_commit_leaves_the_previous_checkpoint(tmp_path):
  manager = ckpt_lib.CheckpointManager(str(tmp_path))
  manager.commit({"step": 1}, _write_marker)

  def crash(prefix):
    _write_marker(prefix)
    raise KeyboardInterrupt("killed while writing the model")

  with pytest.raises(KeyboardInterrupt):
    manager.commit({"step": 2}, crash)
  # a directory renamed into place without its state (impossible via commit) is ignored too
  os.makedirs(tmp_path / "ckpt-000007")
  restarted = ckpt_lib.CheckpointManager(str(tmp_path))
  assert restarted.read_state(restarted.latest()) == {"step": 1}
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # debris removed


def test_atomic_write_replaces_whole_files(tmp_path):
  path = tmp_path / "f.txt"
  atomic_io.write_text(str(path), "old")
  atomic_io.write_text(str(path), "new content")
  assert path.read_text() == "new content"
  assert os.listdir(tmp_path) == ["f.txt"]


def test_what_the_ledger_spent_before_is_composed_into_the_plan():
  spent = privacy.Spent(selections=((0.3, 0.0),))  # e.g. a DP top-k vocabulary
  plan = plan_stream(2.0, 1e-5, expected_periods=3, examples_per_period=200, batch_size=20,
                     accountant="rdp", spent=spent, privacy_unit="user")
  gaussian = _direct_epsilon(plan.noise_multiplier, plan.sampling_rate,
                             3 * plan.steps_per_period, 1e-5, "rdp")
  assert gaussian == pytest.approx(1.7, rel=5e-3) and gaussian <= 1.7 + 1e-9
  assert plan.planned_epsilon() == pytest.approx(gaussian + 0.3, rel=1e-6)
  assert plan.planned_epsilon(0) == pytest.approx(0.3) and plan.spent == spent
