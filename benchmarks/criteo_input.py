"""The Criteo-format day files the Beam benchmarks read: generated once (seed 0), reused with
--data."""
import os

from dprec.data.synthetic import generate_criteo


def add_arguments(parser):
  parser.add_argument("--rows", type=int, default=2_000_000)
  parser.add_argument("--days", type=int, default=2)
  parser.add_argument("--data", default=None, help="reuse/generate the input here")


def day_files(args, work):
  """(directory, day file paths, MiB of TSV) under --data, or under `work`/input; the days are
  generated where any is missing."""
  data = args.data or os.path.join(work, "input")
  paths = [os.path.join(data, f"day_{d}") for d in range(args.days)]
  if not all(os.path.exists(p) for p in paths):
    generate_criteo(data, rows=args.rows, days=args.days, seed=0)
  return data, paths, sum(os.path.getsize(p) for p in paths) / 2**20
