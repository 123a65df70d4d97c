"""DPFormer vs vanilla tied transformer vs untied ("W/O PS") on Amazon Games (paper Table 2).

    python benchmarks/dpformer_amazon.py [--data ../shared/data/amazon-video-games/Video.txt]
        [--epsilons 5 8 10] [--methods dpformer vanilla untied] [--seeds 0 1 2] [--non-private]
        [--epochs 100] [--batch-size 1024] [--learning-rate 5e-3]

Preprocesses `Video.txt` once with the Beam sequences job (SASRec format, no k-core, last item
held out for testing, no validation: the paper's split) into `--work-dir`, then trains each
(method, ε, seed) with `dprec train seqrec`'s library entry point and prints NDCG@10 / HIT@10 (%)
overall and per popularity bucket next to the paper's Table 2. δ = 1/N users.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from dprec.data.sequences import load_sequences
from dprec.models.seqrec_cli import SeqRecTrainOptions, train_seqrec

PAPER_TABLE2 = {  # (ε, method) -> (NDCG@10, HIT@10) in %, note 000 §8
    (5.0, "dpformer"): (1.64, 3.01), (8.0, "dpformer"): (1.98, 3.70),
    (10.0, "dpformer"): (1.99, 3.73),
    (5.0, "vanilla"): (1.37, 2.47), (8.0, "vanilla"): (1.54, 2.77), (10.0, "vanilla"): (1.57, 2.83),
    (5.0, "untied"): (1.16, 2.36), (8.0, "untied"): (1.20, 2.38), (10.0, "untied"): (1.40, 2.47),
}
METHODS = {"dpformer": dict(reattention=True, tied=True),
           "vanilla": dict(reattention=False, tied=True),
           "untied": dict(reattention=False, tied=False)}


def preprocess(source, work_dir):
  """Runs the Beam sequences job once; later runs reuse its output."""
  out = os.path.join(work_dir, "sequences")
  if not os.path.exists(os.path.join(out, "manifest.json")):
    from pipelines import sequences  # pylint: disable=import-outside-toplevel
    sequences.run(sequences.SequencesJob(inputs=(source,), input_format="sasrec", output=out,
                                         validation=False))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=os.path.join(
      os.path.dirname(__file__), "..", "..", "shared", "data", "amazon-video-games", "Video.txt"))
  parser.add_argument("--work-dir", default="/tmp/dprec_amazon")
  parser.add_argument("--epsilons", type=float, nargs="*", default=[5.0, 8.0, 10.0])
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--non-private", action="store_true", help="also train without DP")
  parser.add_argument("--epochs", type=float, default=100.0)
  parser.add_argument("--batch-size", type=int, default=1024)
  parser.add_argument("--learning-rate", type=float, default=5e-3)
  parser.add_argument("--loss-positions", choices=("all", "last"), default="all")
  parser.add_argument("--max-len", type=int, default=50)
  parser.add_argument("--results", default=None, help="append one JSON line per run here")
  args = parser.parse_args(argv)
  data = load_sequences(preprocess(args.data, args.work_dir))
  print(f"Amazon Games: {data.num_users} users, {data.num_items} items, "
        f"{data.stats['actions']} actions", file=sys.stderr)
  runs = [(eps, method, seed) for eps in args.epsilons for method in args.methods
          for seed in args.seeds]
  if args.non_private:
    runs += [(float("inf"), method, seed) for method in args.methods for seed in args.seeds]
  rows = {}
  for eps, method, seed in runs:
    options = SeqRecTrainOptions(
        epsilon=eps, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, loss_positions=args.loss_positions,
        max_len=args.max_len, seed=seed, **METHODS[method])
    start = time.perf_counter()
    summary = train_seqrec(options, data)
    summary.update(method=method, wall_seconds=time.perf_counter() - start)
    print(json.dumps({k: summary[k] for k in ("method", "epsilon_budget", "seed", "ndcg_at_10",
                                              "hit_at_10", "noise_multiplier",
                                              "wall_seconds")}), file=sys.stderr)
    if args.results:
      with open(args.results, "a", encoding="utf-8") as out:
        out.write(json.dumps(summary) + "\n")
    rows.setdefault((eps, method), []).append(summary)
  print(table(rows, args))


def table(rows, args):
  """Markdown table: mean ± std over seeds, in %, with the paper's Table 2 cells."""
  lines = [f"epochs={args.epochs:g} B={args.batch_size} lr={args.learning_rate:g} "
           f"L={args.max_len} loss={args.loss_positions}", "",
           "| ε | method | seeds | NDCG@10 | HIT@10 | head NDCG | torso NDCG | tail NDCG | "
           "paper NDCG / HIT |", "|---|---|---|---|---|---|---|---|---|"]

  def cell(values):
    values = 100 * np.asarray(values)
    return f"{values.mean():.2f} ± {values.std():.2f}" if len(values) > 1 else f"{values[0]:.2f}"

  for (eps, method), summaries in sorted(rows.items()):
    paper = PAPER_TABLE2.get((eps, method))
    buckets = [cell([s["by_popularity"][b]["ndcg_at_10"] for s in summaries])
               for b in ("head", "torso", "tail")]
    lines.append(
        f"| {eps:g} | {method} | {len(summaries)} | "
        f"{cell([s['ndcg_at_10'] for s in summaries])} | "
        f"{cell([s['hit_at_10'] for s in summaries])} | {' | '.join(buckets)} | "
        f"{'%.2f / %.2f' % paper if paper else '—'} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
