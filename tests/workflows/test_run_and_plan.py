"""The shared run machinery: one planner for single runs and streams, and a run's ledger payments
(budget checked before any charge, one-off releases paid once, steps never paid twice, another
run's charges never counted as paid)."""
import pytest

from dprec import privacy
from dprec.errors import BudgetExceededError
from dprec.errors import DprecError
from dprec.workflows.plan import plan_privacy, plan_stream
from dprec.workflows.run import Run

DELTA = 1e-5


def test_one_planner_for_a_single_run_and_for_periods():
  """A user-level stream of P periods of T steps is planned like one run of P·T steps; a
  row-level stream's periods compose in parallel, so it is planned like one run of T steps
  (every selection still deducted); all spend the budget."""
  stream = plan_stream(2.0, DELTA, expected_periods=3, examples_per_period=400, batch_size=40,
                       selection_epsilon=0.3, accountant="rdp", privacy_unit="user")
  single = plan_privacy(2.0, DELTA, 400, 40, 3 * stream.steps_per_period, selection_epsilon=0.3,
                        accountant="rdp")
  assert stream.noise_multiplier == pytest.approx(single.noise_multiplier, rel=1e-9)
  direct = privacy.calibrate_noise_multiplier(2.0 - 0.3, DELTA, 0.1, 3 * stream.steps_per_period,
                                              accountant="rdp")
  assert stream.noise_multiplier == pytest.approx(direct, rel=2e-3)
  assert stream.selection_epsilon == pytest.approx(0.3) == single.selection_epsilon
  assert stream.planned_epsilon() == pytest.approx(2.0, rel=2e-3)
  assert stream.planned_epsilon() <= 2.0 * (1 + 1e-6)

  rows = plan_stream(2.0, DELTA, expected_periods=3, examples_per_period=400, batch_size=40,
                     selection_epsilon=0.3, accountant="rdp", privacy_unit="row")
  one_period = plan_privacy(2.0, DELTA, 400, 40, rows.steps_per_period, selection_epsilon=0.3,
                            accountant="rdp")
  assert rows.noise_multiplier == pytest.approx(one_period.noise_multiplier, rel=1e-9)
  assert rows.noise_multiplier < stream.noise_multiplier
  assert rows.planned_epsilon() == pytest.approx(2.0, rel=2e-3)


def test_a_mechanism_released_once_is_composed_with_training():
  plan = plan_privacy(1.0, DELTA, 1000, 50, 40, mechanisms=[("histogram", 0.05)],
                      accountant="rdp")
  sigma = plan.mechanisms["histogram"]
  alone = privacy.gaussian_epsilon([privacy.gaussian_mechanism_period(sigma)], DELTA,
                                   accountant="rdp")
  both = privacy.gaussian_epsilon(
      [privacy.gaussian_mechanism_period(sigma),
       privacy.TrainingPeriod(plan.noise_multiplier, plan.sampling_rate, plan.steps)], DELTA,
      accountant="rdp")
  assert alone == pytest.approx(0.05, rel=2e-3) and both == pytest.approx(1.0, rel=2e-3)


def test_a_run_pays_what_it_has_not_paid_and_checks_the_budget_first(tmp_path):
  plan = plan_privacy(1.0, DELTA, 1000, 50, 40, mechanisms=[("histogram", 0.05)],
                      accountant="rdp")
  ledger_path = str(tmp_path / "ledger.json")
  with Run("train seqrec", str(tmp_path / "a"), ledger_path) as run:
    run.budget.open_plan_ledger(plan)
    run.budget.check(plan, "steps", plan.steps)  # fits: the plan is calibrated to it
    with pytest.raises(BudgetExceededError, match="already spent 0"):
      run.budget.check(plan, "steps", 2 * plan.steps)
    assert run.budget.ledger.charges == []  # refused before anything was charged
    run.budget.pay_once(plan, {"top-k": (0.0, 0.0)})  # a public selection costs nothing
    run.budget.pay_steps(plan, "steps", 10)
    run.budget.pay_once(plan)
    run.budget.pay_steps(plan, "steps", 10)  # paid: nothing more
    assert [(c["label"], c.get("steps")) for c in run.budget.ledger.charges] == [
        ("histogram", 1), ("steps", 10)]
    run.budget.pay_steps(plan, "steps", plan.steps)
    assert run.budget.steps_paid("steps") == plan.steps
    assert run.budget.ledger.epsilon_spent() == pytest.approx(1.0, rel=2e-3)
  with Run("train seqrec", str(tmp_path / "b"), ledger_path) as other:
    other.budget.open_plan_ledger(plan)
    assert other.budget.steps_paid("steps") == 0 and not other.budget.paid("histogram")
    with pytest.raises(BudgetExceededError, match="already spent"):
      other.budget.check(plan, "steps", plan.steps)


def test_a_run_directory_serves_one_process_at_a_time(tmp_path):
  run_dir = str(tmp_path / "run")
  with Run("stream", run_dir) as run:
    with pytest.raises(DprecError, match="another dprec process is using this run directory"):
      Run("stream", run_dir)
    run_id = run.run_id
  with Run("stream", run_dir) as resumed:  # free again once the first has closed
    assert resumed.run_id == run_id
