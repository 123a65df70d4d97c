"""DPFormer vs vanilla tied transformer vs untied ("W/O PS") on Amazon Games (paper Table 2).

    python benchmarks/dpformer_amazon.py [--data ../shared/data/amazon-video-games/Video.txt]
        [--epsilons 5 8 10] [--methods dpformer vanilla untied] [--seeds 0 1 2] [--non-private]
        [--epochs 100] [--batch-size 1024] [--learning-rate 5e-3] [--runs-dir DIR]

Preprocesses `Video.txt` once with the Beam sequences job (SASRec format, no k-core, last item
held out for testing, no validation: the paper's split) into `--work-dir`, then trains each
(method, ε, seed) with `dprec train seqrec`'s library entry point and prints NDCG@10 / HIT@10 (%)
overall and per popularity bucket next to the paper's Table 2, with the popularity baseline
(items ranked by training frequency). δ = 1/N users. With `--runs-dir`, every run checkpoints
into its own subdirectory there, and the same command resumes killed runs (a 100-epoch run takes
well over an hour on 2 CPU cores).

    python benchmarks/dpformer_amazon.py --curve DIR [DIR ...] [--curve-every 3]

instead evaluates the checkpoints `ckpt-<n>` in each DIR (a run's `checkpoints/` or copies of
them) and prints NDCG@10 / HIT@10 by training step: the learning curve of the paper's Fig. 6,
what a "best epoch" selection on the test set (which the paper may have used) would report, and
how personal the top-10s are (distinct items, overlap with the popularity top-10 and between users).

    python benchmarks/dpformer_amazon.py --time-steps [--batch-size 256] [--steps 3]

instead times one DP step (σ from ε = 5, DPFormer) on the same real batches, scoring only the
positions with a target (the default) vs all L positions (`--score-padding`), in one process.
"""
import argparse
import glob
import json
import os
import sys
import time

import numpy as np

from dprec.data.sequences import load_sequences, make_examples
from dprec.models import ranking_metrics
from dprec.training.checkpoint import MODEL_PREFIX, CheckpointManager
from dprec.workflows.resume import checkpoint_objects
from dprec.workflows.seqrec import (SeqRecTrainOptions, build_model,
                                    evaluate, options_from_checkpoint, plan_privacy)
from dprec.workflows.seqrec import run as train_seqrec

PAPER_TABLE2 = {  # (ε, method) -> (NDCG@10, HIT@10) in %, Ding et al., "DPFormer: Learning
# Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633
    (5.0, "dpformer"): (1.64, 3.01), (8.0, "dpformer"): (1.98, 3.70),
    (10.0, "dpformer"): (1.99, 3.73),
    (5.0, "vanilla"): (1.37, 2.47), (8.0, "vanilla"): (1.54, 2.77), (10.0, "vanilla"): (1.57, 2.83),
    (5.0, "untied"): (1.16, 2.36), (8.0, "untied"): (1.20, 2.38), (10.0, "untied"): (1.40, 2.47),
}
METHODS = {"dpformer": dict(reattention=True, tied=True),
           "vanilla": dict(reattention=False, tied=True),
           "untied": dict(reattention=False, tied=False)}


