"""The audit loop shared by every model: R runs of m canaries, their scores pooled into one bound.

Canaries of independent runs are independent: the R·m canaries are guessed on together, as one
run's would be (each run's output depends on its own canaries only).
"""
import dataclasses
import json
from typing import Callable, Dict, List

import numpy as np

from dprec.audit import bounds

METHOD = ("one-run audit, f-DP analysis against Gaussian DP (Mahloujifar, Melis & Chaudhuri "
          "2024); second line: Steinke, Nasr & Jagielski 2023. 'in' guesses on the k highest "
          "scores for k = m/2, m/4, ..., every score and k tested at (1 − confidence)/H "
          "(Bonferroni over the H tries)")
NOTE = ("a lower bound on the ε of this configuration, valid with the stated confidence (the "
        "f-DP line assumes the mechanism's tradeoff curve is Gaussian-like, as it is after many "
        "noisy steps; the Steinke line assumes nothing); 'ceiling' is the largest bound these "
        "guesses could give (every guess right); the scores file holds which canaries were "
        "inserted: keep it private")


@dataclasses.dataclass
class AuditResult:
  bounds: Dict[str, bounds.Bound]  # "gdp" and "steinke"
  records: List[dict]  # per canary: run, canary, included, scores (private: who was inserted)
  plan: object  # the last run's privacy plan

  @property
  def epsilon_lower_bound(self):
    return self.bounds["gdp"].epsilon

  def summary_fields(self) -> dict:
    """The bound fields every audit summary carries."""
    gdp, steinke = self.bounds["gdp"], self.bounds["steinke"]
    return {"epsilon_lower_bound": gdp.epsilon, "ceiling": gdp.ceiling,
            "epsilon_lower_bound_steinke": steinke.epsilon, "ceiling_steinke": steinke.ceiling,
            "best_score": gdp.score, "guesses": gdp.guesses, "correct_guesses": gdp.correct,
            "guess_counts": bounds.guess_counts(len(self.records)), "method": METHOD}


def run_audit(train_and_score: Callable, runs: int, delta: float, confidence: float,
              rng: np.random.Generator) -> AuditResult:
  """`train_and_score(rng)` trains once with fresh canaries and returns ({score name: [m]},
  included [m], plan); the bound pools the canaries of all `runs`."""
  pooled, included, records, plan = {}, [], [], None
  for run in range(runs):
    scores, run_included, plan = train_and_score(rng)
    for name, values in scores.items():
      pooled.setdefault(name, []).append(np.asarray(values, np.float64))
    included.append(np.asarray(run_included, bool))
    records += [{"run": run, "canary": i, "included": bool(inc),
                 **{name: float(values[i]) for name, values in scores.items()}}
                for i, inc in enumerate(run_included)]
  scores = {name: np.concatenate(values) for name, values in pooled.items()}
  result = bounds.best_bounds(scores, np.concatenate(included), delta, confidence, rng)
  return AuditResult(result, records, plan)


def write_outputs(summary, records, scores_file=None, summary_json=None):
  """The scores file (JSON lines, one per canary) and the JSON summary, where asked for."""
  if scores_file:
    with open(scores_file, "w", encoding="utf-8") as out:
      out.writelines(json.dumps(record) + "\n" for record in records)
  if summary_json:
    with open(summary_json, "w", encoding="utf-8") as out:
      json.dump(summary, out, indent=2, sort_keys=True)
