"""Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large Embedding Models",
arXiv:2311.08357, Table 5 on a synthetic Criteo time series: final AUC by streaming period.

    python benchmarks/streaming_criteo.py [--rows-per-day 4000] [--periods 1,2,4,8,18] \\
        [--hidden-units 598,598,598,598] [--batch-size 256] [--out DIR]

A 24-day Criteo-like stream with drift (`dprec.data.synthetic`: popularity shifts, new ids, a
drifting click rate) goes through the streaming Beam job once (one window per day: TFRecords and
a vocabulary snapshot with running counts per day). For every streaming period P, `dprec stream`
then trains the pCTR model on days 0–17 period by period (one epoch of each period's data, the
same number of steps for every P) and evaluates the final model on days 18–23, as Ghazi et al. 2023,
§4.3 (train on days 1–18, evaluate on 19–24). Rows: non-private, DP-SGD at ε ∈ {1, 3, 8} and
DP-AdaFEST at ε = 1, δ = 1/N; each run's privacy is one ledger over all its periods. Prints a
table (AUC per period and configuration, the noise multiplier σ each plan needed, and
DP-AdaFEST's gradient-size reduction) and writes it as JSON.
"""
import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time

CONFIGS = (("non_private", None), ("dp_sgd", 1.0), ("dp_sgd", 3.0), ("dp_sgd", 8.0),
           ("dp_adafest", 1.0))
TRAIN_DAYS, DAYS = 18, 24


def _stream_args(data, run_dir, algorithm, epsilon, period, options):
  """`dprec stream` arguments, parsed by the command's own parser."""
  from dprec.workflows import stream_cli
  parser = argparse.ArgumentParser()
  stream_cli.register(parser.add_subparsers())
  argv = ["stream", "--data", data, "--run-dir", run_dir, "--algorithm", algorithm,
          "--period-days", str(period), "--train-days", str(TRAIN_DAYS),
          "--batch-size", str(options.batch_size), "--hidden-units", options.hidden_units,
          "--learning-rate", str(options.learning_rate), "--checkpoint-every", "1000",
          "--epochs-per-period", str(options.epochs),
          "--threshold", str(options.threshold), "--no-progress",
          "--delta", str(1.0 / (options.rows_per_day * TRAIN_DAYS))]
  if epsilon is not None:
    argv += ["--epsilon", str(epsilon)]
  return parser.parse_args(argv + shlex.split(options.stream_args))


def prepare_stream(root, options):
  """24 synthetic day files through the streaming Beam job; returns its output directory."""
  from dprec.data.synthetic import generate_criteo
  from pipelines import criteo_stream
  output = os.path.join(root, "stream")
  if os.path.exists(os.path.join(output, "manifest.json")):
    return output
  generate_criteo(os.path.join(root, "days"), rows=options.rows_per_day * DAYS, days=DAYS,
                  seed=options.seed, vocab=options.vocab, progress=False)
  job = criteo_stream.StreamJob(input_dir=os.path.join(root, "days"), output=output,
                                poll_seconds=0.2, stop_after_day=DAYS - 1, idle_timeout=120)
  criteo_stream.run(job, ["--direct_num_workers=1", "--direct_running_mode=in_memory"])
  return output


def run_one(data, root, algorithm, epsilon, period, options):
  from dprec.workflows import run_cli, stream
  from dprec.workflows.stream_options import StreamOptions
  run_dir = os.path.join(root, f"run-{algorithm}-{epsilon}-{period}")
  shutil.rmtree(run_dir, ignore_errors=True)
  started = time.perf_counter()
  summary = stream.run(run_cli.options_from_args(
      StreamOptions, _stream_args(data, run_dir, algorithm, epsilon, period, options)))
  rows = summary["periods"]
  return {
      "algorithm": algorithm, "epsilon": epsilon, "period_days": period,
      "auc": summary["holdout"]["auc"] if summary["holdout"] else None,
      "epsilon_spent": summary["epsilon"], "noise_multiplier": summary["plan"]["noise_multiplier"],
      "sampling_rate": summary["plan"]["sampling_rate"], "periods": len(rows),
      "steps": sum(r["steps"] for r in rows),
      "gradient_size_reduction": sum(r["gradient_size_reduction"] for r in rows) / len(rows),
      "seconds": time.perf_counter() - started, "stopped": summary["stopped"]}


def table(results, periods):
  def key(algorithm, epsilon):
    return "non-private" if epsilon is None else f"{algorithm} ε={epsilon:g}"

  by = {(r["algorithm"], r["epsilon"], r["period_days"]): r for r in results}
  columns = [c for c in CONFIGS if any((c[0], c[1], p) in by for p in periods)]
  lines = ["| period (days) | " + " | ".join(key(*c) for c in columns)
           + " | σ DP-SGD ε=1 | DP-AdaFEST grad. reduction |",
           "|---" * (len(columns) + 3) + "|"]
  for p in periods:
    cells = [f"{by[(a, e, p)]['auc']:.4f}" if (a, e, p) in by else "—" for a, e in columns]
    sigma = by.get(("dp_sgd", 1.0, p), {}).get("noise_multiplier")
    reduction = by.get(("dp_adafest", 1.0, p), {}).get("gradient_size_reduction")
    cells.append(f"{sigma:.3f}" if sigma else "—")
    cells.append(f"{reduction:.1f}×" if reduction else "—")
    lines.append(f"| {p} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows-per-day", type=int, default=4000)
  parser.add_argument("--vocab", default="scaled:5k", help="synthetic vocabulary (dprec synth)")
  parser.add_argument("--periods", default="1,2,4,8,18")
  parser.add_argument("--configs", default=",".join(f"{a}:{e}" for a, e in CONFIGS),
                      help="algorithm:epsilon pairs (epsilon None for non_private)")
  parser.add_argument("--hidden-units", default="598,598,598,598")
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--learning-rate", type=float, default=0.05)
  parser.add_argument("--epochs", type=float, default=1.0, help="passes over each period's data")
  parser.add_argument("--threshold", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--stream-args", default="",
                      help="more `dprec stream` options for every run, e.g. '--optimizer adagrad "
                      "--l2-norm-clip 1' (the step of the first Table 5 record)")
  parser.add_argument("--out", default=None, help="keep data and runs here (default: temp dir)")
  parser.add_argument("--json", default="streaming_criteo.json")
  options = parser.parse_args(argv)
  periods = [int(p) for p in options.periods.split(",")]
  configs = [(a, None if e == "None" else float(e))
             for a, e in (c.split(":") for c in options.configs.split(","))]
  root = options.out or tempfile.mkdtemp(prefix="streaming_criteo_")
  os.makedirs(root, exist_ok=True)
  data = prepare_stream(root, options)
  results = []
  for period in periods:
    for algorithm, epsilon in configs:
      results.append(run_one(data, root, algorithm, epsilon, period, options))
      print(json.dumps(results[-1]), file=sys.stderr, flush=True)
      with open(options.json, "w", encoding="utf-8") as f:
        json.dump({"options": vars(options), "results": results}, f, indent=1)
  print(table(results, periods))
  if options.out is None:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
