"""A run's budget: its privacy ledger and the charges it pays into it.

The ledger is the budget of the run's data set (identified by `dprec.data.identity`): every
charge of the run records it, a ledger holding charges for another data set is refused, and what
the ledger spent on this data set before the run's first charge (e.g. a preprocessing job's DP
top-k vocabulary) is composed into the run's plan (`plan_prior`) and reported in the summary's
`epsilon_parts`.

The ledger is paid before anything is released: `check` refuses, before the first charge, a run
whose unpaid part would exceed the budget; `pay_once` charges the one-off releases (Gaussian
mechanisms, DP top-k) and `callback` / `pay_steps` the steps, each under the run's label. A run
only ever counts its own charges as paid (`steps_paid`, `paid`), so a resumed run pays nothing
twice and never counts another run's charges. Only the chief of a multi-worker run charges."""
import math
import os
from typing import Optional

from dprec.errors import BudgetExceededError
from dprec.workflows import run_directory

LEDGER_FILE = "ledger.json"
BUDGET_SLACK = 1 + 1e-6  # calibration's rounding: a plan within this of the budget fits it


class RunBudget:
  """The ledger at `path` (None: LEDGER_FILE in the run's `directory`, a temporary one without a
  run directory) charged by run `run_id` with `key`, trained on `dataset` (None: in-memory data,
  which no charge can be matched to). `ledger` is None until `open_ledger` (a private run)."""

  def __init__(self, directory: run_directory.RunDirectory, path: Optional[str], run_id: str,
               key, dataset: Optional[dict]):
    self.path = path or os.path.join(directory.base, LEDGER_FILE)
    self.temporary = path is None and directory.path is None
    self.shared = directory.path is not None  # a worker waits for the chief's ledger
    self.chief, self.run_id, self.key, self.dataset = directory.chief, run_id, key, dataset
    self.ledger = None

  def open_ledger(self, epsilon_budget, delta, accountant, default_delta=None, unit=None):
    """The ledger at `path` (also kept as `ledger`); every charge this run makes records its
    `run_id` and data set (and, with insecure noise, `private: false` and the reason). `delta`
    None: the existing ledger's δ, or `default_delta` for a new one. `unit`: the privacy unit of
    its budget (None: the existing ledger's, else "row"; another than an existing ledger's is
    refused). Refuses a ledger holding charges for another data set."""
    from dprec.privacy import PrivacyLedger
    if not self.chief and self.shared:  # a shared ledger: the chief creates it
      run_directory.wait_for(self.path, "the chief's privacy ledger")
    if delta is None and not os.path.exists(self.path):
      delta = default_delta
    marks = {} if self.key.private else {"private": False, "privacy_note": self.key.note}
    if self.dataset is not None:
      marks["dataset"] = self.dataset
    self.ledger = PrivacyLedger(self.path, epsilon_budget=epsilon_budget, delta=delta,
                                accountant=accountant, run_id=self.run_id, marks=marks,
                                unit=unit)
    self.ledger.check_dataset(self.dataset)
    return self.ledger

  @property
  def ledger_file(self) -> Optional[str]:
    """The path of the ledger this run opened (None: none, or a temporary one, removed at the
    end of the run)."""
    return None if self.ledger is None or self.temporary else self.path

  def open_plan_ledger(self, plan):
    """The ledger of a `dprec.workflows.plan.PrivacyPlan`'s budget (the one `plan_prior`
    opened, if it did); None for a non-private plan."""
    if not plan.private:
      return None
    return self.ledger or self.open_ledger(plan.epsilon_total, plan.delta, plan.accountant,
                                           unit=plan.privacy_unit)

  def steps_paid(self, label) -> int:
    """Steps this run has charged under `label` (charges of other runs never count)."""
    return sum(charge.get("steps", 0) for charge in self.ledger.charges_of(self.run_id, label))

  def paid(self, label) -> bool:
    """Whether this run has charged `label` already."""
    return bool(self.ledger.charges_of(self.run_id, label))

  def epsilon_if_paid(self, plan, label, steps, selections=None, noise_multiplier=None,
                      sampling_rate=None, mechanisms=None, days=None) -> float:
    """ε the ledger would reach once this run has paid for `steps` steps under `label` (at the
    plan's σ and q unless given), the Gaussian `mechanisms` {label: σ} (default: the plan's)
    and the pure-ε `selections` {label: ε}; what it has paid already counts once. The steps and
    mechanisms read the data set's `days` (None: every day; `PrivacyLedger`), the selections
    every day, in the ledger's unit (a user-level stream's σ and q are per user). Nothing is
    charged."""
    mechanisms = plan.mechanisms if mechanisms is None else mechanisms
    gaussian = [(sigma, label) for label, sigma in mechanisms.items() if not self.paid(label)]
    pure = [epsilon for label, epsilon in (selections or {}).items()
            if epsilon and not self.paid(label)]
    unpaid = max(0, steps - self.steps_paid(label))
    epsilon = self.ledger.epsilon_if_charged(
        plan.noise_multiplier if noise_multiplier is None else noise_multiplier,
        plan.sampling_rate if sampling_rate is None else sampling_rate,
        unpaid, poisson=plan.poisson, label=label, gaussian_mechanisms=gaussian, days=days,
        approximate=[(0.0, delta, label) for label, delta in self._unpaid_truncation(plan)],
        **plan.charge_fields)
    return epsilon + sum(pure)  # basic composition, as the ledger does

  def _unpaid_truncation(self, plan):
    """[(label, δ)] of the plan's batch cap (`dprec.privacy.truncation`) if unpaid."""
    from dprec.privacy import truncation
    if not plan.truncation_delta or self.paid(truncation.LABEL):
      return []
    return [(truncation.LABEL, plan.truncation_delta)]

  def fits(self, epsilon) -> bool:
    return epsilon <= self.ledger.epsilon_budget * BUDGET_SLACK

  def check(self, plan, label, steps, selections=None, **rates):
    """Raises `BudgetExceededError`, before anything is charged, if paying this run's unpaid
    part (`epsilon_if_paid`) would bring the ledger over its budget."""
    planned = self.epsilon_if_paid(plan, label, steps, selections, **rates)
    if not self.fits(planned):
      raise BudgetExceededError(
          f"{self.ledger.path}: the planned run would bring the ledger to ε={planned:.4g} > "
          f"budget {self.ledger.epsilon_budget:g} (already spent "
          f"{self.ledger.epsilon_spent():.4g})")

  def pay_once(self, plan, selections=None, mechanisms=None, days=None):
    """Charges the Gaussian `mechanisms` {label: σ} (default: the plan's) on `days`, then the
    `selections` {label: (ε, δ)}, that this run has not paid yet (a resumed run re-draws them
    from the key and pays nothing again). The plan's batch cap is paid here too, as the
    (0, δ_trunc) release of `dprec.privacy.truncation`."""
    if not self.chief:
      return
    for label, delta in self._unpaid_truncation(plan):
      self.ledger.charge_approximate(0.0, delta, label)
    for label, sigma in (plan.mechanisms if mechanisms is None else mechanisms).items():
      if not self.paid(label):
        self.ledger.charge_gaussian_mechanism(sigma, label, days, **plan.charge_fields)
    for label, (epsilon, delta) in (selections or {}).items():
      if epsilon and not self.paid(label):
        self.ledger.charge_approximate(epsilon, delta, label)

  def pay_steps(self, plan, label, steps, days=None):
    """Charges the steps of `steps` under `label` (reading `days`) this run has not paid yet."""
    if not self.chief:
      return
    unpaid = steps - self.steps_paid(label)
    if unpaid > 0:
      self.ledger.charge_gaussian(plan.noise_multiplier, plan.sampling_rate, unpaid,
                                  poisson=plan.poisson, label=label, days=days,
                                  **plan.charge_fields)

  def callback(self, plan, label, start_step=0, charge_every=100, log_dir=None,
               steps_held=None):
    """`PrivacyBudgetCallback` paying the plan's steps under `label` ahead of `model.fit`; a
    resumed run (at `start_step`) pays again only for steps it has not paid; `steps_held`: the
    steps its input holds (none paid beyond them). None on a worker that is not the chief: each
    global step is paid once, by the chief."""
    if not self.chief:
      return None
    from dprec.training import callbacks
    return callbacks.PrivacyBudgetCallback(
        self.ledger, plan.noise_multiplier, plan.sampling_rate, poisson=plan.poisson,
        charge_every=charge_every, label=label, log_dir=log_dir, steps_taken=start_step,
        steps_charged=self.steps_paid(label), steps_held=steps_held,
        charge_fields=plan.charge_fields)


def plan_prior(budget, epsilon_budget, delta, accountant, default_delta, unit=None):
  """(δ, `Spent`) a privacy plan starts from. With a run's `budget` and a finite `epsilon_budget`:
  its ledger, opened now (`RunBudget.open_ledger`: δ `delta`, else the existing ledger's, else
  `default_delta`; privacy `unit`, None: the existing ledger's, else "row"), and what it spent
  on the run's data set before the run's first charge (`PrivacyLedger.spent_before`: e.g. a DP
  top-k vocabulary; a resumed run finds what it found when it started). Otherwise (`budget`
  None: planning alone): (`delta` or `default_delta`, nothing spent)."""
  from dprec.privacy import composition
  if budget is None or epsilon_budget is None or not math.isfinite(epsilon_budget):
    return (default_delta if delta is None else delta), composition.Spent()
  ledger = budget.open_ledger(epsilon_budget, delta, accountant, default_delta, unit)
  return ledger.delta, ledger.spent_before(budget.run_id)
