"""Throughput of the Criteo Beam batch job against a single-process pandas yardstick, same run.

    .venv/bin/python benchmarks/beam_criteo.py --rows 2000000 [--data DIR] [--days 2]

Both produce the same output from the same synthetic day files (vocabulary at min count 1, ids
by decreasing count, log(1 + max(x, 0)) integers, TFRecords of `tf.train.Example`s written with
the same encoder): the Beam job on the embedded runner with 2 worker processes, reading the input
twice (counts, then transform) in bounded memory; the yardstick the way a pandas user would
write it: `read_csv` of whole files into memory, `value_counts`, `Index.get_indexer`. The
yardstick validates less (pandas' column count only), so the comparison favours it. Prints a
table of seconds, rows/s, throughput ratio and peak resident memory, and checks that both wrote
the same first rows.
"""
import argparse
import os
import resource
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import tensorflow as tf  # Imported up front: neither timing includes the driver's TF import.

import criteo_input

from dprec.data import criteo_tfrecord
from dprec.data.criteo import CATEGORICAL_FEATURES
from dprec.data.criteo import COLUMNS
from dprec.data.criteo import INTEGER_FEATURES
from pipelines import beam_io
from pipelines import criteo

BEAM_ARGS = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


def pandas_yardstick(paths, output):
  """Plain pandas: whole files in memory, counts, vocabularies, transform, TFRecords per day."""
  frames = {beam_io.day_of(p): pd.read_csv(p, sep="\t", header=None, names=COLUMNS, dtype=str,
                                           na_filter=False, quoting=3, engine="c")
            for p in paths}
  vocab = {}
  for name in CATEGORICAL_FEATURES:
    counts = pd.concat([f[name] for f in frames.values()]).value_counts()
    counts = counts[counts.index != ""]
    table = pd.DataFrame({"id": counts.index.str.lower(), "count": counts.to_numpy()})
    table = table.groupby("id", sort=True)["count"].sum().reset_index()
    vocab[name] = pd.Index(table.sort_values("count", ascending=False, kind="stable")["id"])
  rows = 0
  for day, frame in frames.items():
    ints = frame[INTEGER_FEATURES].apply(pd.to_numeric, errors="coerce").fillna(0).to_numpy()
    batch = {"label": frame["label"].astype(np.int64).to_numpy(),
             "int_features": np.log1p(np.maximum(ints, 0)).astype(np.float32),
             "cat_features": np.stack([vocab[n].get_indexer(frame[n].str.lower()) + 1
                                       for n in CATEGORICAL_FEATURES], axis=1)}
    os.makedirs(os.path.join(output, f"day_{day}"), exist_ok=True)
    rows += criteo_tfrecord.write_tfrecord(os.path.join(output, f"day_{day}", "part.tfrecord"),
                                           criteo_tfrecord.encode_examples(batch))
  return rows


def _first_rows(path, n):
  return [bytes(r.numpy()) for r in tf.data.TFRecordDataset(path).take(n)]


def _peak_mib(who):
  return resource.getrusage(who).ru_maxrss / 1024


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  criteo_input.add_arguments(parser)
  args = parser.parse_args(argv)
  work = tempfile.mkdtemp(prefix="beam_criteo_")
  _, paths, size = criteo_input.day_files(args, work)

  start = time.perf_counter()
  job = criteo.CriteoJob(inputs=tuple(paths), output=os.path.join(work, "beam"))
  summary = criteo.run(job, BEAM_ARGS)
  beam_seconds = time.perf_counter() - start
  beam_peak = {"driver": _peak_mib(resource.RUSAGE_SELF),
               "largest worker": _peak_mib(resource.RUSAGE_CHILDREN)}

  start = time.perf_counter()
  rows = pandas_yardstick(paths, os.path.join(work, "pandas"))
  pandas_seconds = time.perf_counter() - start
  pandas_peak = _peak_mib(resource.RUSAGE_SELF)
  assert rows == summary["rows_out"] == args.rows, (rows, summary["rows_out"])
  same = _first_rows(os.path.join(work, "pandas", "day_0", "part.tfrecord"), 1000) == \
      _first_rows(os.path.join(work, "beam", "day_0", "part-00000.tfrecord"), 1000)

  print(f"\n{args.rows:,} rows, {args.days} day files, {size:.0f} MiB of TSV; "
        f"same first 1000 records: {same}\n")
  print("| implementation | seconds | rows/s | throughput / pandas | peak RSS MiB |")
  print("|---|---:|---:|---:|---|")
  print(f"| pandas, 1 process (yardstick) | {pandas_seconds:.1f} | "
        f"{rows / pandas_seconds:,.0f} | 1.00 | {pandas_peak:,.0f} |")
  print(f"| Beam, DirectRunner 2 processes | {beam_seconds:.1f} | "
        f"{rows / beam_seconds:,.0f} | {pandas_seconds / beam_seconds:.2f} | "
        + ", ".join(f"{k} {v:,.0f}" for k, v in beam_peak.items()) + " |")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
