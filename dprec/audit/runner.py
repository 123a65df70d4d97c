"""The audit loop shared by every model: R runs of m canaries, guesses pooled into one bound."""
import dataclasses
import json
from typing import Callable, List

import numpy as np

from dprec.audit import bounds

METHOD = "one-run audit (Steinke, Nasr & Jagielski 2023), guesses of all runs pooled"
NOTE = ("a lower bound on the ε of this configuration, valid with the stated confidence; the "
        "scores file holds which canaries were inserted: keep it private")


@dataclasses.dataclass
class AuditResult:
  epsilon_lower_bound: float
  guesses: int
  correct_guesses: int
  records: List[dict]  # per canary: run, canary, included, score (private: who was inserted)
  plan: object  # the last run's privacy plan


def run_audit(train_and_score: Callable, canaries: int, runs: int, per_side: int,
              confidence: float, rng: np.random.Generator) -> AuditResult:
  """`train_and_score(rng)` trains once with fresh canaries and returns (scores [m],
  included [m], plan with a `delta`); the bound pools the guesses of all `runs`."""
  guesses = right = 0
  records, plan = [], None
  for run in range(runs):
    scores, included, plan = train_and_score(rng)
    r, v = bounds.guess_membership(scores, included, per_side, per_side, rng)
    guesses, right = guesses + r, right + v
    records += [{"run": run, "canary": i, "included": bool(inc), "score": float(s)}
                for i, (inc, s) in enumerate(zip(included, scores))]
  bound = bounds.epsilon_lower_bound(canaries * runs, guesses, right, plan.delta or 0.0,
                                     confidence)
  return AuditResult(bound, guesses, right, records, plan)


def write_outputs(summary, records, scores_file=None, summary_json=None):
  """The scores file (JSON lines, one per canary) and the JSON summary, where asked for."""
  if scores_file:
    with open(scores_file, "w", encoding="utf-8") as out:
      out.writelines(json.dumps(record) + "\n" for record in records)
  if summary_json:
    with open(summary_json, "w", encoding="utf-8") as out:
      json.dump(summary, out, indent=2, sort_keys=True)