def preprocess(source, work_dir, validation=False):
  """Runs the Beam sequences job once; later runs reuse its output. `validation`: the second
  to last item is held out for model selection (a separate output directory)."""
  out = os.path.join(work_dir, "sequences-valid" if validation else "sequences")
  if not os.path.exists(os.path.join(out, "manifest.json")):
    from pipelines import sequences
    sequences.run(sequences.SequencesJob(inputs=(source,), input_format="sasrec", output=out,
                                         validation=validation))
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
  parser.add_argument("--normalize", type=float, nargs="?", const=0.01, default=None,
                      metavar="GAMMA", help="per-user normalisation C/(‖g‖+GAMMA) (the paper's)")
  parser.add_argument("--variance-scale", type=float, default=1.0,
                      help="multiplier of Re-Attention's σ_eff² (1 = the paper's literal σ_eff)")
  parser.add_argument("--no-reattention-scale-by-dim", action="store_true",
                      help="Re-Attention with the paper's literal C = ⟨q,q⟩ (default ⟨q,q⟩/d_k)")
  parser.add_argument("--reattention-train-only", action="store_true",
                      help="no Re-Attention correction at evaluation")
  parser.add_argument("--max-len", type=int, default=50)
  parser.add_argument("--validation", action="store_true",
                      help="hold out each user's second to last item for model selection "
                           "(the DPFormer protocol); the table gains validation columns")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--item-rank", type=int, default=None)
  parser.add_argument("--item-norm-share", type=float, default=None)
  parser.add_argument("--item-vocab-threshold", type=float, default=None)
  parser.add_argument("--item-histogram-items", type=int, default=None)
  parser.add_argument("--item-frequency-share", type=float, default=0.05)
  parser.add_argument("--popularity-weights", action="store_true")
  parser.add_argument("--dropout", type=float, default=0.5)
  parser.add_argument("--results", default=None, help="append one JSON line per run here")
  parser.add_argument("--runs-dir", default=None,
                      help="checkpoint each run in a subdirectory here; rerun to resume")
  parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
  parser.add_argument("--keep-checkpoints", type=int, default=2,
                      help="checkpoints kept per run (0: all, for --curve)")
  parser.add_argument("--time-steps", action="store_true",
                      help="time the DP step with and without scoring the padding, then exit")
  parser.add_argument("--steps", type=int, default=3, help="timed steps for --time-steps")
  parser.add_argument("--curve", nargs="+", metavar="DIR",
                      help="evaluate the checkpoints in these directories, then exit")
  parser.add_argument("--curve-every", type=int, default=1,
                      help="with --curve, every k-th checkpoint (the last one always)")
  args = parser.parse_args(argv)
  data = load_sequences(preprocess(args.data, args.work_dir, args.validation))
  print(f"Amazon Games: {data.num_users} users, {data.num_items} items, "
        f"{data.stats['actions']} actions", file=sys.stderr)
  if args.time_steps:
    print(time_steps(data, args))
    return
  if args.curve:
    print(learning_curve(data, args))
    return
  runs = [(eps, method, seed) for eps in args.epsilons for method in args.methods
          for seed in args.seeds]
  if args.non_private:
    runs += [(float("inf"), method, seed) for method in args.methods for seed in args.seeds]
  rows = {}
  for eps, method, seed in runs:
    options = SeqRecTrainOptions(
        model="dpformer", epsilon=eps, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, loss_positions=args.loss_positions,
        normalization_offset=args.normalize, variance_scale=args.variance_scale,
        reattention_scale_by_dim=not args.no_reattention_scale_by_dim,
        reattention_at_eval=not args.reattention_train_only,
        max_len=args.max_len, seed=seed, checkpoint_every=args.checkpoint_every,
        hold_out_validation=args.validation, dim=args.dim, item_rank=args.item_rank,
        item_norm_share=args.item_norm_share, item_vocab_threshold=args.item_vocab_threshold,
        item_histogram_items=args.item_histogram_items,
        item_frequency_share=args.item_frequency_share, dropout=args.dropout,
        popularity_weights=args.popularity_weights, keep_checkpoints=args.keep_checkpoints,
        run_dir=args.runs_dir and os.path.join(args.runs_dir, (
            f"{method}-eps{eps:g}-seed{seed}-ep{args.epochs:g}-B{args.batch_size}"
            f"-lr{args.learning_rate:g}-{args.loss_positions}{lever_tag(args)}")),
        **METHODS[method])
    start = time.perf_counter()
    summary = train_seqrec(options, data)
    summary.update(method=method, wall_seconds=time.perf_counter() - start)
    shown = ("method", "epsilon_budget", "seed", "ndcg_at_10", "hit_at_10", "noise_multiplier",
             "validation", "distinct_top10_items", "item_vocabulary", "popularity_weights",
             "wall_seconds")
    print(json.dumps({k: summary[k] for k in shown}), file=sys.stderr)
    if args.results:
      with open(args.results, "a", encoding="utf-8") as out:
        out.write(json.dumps(summary) + "\n")
    rows.setdefault((eps, method), []).append(summary)
  print(table(rows, args))
  print(popularity_row(data, args))


