"""The audit loop shared by every model: R runs of m canaries, their scores pooled into one bound.

Canaries of independent runs are independent: the R·m canaries are guessed on together, as one
run's would be (each run's output depends on its own canaries only).
"""
import dataclasses
from typing import Callable, Dict, List, Optional

import numpy as np

from dprec import atomic_io
from dprec.audit import bounds

METHODS = {
    "gdp": "one-run audit, f-DP analysis against Gaussian DP (Mahloujifar, Melis & Chaudhuri "
           "2024, arXiv:2410.22235): 'in' guesses on the k highest scores for k = m/2, m/4, ...",
    "steinke": "one-run audit (Steinke, Nasr & Jagielski 2023, arXiv:2305.08846), the same "
               "guesses; its δ term 2·m·δ grows with the canaries, which caps it when m·δ is "
               "not small",
    "gdp_fit": "GDP fit of the in/out scores at every threshold, Clopper-Pearson limits on "
               "both error rates (Nasr et al. 2023, arXiv:2302.07956); needs canaries that are "
               "independent trials (white-box)",
    "family_fit": "fit of the in/out scores within the claimed mechanism's family (T "
                  "Poisson-subsampled Gaussian steps at another noise multiplier), Clopper-"
                  "Pearson limits on both error rates; needs canaries that are independent "
                  "trials (white-box)",
    "clopper_pearson": "counting bound log((TPR - δ)/FPR) at every threshold, Clopper-Pearson "
                       "limits (Jagielski, Ullman & Oprea 2020, arXiv:2006.07709); needs "
                       "canaries that are independent trials (white-box)",
}
# The headline estimator, chosen before any score is seen: the first of these computed.
HEADLINES = {"black_box": ("gdp",), "white_box": ("family_fit", "gdp_fit")}
NOTE = ("a lower bound on the ε of this configuration, valid with the stated confidence for "
        "each estimator on its own (the headline is fixed by the threat model beforehand, not "
        "the best of them; the f-DP and GDP-fit lines assume the mechanism's tradeoff curve is "
        "Gaussian-like, as it is after many noisy steps; the Steinke and counting lines assume "
        "nothing); 'ceiling' is the largest bound these guesses could give (every guess right); "
        "the scores file holds which canaries were inserted: keep it private")


@dataclasses.dataclass
class AuditResult:
  bounds: Dict[str, bounds.Bound]  # every estimator's (`bounds.best_bounds`)
  records: List[dict]  # per canary: run, canary, included, scores (private: who was inserted)
  plan: object  # the last run's privacy plan
  headline: str = "gdp"  # the estimator the summary leads with

  @property
  def epsilon_lower_bound(self):
    return self.bounds[self.headline].epsilon

  def summary_fields(self) -> dict:
    """The bound fields every audit summary carries: the headline estimator's bound and
    ceiling, every estimator's, and the one-run guesses."""
    gdp, steinke, headline = self.bounds["gdp"], self.bounds["steinke"], self.bounds[self.headline]
    return {"epsilon_lower_bound": headline.epsilon, "ceiling": headline.ceiling,
            "headline": self.headline,
            "estimators": {name: {"epsilon_lower_bound": bound.epsilon, "ceiling": bound.ceiling,
                                  "best_score": bound.score, "method": METHODS[name]}
                           for name, bound in self.bounds.items()},
            "epsilon_lower_bound_steinke": steinke.epsilon, "ceiling_steinke": steinke.ceiling,
            "best_score": headline.score, "guesses": gdp.guesses, "correct_guesses": gdp.correct,
            "guess_counts": bounds.guess_counts(len(self.records)),
            "method": METHODS[self.headline]}


def run_audit(train_and_score: Callable, runs: int, delta: float, confidence: float,
              rng: np.random.Generator, threat_model: str = "black_box",
              claim: Optional[bounds.SubsampledGaussian] = None,
              report: Callable = lambda what: None) -> AuditResult:
  """`train_and_score(rng)` trains once with fresh canaries and returns ({score name: [m]},
  included [m], plan); the bounds pool the canaries of all `runs`; the summary leads with the
  `threat_model`'s headline estimator; `claim`: the accounted mechanism, for the family fit;
  `report(what)` is told each phase (`dprec.progress.phase_lines`)."""
  pooled, included, records, plan = {}, [], [], None
  for run in range(runs):
    report(f"run {run + 1} of {runs}: training with canaries and scoring them")
    scores, run_included, plan = train_and_score(rng)
    for name, values in scores.items():
      pooled.setdefault(name, []).append(np.asarray(values, np.float64))
    included.append(np.asarray(run_included, bool))
    records += [{"run": run, "canary": i, "included": bool(inc),
                 **{name: float(values[i]) for name, values in scores.items()}}
                for i, inc in enumerate(run_included)]
  scores = {name: np.concatenate(values) for name, values in pooled.items()}
  report(f"the ε lower bounds of {len(records)} canaries")
  result = bounds.best_bounds(scores, np.concatenate(included), delta, confidence, rng, claim)
  headline = next(name for name in HEADLINES[threat_model] if name in result)
  return AuditResult(result, records, plan, headline)


def write_outputs(summary, records, scores_file=None, summary_json=None):
  """The scores file (JSON lines, one per canary) and the JSON summary, where asked for."""
  if scores_file:
    with open(scores_file, "w", encoding="utf-8") as out:
      out.writelines(atomic_io.dumps(record) + "\n" for record in records)
  if summary_json:
    atomic_io.write_json(summary_json, summary, sort_keys=True)
