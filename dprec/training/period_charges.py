"""What a streaming run's periods cost and release: each period's steps (from public day counts),
its Gaussian mechanisms, the ledger charges paid before it trains, and the secret generators of
its releases.

Row-level plans charge a period's steps and mechanisms as reading the period's days, so the
periods compose in parallel (each row lives in one period); the DP top-k refreshes of the running
counts read every period so far and compose sequentially (Ghazi et al., "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", arXiv:2311.08357, §4.3). A
user-level plan composes everything sequentially.
"""
import math

from dprec.errors import BudgetExceededError, DprecError
from dprec.training.period_source import Period


class PeriodCharges:
  """The ledger side of a streaming run: `plan` (`dprec.workflows.plan.PrivacyPlan`) paid in
  `run`'s ledger (`dprec.workflows.run.Run`) for the periods of `source`."""

  def __init__(self, plan, run, source):
    if plan.privacy_unit == "user" and plan.private and plan.selection_epsilon_per_period:
      raise DprecError("--privacy-unit user cannot refresh a DP top-k set: the running counts "
                       "behind it count every row of a user; use public counts (selection "
                       "epsilon 0) or an algorithm without a fixed set")
    self.plan, self.run, self.source = plan, run, source
    self.ledger = run.budget.open_plan_ledger(plan)

  @staticmethod
  def label(index):
    """The ledger label of period `index`'s charges."""
    return f"stream period {index}"

  def epsilon_spent(self):
    """ε charged so far (None for a non-private run)."""
    return self.ledger.epsilon_spent() if self.ledger is not None else None

  def period_steps(self, period: Period):
    """The plan's T for a period of the planned number of days; proportionally fewer steps
    (same epochs, less ε) for one of fewer days (the last of a cut). From public day counts,
    never from the exact number of rows, which is private."""
    plan = self.plan
    planned_days = getattr(self.source, "period_days", len(period.days))
    scaled = math.ceil(plan.steps_per_period * len(period.days) / planned_days)
    return max(1, min(plan.steps_per_period, scaled))

  def mechanisms(self, index):
    """{ledger label: σ} of the Gaussian mechanisms period `index` releases: the plan's
    once-only ones with the first period, its per-period ones (DP Platt scaling) with each."""
    label = self.label(index)
    mechanisms = {f"{label} {name}": sigma for name, sigma in self.plan.period_mechanisms.items()}
    if index == 0:
      mechanisms.update({f"stream {name}": sigma for name, sigma in self.plan.mechanisms.items()})
    return mechanisms

  def pay(self, period: Period, steps):
    """Charges the ledger for period p's selection, mechanisms and `steps` steps, unless
    already charged. Row-level plans charge the steps and mechanisms as reading the period's
    days (parallel composition across periods), the selection (running counts) as reading all.

    Returns None once paid, or, charging nothing, the ε the period would have brought the run to.
    """
    if self.ledger is None:
      return None
    run, label = self.run, self.label(period.index)
    days = list(period.days) if self.plan.parallel_periods else None
    selection = {label + " selection": self.plan.selection_epsilon_per_period}
    mechanisms = self.mechanisms(period.index)
    projected = run.budget.epsilon_if_paid(self.plan, label, steps, selection,
                                           mechanisms=mechanisms, days=days)
    if not run.budget.fits(projected):
      return projected
    try:
      run.budget.pay_once(self.plan, {name: (epsilon, 0.0) for name, epsilon in selection.items()},
                          mechanisms=mechanisms, days=days)
      run.budget.pay_steps(self.plan, label, steps, days=days)
    except BudgetExceededError:
      return projected
    return None

  def releases(self, mechanisms, purpose, period):
    """{name: (σ, secret rng)} of the plan's `mechanisms` ({} when not private)."""
    if not self.plan.private:
      return {}
    return {name: (self.plan.release_noise_multiplier(sigma),
                   self.run.key.numpy_rng(f"{purpose} {name}", period))
            for name, sigma in mechanisms.items()}

  def composition(self):
    """How the ledger composed the run's ε (public accounting), for the summary."""
    if self.ledger is None:
      return None
    result = self.ledger.composition()
    return {"periods": "parallel" if self.plan.parallel_periods else "sequential",
            "training_epsilon": result.training_epsilon,
            "sequential_selection_epsilon": result.selection_epsilon,
            "by_days": result.partitions}