def popularity_row(data, args):
  """The popularity baseline: every user gets the items ranked by training frequency p_i (with
  `--validation`: its validation NDCG@10 / HIT@10 too)."""
  examples = make_examples(data, args.max_len, args.validation)
  frequencies = examples.item_frequencies[1:].astype(np.float32)
  score = lambda histories: np.broadcast_to(frequencies, (len(histories), len(frequencies)))
  buckets = ranking_metrics.popularity_buckets(examples.item_frequencies)
  metrics = ranking_metrics.evaluate_full_ranking(score, examples.test_histories,
                                                  examples.test_items, buckets, batch_size=1024)
  cells = [f"{100 * metrics['by_popularity'][b]['ndcg_at_10']:.2f}"
           for b in ranking_metrics.BUCKETS]
  if args.validation:
    valid = ranking_metrics.evaluate_full_ranking(score, examples.valid_histories,
                                                  examples.valid_items, buckets, batch_size=1024)
    cells = [f"{100 * valid['ndcg_at_10']:.2f} / {100 * valid['hit_at_10']:.2f}"] + cells + ["10"]
  return (f"| — | popularity | — | {100 * metrics['ndcg_at_10']:.2f} | "
          f"{100 * metrics['hit_at_10']:.2f} | {' | '.join(cells)} | — |")


def time_steps(data, args):
  """Seconds per DP step on the same real batches, positions with a target vs all positions."""
  import tensorflow as tf
  examples = make_examples(data, args.max_len)
  rng = np.random.default_rng(0)
  batches = [np.sort(rng.choice(len(examples.items), args.batch_size, replace=False))
             for _ in range(args.steps + 1)]
  lines = [f"B={args.batch_size} L={args.max_len} loss={args.loss_positions} DPFormer ε=5 "
           f"{args.steps} timed steps after one warm-up step", "",
           "| scored positions | s/step | × packed |", "|---|---|---|"]
  seconds = {}
  for name, score_padding in (("with a target (packed)", False), ("all L (padding too)", True)):
    options = SeqRecTrainOptions(model="dpformer", epsilon=5.0, epochs=args.epochs,
                                 batch_size=args.batch_size,
                                 loss_positions=args.loss_positions, max_len=args.max_len,
                                 normalization_offset=args.normalize, score_padding=score_padding)
    tf.keras.utils.set_random_seed(0)
    model = build_model(options, examples, plan_privacy(options, len(examples.items)))
    times = []
    for batch in batches:
      start = time.perf_counter()
      model.train_on_batch({"items": examples.items[batch]}, examples.labels[batch])
      times.append(time.perf_counter() - start)
    seconds[name] = float(np.median(times[1:]))
    lines.append(f"| {name} | {seconds[name]:.2f} | "
                 f"{seconds[name] / seconds['with a target (packed)']:.1f} |")
  return "\n".join(lines)


