"""What a streaming run reports: its JSON summary (what ε covers by privacy unit, the per-period
rows, the plan, the hold-out) and the one line a trained period prints."""
import math

UNITS = {
    "row": "adding or removing one training example (row) of the whole stream: each row lives "
           "in one period, so the periods compose in parallel (the costliest period's ε), "
           "composed sequentially with what reads several periods (DP top-k refreshes of the "
           "running counts, preprocessing charges), in one ledger",
    "user": "adding or removing one user (all their rows) of the whole stream: every step "
            "Poisson-samples users, a sampled user's at most max_rows_per_user rows clipped as "
            "one; each period's DP base rate and DP Platt scaling read at most max_rows_per_user "
            "rows of a user; every period and preprocessing charge composed sequentially in one "
            "user-level ledger",
}
EPSILON_COVERS = {
    "epsilon": "(epsilon, delta)-DP for " + UNITS["row"],
    "covered": ["the model", "steps", "gradient_size_reduction", "epsilon_so_far", "stopped",
                "trained_now (whether this invocation trained a step)",
                "calibration_scale and calibration_shift (DP Platt scaling of each period)",
                "base_rate (DP, first period)",
                "holdout (final model on the hold-out days, not training data of this run)"],
    "public": ["plan", "settings", "days", "vocab_size and new_ids (vocabularies treated as "
               "public)", "timings"],
    "held_out_evaluation": "each period's auc, log_loss (= eval_loss), base_rate_log_loss (the "
                           "constant at the first period's DP click rate) and eval_base_rate "
                           "(period p's click rate) evaluate the model trained before it on "
                           "period p, which IS training data of this run (trained on next): not "
                           "covered by ε; so are eval_log_loss, eval_base_rate, "
                           "base_rate_log_loss (the constant at that click rate) and "
                           "worse_than_base_rate at the top, those of the last period evaluated; "
                           "holdout evaluates days never trained on",
    "not_covered": "diagnostics_nonprivate (only with --diagnostics): exact period sizes, "
                   "Poisson batch sizes and training losses",
}


def summary(state, plan, run, charges, resumed=False):
  """The JSON summary of a streaming run in trainer state `state` under `plan`, in `run`, paid
  through `charges` (`dprec.training.period_charges.PeriodCharges`)."""
  rows = state["rows"]
  unit = plan.privacy_unit or "row"
  covers = dict(EPSILON_COVERS, epsilon="(epsilon, delta)-DP for " + UNITS[unit])
  return {
      **run.summary.privacy_fields(plan.private, covers),
      "privacy_unit": unit,
      "max_rows_per_user": plan.max_rows_per_user,
      "ledger_unit": charges.ledger.unit if charges.ledger is not None else None,
      "epsilon_composition": charges.composition(),
      "periods": rows,
      "periods_trained": len(rows),
      "epsilon": charges.epsilon_spent(),
      "epsilon_total": plan.epsilon_total if plan.private else None,
      "delta": plan.delta,
      "plan": {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
               for k, v in plan.to_dict().items()},
      "holdout": state.get("holdout"),
      "stopped": state["stopped"],
      "resumed": resumed,
      "run_dir": run.run_dir,
  }


def period_line(rows):
  """One line on the period just trained (and the AUC of the model before it, on it)."""
  row = rows[-1]
  line = (f"period {row['period']} (days {', '.join(map(str, row['days']))}): trained "
          f"{row['steps']} steps")
  if row["epsilon_so_far"] is not None:
    line += f", epsilon so far {row['epsilon_so_far']:.4g}"
  if len(rows) > 1 and rows[-2]["auc"] is not None:
    line += f"; the model before it had AUC {rows[-2]['auc']:.4f} on it"
  return line
