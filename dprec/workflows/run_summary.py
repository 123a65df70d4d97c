"""A run's summary: its privacy fields (`RunSummary`), where the JSON summary goes
(`summary_path`, `write_summary`) and the line a command ends with (`report`)."""
import os
import sys
from typing import Optional

from dprec import atomic_io
from dprec.data import identity

SUMMARY_FILE = "summary.json"  # in the run directory, unless --summary-json says otherwise
STDOUT = "-"  # --summary-json -: the JSON summary on stdout


class RunSummary:
  """The privacy fields of the summary of run `run_id` with `key`, whose `budget`
  (`dprec.workflows.run_budget.RunBudget`) charges the data set `dataset` (its identity; None:
  in-memory data) in `data`."""

  def __init__(self, run_id, key, secure_noise, budget, data=None, dataset=None):
    self.run_id, self.key, self.secure_noise = run_id, key, secure_noise
    self.budget, self.data, self.dataset = budget, data, dataset

  def privacy_fields(self, dp: bool, epsilon_covers: dict, notes=()) -> dict:
    """The summary's privacy fields: `ledger` (the path of the ledger charged; None: none, or a
    temporary one), `private` (a DP algorithm with secret randomness),
    `privacy_note` (why not, and other caveats), `epsilon_covers` (which outputs ε covers),
    `secure_noise` (the DP step's noise sampled exactly); with the run's ledger, `epsilon_parts`
    (preprocessing selection and training, adding up to its ε) and, with its data directory,
    `dataset` (which data set, and whether its vocabulary is DP): both public."""
    reasons = ([] if dp else ["non-private training: no differential privacy"])
    reasons += [] if self.key.private else [self.key.note]
    public = list(epsilon_covers.get("public", [])) + [
        "epsilon_parts (accounting), ledger (its path) and dataset (the data set's path, id "
        "and vocab_privacy)"]
    fields = {"run_id": self.run_id, "epsilon_covers": dict(epsilon_covers, public=public),
              "secure_noise": self.secure_noise, "ledger": self.budget.ledger_file}
    public_seeded = []
    if self.budget.ledger is not None:
      fields["epsilon_parts"] = self.budget.ledger.parts()
      preprocessing = fields["epsilon_parts"]["preprocessing_selection"]["charges"]
      public_seeded = [f"preprocessing release '{c['label']}' drew its randomness from a public "
                       "seed: it is NOT differentially private"
                       for c in preprocessing if not c["private"]]
    if self.dataset is not None:
      fields["dataset"] = dict(self.dataset, vocab_privacy=identity.manifest_field(
          self.data, "vocab_privacy"))
    return dict(fields, private=dp and self.key.private and not public_seeded,
                privacy_note="; ".join(reasons + public_seeded + list(notes)) or None)

  def privacy(self, plan, epsilon_covers, dp=None, notes=()) -> dict:
    """ε spent (None without a ledger), δ, the accountant, Poisson or not, and
    `privacy_fields` (with the plan's notes)."""
    ledger = self.budget.ledger
    return {"epsilon": ledger.epsilon_spent() if ledger is not None else None,
            "delta": plan.delta, "accountant": plan.accountant if ledger is not None else None,
            "poisson": bool(ledger is not None and plan.poisson),
            **self.privacy_fields(plan.private if dp is None else dp, epsilon_covers,
                                  plan.notes + list(notes))}


def summary_path(options) -> Optional[str]:
  """Where the JSON summary of a run of `options` (a `dprec.workflows.run.RunOptions`) goes:
  `--summary-json` (`STDOUT`: printed by `report`), else RUN_DIR/summary.json with a run
  directory, else nowhere."""
  if options.summary_json:
    return options.summary_json
  return os.path.join(options.run_dir, SUMMARY_FILE) if options.run_dir else None


def write_summary(summary, path):
  """Writes the JSON summary (strict JSON: `atomic_io.strict`) to `path` atomically (None or
  `STDOUT`: no file)."""
  if path and path != STDOUT:
    atomic_io.write_json(path, summary, sort_keys=True)


def report(summary: dict, options, result: str) -> int:
  """Ends a command: its one-line `result` (the metric with its baseline, ε with its unit and δ:
  `dprec.workflows.result`) on stdout, followed by where the JSON summary is; with
  `--summary-json -` the JSON on stdout and the line on stderr. Returns 0 (the exit status)."""
  path = summary_path(options)
  if path == STDOUT:
    print(atomic_io.dumps(summary, indent=2, sort_keys=True))
    print(result, file=sys.stderr)
  else:
    print(f"{result}; summary: {path}" if path else
          f"{result} (JSON summary: --summary-json PATH, or - for stdout)")
  return 0
