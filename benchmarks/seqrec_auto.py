"""`train seqrec --model auto` beside the two models it chooses between and most popular.

    python benchmarks/seqrec_auto.py --data FILE --results R.jsonl [--seeds 0 1 2]
        [--rows auto item2item dpformer] [--epsilon 5] [--set KEY=VALUE ...] [--tag NAME]
    python benchmarks/seqrec_auto.py --data FILE --results R.jsonl --popularity
    python benchmarks/seqrec_auto.py --results R.jsonl --table

`FILE` holds SASRec-style `user item` lines (Amazon Games' `Video.txt`, or a
`dprec synth sequences` output). It is preprocessed once with the Beam sequences job (last item
for testing, second to last for validation, no k-core) into `--work-dir`, then each (row, seed)
runs `dprec train seqrec`'s library entry point (`seqrec.run`) at ε = `--epsilon`:

- auto: the default, `--model auto` (its choice and why are recorded);
- item2item: `--model item2item` with its defaults;
- dpformer: `--model dpformer` with the settings `--model auto` applies when it picks the
  transformer (`model_choice.TRANSFORMER_SETTINGS`: the paper's MovieLens schedule).

`--set` overrides options of every run (e.g. `epochs=25`, `reattention=false`), `--tag` names
the data set in the records (default: the file's name). One JSON line per run is appended to
`--results`; a (tag, row, overrides, seed) already there is skipped, so a killed sweep resumes.
Nothing is selected on the test items: every row runs at fixed settings; validation metrics are
recorded beside the test metrics. `--table` prints the mean and the draws per (data, row).
"""
import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from dpformer_amazon import preprocess  # noqa: E402
import jsonl_records  # noqa: E402
from seqrec_runs import append, key, pairs, popularity, run  # noqa: E402

from dprec.data.sequences import load_sequences, make_examples  # noqa: E402
from dprec.workflows import model_choice, seqrec  # noqa: E402

ROWS = {"auto": {"model": model_choice.AUTO},
        "item2item": {"model": "item2item"},
        "dpformer": dict({"model": "dpformer"}, **model_choice.TRANSFORMER_SETTINGS)}
_UNSET = object()  # a key a row does not set
KEPT = ("model", "ndcg_at_10", "hit_at_10", "validation", "distinct_top10_items", "epsilon",
        "delta", "noise_multiplier", "steps", "epochs", "batch_size", "model_choice",
        "train_examples", "items", "reattention")


def run_rows(data, args, tag):
  """Runs every (row, seed) not yet in `args.results`; appends one record each."""
  done = {(r.get("tag"), r.get("row"), key(r.get("overrides", {})), r.get("seed"))
          for r in jsonl_records.read(args.results)}
  extra = pairs(args.set)
  for name in args.rows:
    overrides = dict(ROWS[name], epsilon=args.epsilon, **extra)
    for seed in args.seeds:
      if (tag, name, key(overrides), seed) not in done:
        record = dict(run(data, overrides, seed, KEPT), tag=tag, row=name)
        append(args.results, record)
        print(_line(record), flush=True)


def _line(record):
  choice = record.get("model_choice") or {}
  return (f"{record['tag']} {record['row']} seed {record['seed']}: {record['model']} "
          f"test NDCG@10 {100 * record['ndcg_at_10']:.2f} %, validation "
          f"{100 * (record.get('validation') or {}).get('ndcg_at_10', float('nan')):.2f} %, "
          f"{record.get('steps')} steps, {record['seconds']:.0f} s"
          + (f"; chose {choice['model']}: {choice.get('reason')}" if "reason" in choice else ""))


def table(records):
  """Markdown: per (data, row, overrides) the mean test and validation NDCG@10 (%), the test
  draws, what ran (auto: what it chose) and the distinct items in the top-10s."""
  groups = collections.defaultdict(list)
  for record in records:
    groups[(record.get("tag"), record["row"], key(record.get("overrides", {})))].append(record)
  pct = lambda values: f"{100 * np.mean(values):.2f}"
  lines = ["| data | row | model run | overrides | seeds | test NDCG@10 % (mean) | draws | "
           "validation NDCG@10 % (mean) | test HIT@10 % (mean) | distinct top-10 items | "
           "ε spent |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for (tag, row, _), runs in sorted(groups.items(), key=lambda group: group[0][:2]):
    valid = [(r.get("validation") or {}).get("ndcg_at_10", np.nan) for r in runs]
    test = [r["ndcg_at_10"] for r in runs]
    models = sorted({r["model"] for r in runs})
    extra = {k: v for k, v in runs[0].get("overrides", {}).items()
             if k != "epsilon" and ROWS.get(row, {}).get(k, _UNSET) != v}
    spent = runs[0].get("epsilon")
    lines.append(
        f"| {tag} | {row} | {', '.join(models)} | {extra or '—'} | "
        f"{', '.join(str(r.get('seed')) for r in runs if r.get('seed') is not None) or '—'} | "
        f"{pct(test)} | {', '.join(f'{100 * value:.2f}' for value in test)} | {pct(valid)} | "
        f"{pct([r['hit_at_10'] for r in runs])} | "
        f"{', '.join(str(r.get('distinct_top10_items')) for r in runs)} | "
        f"{'—' if spent is None else f'{spent:.4f}'} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", help="SASRec-style 'user item' lines")
  parser.add_argument("--tag", default=None, help="the data set's name in the records")
  parser.add_argument("--work-dir", default="/tmp/dprec_seqrec_auto")
  parser.add_argument("--results", required=True, help="the JSON lines file (appended)")
  parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
  parser.add_argument("--epsilon", type=float, default=5.0)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="SeqRecTrainOptions overrides for every run (values parsed as JSON)")
  parser.add_argument("--popularity", action="store_true", help="record most popular, then exit")
  parser.add_argument("--table", action="store_true", help="print the recorded runs, then exit")
  args = parser.parse_args(argv)
  if args.table:
    print(table(jsonl_records.read(args.results)))
    return
  if not args.data:
    parser.error("--data is required unless --table")
  tag = args.tag or os.path.splitext(os.path.basename(args.data))[0]
  data = load_sequences(preprocess(args.data, os.path.join(args.work_dir, tag), validation=True))
  if args.popularity:
    if not any(r.get("tag") == tag and r["row"] == "most popular"
               for r in jsonl_records.read(args.results)):
      record = popularity(make_examples(data, seqrec.SeqRecTrainOptions.max_len, True))
      append(args.results, dict(record, tag=tag, row="most popular", overrides={}, seed=None))
      print(_line(dict(record, tag=tag, row="most popular", seed=None, seconds=0)))
    return
  run_rows(data, args, tag)


if __name__ == "__main__":
  main()
