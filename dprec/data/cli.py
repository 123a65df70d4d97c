"""`dprec synth criteo|sequences`: write synthetic data sets in the real formats ."""
import argparse

from dprec.cli_help import OptionGroups
from dprec.cli_help import add_deprecated_alias
from dprec.data import synthetic


def register(subparsers):
  parser = subparsers.add_parser(
      "synth", help="generate synthetic Criteo TSV day files or user-item sequences",
      description="Generate synthetic data in the real formats; prints a JSON summary.")
  commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)

  criteo = commands.add_parser(
      "criteo", help="Criteo-like click logs: DIR/day_0 … DIR/day_{K-1} in Criteo TSV",
      description="Criteo TSV day files (label, I1-I13, C1-C26 hex ids; empty = missing) with "
      "Zipf-like bucket frequencies, heavy-tailed integers, day-to-day drift and a learnable "
      "click model. Same seed, same bytes.")
  groups = OptionGroups(criteo)
  data = groups.data
  data.add("--rows", type=_positive, required=True, help="rows in all days together")
  data.add("--days", type=_positive, default=1, help="number of day_N files")
  data.add("--vocab", default=synthetic.CriteoSynthConfig.vocab,
                      help="'table3' (the Criteo vocabularies of Ghazi et al. 2023, "
                      "arXiv:2311.08357, Table 3) or 'scaled:M' (Table 3 scaled to about M "
                      "buckets in all, e.g. scaled:10M)")
  data.add("--ctr", type=float, default=synthetic.CriteoSynthConfig.ctr,
                      help="mean click rate of day 0")
  data.add("--tail-decay", type=float, default=synthetic.CriteoSynthConfig.tail_decay,
                      metavar="ALPHA",
                      help="shrink each bucket's click weight by (1 + its day-0 popularity "
                      "rank)^-ALPHA (ids new in later days count as the rarest), so the click "
                      "signal sits in frequent buckets; for studying sparse DP training when the "
                      "tail carries little (benchmarks/utility_ctr.py). 0 (default) = off, same "
                      "bytes as without the flag")
  data.add("--users", type=int, default=synthetic.CriteoSynthConfig.users,
                      metavar="N",
                      help="add a trailing user_id column (1..N, Zipf activity P(u) ≈ "
                      f"u^-{synthetic.CriteoSynthConfig.user_zipf}, independent of clicks) for "
                      "`dprec stream --privacy-unit user` (read it with `dprec preprocess criteo "
                      "--streaming --user-column`); 0 (default) = the Criteo format, same bytes")
  _add_common(criteo, groups, "output directory", _criteo)

  sequences = commands.add_parser(
      "sequences", help="long-tailed user-item sequences as SASRec-style 'user item' lines",
      description="'user item' lines (1-based ids, each user's lines consecutive and in time "
      "order) with long-tailed popularity; --order says how users pick their items. Same seed, "
      "same bytes.")
  groups = OptionGroups(sequences)
  data = groups.data
  defaults = synthetic.SequenceSynthConfig
  data.add("--users", type=_positive, required=True, help="number of users")
  data.add("--items", type=_positive, required=True, help="number of items")
  data.add("--mean-length", type=float, default=defaults.mean_length,
           help="mean actions per user (at least 3)")
  data.add("--order", choices=synthetic.ORDERS, default=defaults.order,
           help="'chain' (default): users walk item chains inside a favourite cluster, so the "
           "last item predicts the next (item-to-item data); 'taste': each user's items are drawn "
           "without repetition from their taste (global popularity mixed with a few favourite "
           "clusters) in random order, so the whole history tells the taste and the last item "
           "little more (rating logs such as MovieLens)")
  data.add("--taste-clusters", type=_positive, default=defaults.taste_clusters,
           help="--order taste: favourite clusters per user")
  data.add("--taste-share", type=float, default=defaults.taste_share,
           help="--order taste: share of draws from the favourite clusters (the rest follow "
           "global popularity), in [0, 1)")
  _add_common(sequences, groups, "output file", _sequences)


def _add_common(parser, groups, out_help, handler):
  """The seed and the output of both generators, to `groups` (the parser's `OptionGroups`)."""
  groups.data.add("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
  run = groups.run.group
  output = run.add_mutually_exclusive_group(required=True)
  output.add_argument("--output", help=f"{out_help} (as `dprec preprocess --output`)")
  add_deprecated_alias(output.add_argument, "--out", "--output", "output")
  run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  parser.set_defaults(func=handler)


def _positive(text):
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def _criteo(args):
  return synthetic.generate_criteo(
      args.output, args.rows, args.days, args.seed, args.vocab,
      synthetic.CriteoSynthConfig(ctr=args.ctr, tail_decay=args.tail_decay, users=args.users),
      progress=not args.no_progress)


def _sequences(args):
  return synthetic.generate_sequences(
      args.output, args.users, args.items, args.seed,
      synthetic.SequenceSynthConfig(mean_length=args.mean_length, order=args.order,
                                    taste_clusters=args.taste_clusters,
                                    taste_share=args.taste_share),
      progress=not args.no_progress)