def learning_curve(data, args):
  """NDCG@10 / HIT@10 (%) of every `--curve-every`-th checkpoint of each run directory (and on
  the validation items, for a run that held them out)."""
  lines = ["| run | step | epoch | validation NDCG@10 / HIT@10 | validation head / torso / tail "
           "NDCG | NDCG@10 | HIT@10 | head / torso / tail NDCG | "
           "distinct items in top-10s | top-10 ∩ popularity top-10 | top-10 ∩ other user's |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for directory in args.curve:
    paths = sorted(glob.glob(os.path.join(directory, "ckpt-*")))
    paths = [p for i, p in enumerate(paths) if i % args.curve_every == 0 or p == paths[-1]]
    if not paths:
      raise SystemExit(f"{directory}: no ckpt-* checkpoints")
    name = os.path.normpath(directory)
    name = os.path.basename(os.path.dirname(name) if name.endswith("checkpoints") else name)
    options = options_from_checkpoint(paths[0], progress=False)
    examples = make_examples(data, options.max_len, options.hold_out_validation)
    plan = plan_privacy(options, len(examples.items))
    model = build_model(options, examples, plan)
    for path in paths:
      checkpoint_objects(model).read(os.path.join(path, MODEL_PREFIX)).assert_consumed()
      step = CheckpointManager.read_state(path)["step"]
      metrics = evaluate(model, examples, options)
      validation = (evaluate(model, examples, options, examples.valid_histories,
                             examples.valid_items)
                    if examples.valid_histories is not None else None)
      lines.append(f"| {name} | {step} | "
                   f"{step * options.batch_size / len(examples.items):.1f} | "
                   f"{_ndcg_hit(validation)} | {_buckets(validation)} | "
                   f"{100 * metrics['ndcg_at_10']:.2f} | {100 * metrics['hit_at_10']:.2f} | "
                   f"{_buckets(metrics)} | {personalisation(model, examples)} |")
      print(lines[-1], file=sys.stderr, flush=True)
  return "\n".join(lines)


def _ndcg_hit(metrics):
  return "—" if metrics is None else (f"{100 * metrics['ndcg_at_10']:.2f} / "
                                      f"{100 * metrics['hit_at_10']:.2f}")


def _buckets(metrics):
  if metrics is None:
    return "—"
  return " / ".join(f"{100 * metrics['by_popularity'][b]['ndcg_at_10']:.2f}"
                    for b in ranking_metrics.BUCKETS)


def personalisation(model, examples, users=2000, seed=0):
  """`ranking_metrics.top_k_diversity` of the model over a fixed sample of test users, as
  table cells: distinct items | ∩ popularity top-10 | ∩ other user's top-10."""
  diversity = ranking_metrics.top_k_diversity(model.score_items, examples.test_histories,
                                              examples.item_frequencies, users, seed=seed)
  return (f"{diversity['distinct_top10_items']} | "
          f"{diversity['top10_popularity_overlap']:.2f} | "
          f"{diversity['top10_between_users_overlap']:.2f}")


def lever_tag(args):
  """The run directory's suffix naming the levers that differ from the defaults."""
  levers = [("d", args.dim, 64), ("r", args.item_rank, None), ("F", args.item_norm_share, None),
            ("T", args.item_vocab_threshold, None), ("K", args.item_histogram_items, None),
            ("f", args.item_frequency_share, 0.05), ("pw", args.popularity_weights, False),
            ("do", args.dropout, 0.5)]
  return "".join(f"-{name}{value:g}" if not isinstance(value, bool) else f"-{name}"
                 for name, value, default in levers if value != default)


def table(rows, args):
  """Markdown table: mean ± std over seeds, in %, with the paper's Table 2 cells."""
  validation = ["validation NDCG / HIT"] if args.validation else []
  diversity = ["distinct top-10 items"] if args.validation else []
  lines = [f"epochs={args.epochs:g} B={args.batch_size} lr={args.learning_rate:g} "
           f"d={args.dim} item_rank={args.item_rank} item_norm_share={args.item_norm_share} "
           f"item_vocab_threshold={args.item_vocab_threshold} "
           f"item_histogram_items={args.item_histogram_items} "
           f"item_frequency_share={args.item_frequency_share} "
           f"popularity_weights={args.popularity_weights} dropout={args.dropout} "
           f"L={args.max_len} loss={args.loss_positions} normalize={args.normalize} "
           f"variance_scale={args.variance_scale:g} "
           f"C={'<q,q>' if args.no_reattention_scale_by_dim else '<q,q>/d_k'} "
           f"reattention_at_eval={not args.reattention_train_only}", "",
           "| " + " | ".join(["ε", "method", "seeds", "NDCG@10", "HIT@10"] + validation
                             + ["head NDCG", "torso NDCG", "tail NDCG"] + diversity
                             + ["paper NDCG / HIT"]) + " |",
           "|" + "---|" * (9 + len(validation) + len(diversity))]

  def cell(values):
    values = 100 * np.asarray(values)
    return f"{values.mean():.2f} ± {values.std():.2f}" if len(values) > 1 else f"{values[0]:.2f}"

  for (eps, method), summaries in sorted(rows.items()):
    paper = PAPER_TABLE2.get((eps, method))
    cells = [cell([s["ndcg_at_10"] for s in summaries]), cell([s["hit_at_10"] for s in summaries])]
    if args.validation:
      cells.append(cell([s["validation"]["ndcg_at_10"] for s in summaries]) + " / "
                   + cell([s["validation"]["hit_at_10"] for s in summaries]))
    cells += [cell([s["by_popularity"][b]["ndcg_at_10"] for s in summaries])
              for b in ("head", "torso", "tail")]
    if args.validation:
      cells.append(" ".join(str(s["distinct_top10_items"]) for s in summaries))
    lines.append(f"| {eps:g} | {method} | {len(summaries)} | {' | '.join(cells)} | "
                 f"{'%.2f / %.2f' % paper if paper else '—'} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
