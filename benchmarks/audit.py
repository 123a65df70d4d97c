"""Empirical ε lower bounds (`dprec audit`) next to the claimed ε, for every algorithm at
ε ∈ {1, 4, 16} and non-private, on synthetic Criteo data.

Every row goes through `dprec audit`'s code path (`audit_ctr`, the real DP step) on data
generated and loaded once; the bound is the one-run method of Steinke, Nasr & Jagielski 2023 at
95% confidence with the guesses of all runs pooled. DP-FEST and DP-AdaFEST+ select their rows from
DP top-k counts, which fresh-row canaries (count 1) essentially never reach.

    .venv/bin/python benchmarks/audit.py --rows 200000 --canaries 1000 --runs 4 --steps 500
    .venv/bin/python benchmarks/audit.py --rows 100000 --canaries 2000 --runs 4 --steps 300 \
        --batch-size 256 --hidden-units 64   # BENCHMARKS.md's table (~30 min, loaded machine)
    .venv/bin/python benchmarks/audit.py --rows 20000 --canaries 400 --runs 1 --steps 150 \
        --hidden-units 64 --epsilons 1 16   # reduced
"""
import argparse
import os
import tempfile

from dprec.audit import ctr as audit_ctr
from dprec.data import synthetic
from dprec.workflows import ctr as ctr_workflow

ALGORITHMS = ("dp_sgd", "dp_fest", "dp_adafest", "dp_adafest_plus")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=200000, help="synthetic rows (3 days)")
  parser.add_argument("--vocab", default="scaled:100k", help="synthetic vocabulary spec")
  parser.add_argument("--canaries", type=int, default=1000, help="canaries per run")
  parser.add_argument("--runs", type=int, default=4, help="runs per row (guesses pooled)")
  parser.add_argument("--steps", type=int, default=500, help="training steps")
  parser.add_argument("--batch-size", type=int, default=512, help="expected batch size")
  parser.add_argument("--hidden-units", default="64,64", help="Dense widths")
  parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 16.0])
  parser.add_argument("--top-k", type=int, default=2600, help="DP-FEST / AdaFEST+ rows")
  parser.add_argument("--threshold", type=float, default=5.0, help="DP-AdaFEST τ")
  parser.add_argument("--accountant", default="rdp", choices=("pld", "rdp"))
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as directory:
    synthetic.generate_criteo(directory, rows=args.rows, days=3, seed=0, vocab=args.vocab,
                              progress=False)
    data = ctr_workflow.load_data(directory)
  runs = [("non_private", None)] + [(a, e) for e in args.epsilons for a in ALGORITHMS]
  print("| algorithm | claimed ε | ε lower bound (95%) | canaries × runs | correct / guesses |")
  print("|---|---|---|---|---|")
  for algorithm, epsilon in runs:
    train = ctr_workflow.CTRTrainOptions(
        data=directory, algorithm=algorithm, epsilon=epsilon, batch_size=args.batch_size,
        steps=args.steps, hidden_units=tuple(int(u) for u in args.hidden_units.split(",")),
        top_k=args.top_k, threshold=args.threshold, accountant=args.accountant,
        progress=False)
    summary = audit_ctr.audit_ctr(
        audit_ctr.CTRAuditOptions(train=train, canaries=args.canaries, runs=args.runs), data)
    claimed = "∞" if epsilon is None else f"{epsilon:g}"
    print(f"| {algorithm} | {claimed} | {summary['epsilon_lower_bound']:.3f} | "
          f"{args.canaries} × {args.runs} | {summary['correct_guesses']} / "
          f"{summary['guesses']} |", flush=True)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  main()
