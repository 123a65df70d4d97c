"""Empirical ε lower bounds (`dprec audit`) next to the claimed ε, per algorithm and ε, on
synthetic Criteo data, in either threat model.

Every row goes through `dprec audit`'s code path (`audit_ctr`, the real DP step) on data
generated and loaded once; the headline bound (white box: the fit within the claimed
mechanism's family; black box: the one-run f-DP bound of Mahloujifar et al. 2024) at 95%
beside its ceiling, every estimator's bound, the ε of the DP steps alone, the canaries and the
wall time; `--draws` repeats each row with fresh canaries and noise (how reliable the bound is).

    # BENCHMARKS.md's white-box table: q = 1/2, T = 20, 100,000 Dirac canaries per run
    .venv/bin/python benchmarks/audit.py --threat-model white_box --rows 30000 \
        --batch-size 10000 --steps 20 --epsilons 1 2 4 8 16
    # the reliability table: ten draws at ε = 2, 4, 8 with `dprec audit`'s defaults
    .venv/bin/python benchmarks/audit.py --threat-model white_box --rows 60000 \
        --algorithms dp_sgd --epsilons 2 4 8 --draws 10
    # BENCHMARKS.md's black-box table: `dprec audit`'s defaults (data-sized B and T, m = 1000)
    .venv/bin/python benchmarks/audit.py --threat-model black_box --rows 60000 --epsilons 1 4 16
"""
import argparse
import os
import tempfile

from dprec.audit import ctr as audit_ctr
from dprec.data import synthetic
from dprec.workflows import ctr as ctr_workflow

ALGORITHMS = tuple(name for name in ctr_workflow.ALGORITHMS if name != "non_private")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--threat-model", default="white_box", choices=audit_ctr.THREAT_MODELS)
  parser.add_argument("--rows", type=int, default=30000, help="synthetic rows (3 days)")
  parser.add_argument("--vocab", default="scaled:100k", help="synthetic vocabulary spec")
  parser.add_argument("--canaries", type=int, help="canaries per run (default: the audit's)")
  parser.add_argument("--runs", type=int, default=1, help="runs per row (canaries pooled)")
  parser.add_argument("--steps", type=int, help="training steps (default: data-sized)")
  parser.add_argument("--batch-size", type=int, help="expected batch size (default: data-sized)")
  parser.add_argument("--hidden-units", default=None, help="Dense widths (default: train ctr's)")
  parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, 16.0])
  parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
  parser.add_argument("--top-k", type=int, default=2600, help="DP-FEST / AdaFEST+ rows")
  parser.add_argument("--accountant", default="pld", choices=("pld", "rdp"))
  parser.add_argument("--draws", type=int, default=1,
                      help="independent audits per row (fresh canaries and noise each)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as directory:
    synthetic.generate_criteo(directory, rows=args.rows, days=3, seed=0, vocab=args.vocab,
                              progress=False)
    data = ctr_workflow.load_data(directory)
  extra = {}
  if args.hidden_units:
    extra["hidden_units"] = tuple(int(u) for u in args.hidden_units.split(","))
  runs = [("non_private", None)] + [(a, e) for e in args.epsilons for a in args.algorithms]
  print(f"threat model {args.threat_model}; N = {len(data.train['label'])} training rows")
  print("| algorithm | claimed ε | ε of the DP steps | headline ε lower bound (95%) | "
        "ceiling | one-run f-DP | Steinke et al. (ceiling) | GDP fit | family fit | counting | "
        "canaries × runs | q, T | seconds |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for algorithm, epsilon in runs:
    train = ctr_workflow.CTRTrainOptions(
        data=directory, algorithm=algorithm, epsilon=epsilon, batch_size=args.batch_size,
        steps=args.steps, top_k=args.top_k, accountant=args.accountant, progress=False, **extra)
    for _ in range(args.draws if epsilon is not None else 1):
      summary = audit_ctr.audit_ctr(audit_ctr.CTRAuditOptions(
          train=train, threat_model=args.threat_model, canaries=args.canaries, runs=args.runs),
          data)
      claimed = "∞" if epsilon is None else f"{epsilon:g}"
      steps_epsilon = summary["steps_epsilon"]
      estimators = {name: f"{bound['epsilon_lower_bound']:.2f}"
                    for name, bound in summary["estimators"].items()}
      print(f"| {algorithm} | {claimed} | "
            f"{'∞' if steps_epsilon is None else f'{steps_epsilon:.2f}'} | "
            f"**{summary['epsilon_lower_bound']:.2f}** ({summary['headline']}) | "
            f"{summary['ceiling']:.2f} | {estimators['gdp']} | "
            f"{estimators['steinke']} ({summary['ceiling_steinke']:.2f}) | "
            f"{estimators['gdp_fit']} | {estimators.get('family_fit', '–')} | "
            f"{estimators['clopper_pearson']} | "
            f"{summary['canaries']} × {summary['runs']} | "
            f"{summary['sampling_rate']:.3g}, {summary['steps']} | {summary['seconds']:.0f} |",
            flush=True)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  main()
