"""The frozen-table DP transformer (`train seqrec --model dpformer-frozen`) on Amazon
Games, beside item2item, most popular and the non-private transformer; one lever at a time.

    python benchmarks/seqrec_frozen.py --results R.jsonl --seeds 0 [--epsilon 5]
        [--model dpformer-frozen] [--set KEY=VALUE ...] [--grid KEY=V1,V2,...]
    python benchmarks/seqrec_frozen.py --results R.jsonl --popularity
    python benchmarks/seqrec_frozen.py --results R.jsonl --table
    python benchmarks/seqrec_frozen.py --results R.jsonl --time-steps 5 [--set ...]

Preprocesses `Video.txt` once with a validation item (`dpformer_amazon.preprocess`), then runs
`dprec train seqrec`'s library entry point (`seqrec.run`) once per (grid value, seed) with the
given `SeqRecTrainOptions` overrides (values parsed as JSON, else kept as strings), and appends
one JSON line per run to `--results` with the overrides, the summary's metrics, the wall time
and the load average before and after. A run whose (overrides, seed) is already there is
skipped, so a killed sweep resumes. `--table` prints every recorded run as a Markdown row
(NDCG@10 / HIT@10 in %). `--time-steps K` instead times K DP steps (after one warm-up
step) of the last-position loss and of the all-positions loss, both the full softmax over
all M items, alternating on the same Poisson batches in one process, and records the
median seconds per step with the load average.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from dpformer_amazon import preprocess
import jsonl_records  # noqa: E402
from seqrec_runs import append, key, pairs, popularity, run, value  # noqa: E402

from dprec.data.sequences import load_sequences, make_examples  # noqa: E402
from dprec.models import ranking_metrics  # noqa: E402
from dprec.workflows import seqrec  # noqa: E402

KEPT = ("model", "ndcg_at_10", "hit_at_10", "by_popularity", "validation", "distinct_top10_items",
        "epsilon", "noise_multiplier", "steps", "steps_per_second", "item_pairs",
        "item_frequencies", "logit_prior", "reattention", "epoch_selection",
        "train_prior_weight")


def row(record):
  """A Markdown row: overrides, seed, test and validation NDCG@10 / HIT@10, buckets, items."""
  pct = lambda x: f"{100 * x:.2f}"
  valid = record.get("validation") or {}
  buckets = record.get("by_popularity") or {}
  prior = (record.get("logit_prior") or {}).get("weight")
  return (f"| {record['overrides']} | {record.get('seed', '—')} | "
          f"{pct(record['ndcg_at_10'])} / {pct(record['hit_at_10'])} | "
          f"{pct(valid.get('ndcg_at_10', float('nan')))} / "
          f"{pct(valid.get('hit_at_10', float('nan')))} | "
          + " / ".join(pct(buckets[b]["ndcg_at_10"])
                       for b in ranking_metrics.BUCKETS if b in buckets)
          + f" | {record.get('distinct_top10_items')} | {prior} | "
          f"{record.get('steps_per_second') and round(record['steps_per_second'], 2)} | "
          f"{record.get('seconds', 0):.0f} | {record.get('load_before')} |")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=os.path.join(
      os.path.dirname(__file__), "..", "..", "shared", "data", "amazon-video-games", "Video.txt"))
  parser.add_argument("--work-dir", default="/tmp/dprec_amazon")
  parser.add_argument("--results", required=True, help="the JSON lines file (appended)")
  parser.add_argument("--model", default=seqrec.FROZEN, choices=seqrec.MODELS)
  parser.add_argument("--epsilon", type=float, default=5.0)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="SeqRecTrainOptions overrides for every run")
  parser.add_argument("--grid", default=None, metavar="KEY=V1,V2",
                      help="one lever: a run per value (each parsed as JSON)")
  parser.add_argument("--popularity", action="store_true", help="record most popular, then exit")
  parser.add_argument("--table", action="store_true", help="print the recorded runs, then exit")
  parser.add_argument("--time-steps", type=int, default=0, metavar="K",
                      help="time K steps, last position against all positions, then exit")
  args = parser.parse_args(argv)
  if args.table:
    print("| overrides | seed | test NDCG@10 / HIT@10 | validation NDCG@10 / HIT@10 | "
          "head / torso / tail NDCG | distinct items | prior w | steps/s | s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for record in jsonl_records.read(args.results):
      print(row(record))
    return
  data = load_sequences(preprocess(args.data, args.work_dir, validation=True))
  done = {(key(r["overrides"]), r.get("seed")) for r in jsonl_records.read(args.results)}
  if args.popularity:
    if (key({"model": "most popular"}), None) not in done:
      append(args.results, dict(popularity(make_examples(data, 50, True)),
                                overrides={"model": "most popular"}))
    return
  if args.time_steps:
    append(args.results, time_steps(data, args))
    return
  values = [None]
  if args.grid:
    name, listed = args.grid.split("=", 1)
    values = [{name: value(v)} for v in listed.split(",")]
  for lever in values:
    overrides = dict({"model": args.model, "epsilon": args.epsilon}, **pairs(args.set),
                     **(lever or {}))
    for seed in args.seeds:
      if (key(overrides), seed) not in done:
        record = run(data, overrides, seed, KEPT)
        append(args.results, record)
        print(row(record), flush=True)


def time_steps(data, args):
  """{s/step by loss positions, their ratio, load average}: the frozen model's DP step."""
  overrides = dict({"model": args.model, "epsilon": args.epsilon}, **pairs(args.set))
  models, examples = {}, None
  for positions in ("last", "all"):
    options = seqrec.SeqRecTrainOptions(**dict(overrides, loss_positions=positions))
    examples = make_examples(data, options.max_len, True)
    plan = seqrec.plan_privacy(options, len(examples.items))
    models[positions] = seqrec.build_model(options, examples, plan)
  rng = np.random.default_rng(0)
  q = overrides["batch_size"] / len(examples.items)
  seconds = {positions: [] for positions in models}
  load = os.getloadavg()
  for _ in range(args.time_steps + 1):
    batch = np.flatnonzero(rng.random(len(examples.items)) < q)
    for positions, model in models.items():
      start = time.perf_counter()
      model.train_on_batch({"items": examples.items[batch]}, examples.labels[batch])
      seconds[positions].append(time.perf_counter() - start)
  median = {positions: float(np.median(times[1:])) for positions, times in seconds.items()}
  return {"overrides": dict(overrides, time_steps=args.time_steps), "seconds_per_step": median,
          "all_over_last": median["all"] / median["last"], "load_before": load,
          "load_after": os.getloadavg()}


if __name__ == "__main__":
  main()
