"""`dprec train seqrec`: the command line of `dprec.workflows.seqrec` (parse, then call). Parsing
needs only `seqrec_options` (no TensorFlow); `run` loads the workflow."""
import dataclasses

from dprec.cli_help import OptionGroups
from dprec.cli_help import add_fields
from dprec.workflows import data_kinds
from dprec.workflows import interrupted
from dprec.workflows import result
from dprec.workflows import run_summary
from dprec.workflows import run_cli
from dprec.workflows import seqrec_options


def register(subparsers):
  """Adds `seqrec` to the `train` group."""
  parser = subparsers.add_parser(
      "seqrec", help="train a sequential recommender (DP item-to-item or DPFormer) with or "
                     "without DP",
      description="Train a next-item recommender on a `dprec preprocess sequences` output: by "
      "default the model the data's shape calls for (--model auto), DP item-to-item statistics "
      "released once (--model item2item) or the DPFormer transformer (--model dpformer: Phantom "
      "Clipping, Re-Attention). Ends with one "
      "line (full-ranking NDCG@10 and HIT@10 in % beside a random ranking's, ε spent, δ); the "
      "JSON summary (also by item popularity, head/torso/tail) goes to --summary-json, else "
      "RUN_DIR/summary.json.")
  groups = OptionGroups(parser, extra=(
      ("item2item", "model: item2item (--model item2item; its pairs also serve hybrid and "
       "dpformer-frozen)", "the DP pair statistics (sensitivity 1 per user) and how they score "
       "the next item"),
      ("dp_forward", "privacy: DP-Forward (Du et al. 2023, arXiv:2309.06746)",
       "noise on each user's representation instead of on gradients: SeqLDP per user (local DP "
       "of the sequence; the next-item label is sent in the clear unless --label-epsilon), not "
       "central DP; the service trains with non-private steps. Implies --model dpformer, "
       "--loss-positions last and no Re-Attention; --epochs must be whole")))
  defaults = seqrec_options.SeqRecTrainOptions  # one source: the CLI's and the Python API's
  # Its fields' options (`cli_help.option`) in the order the help lists them (the fields' order
  # is the Python API's), with the two negated model flags `run` reads among them.
  add_fields(groups, defaults, names=seqrec_options.OPTIONS_BEFORE_FLAGS)
  groups.model.add("--no-reattention", action="store_true", advanced=True,
                   help="vanilla attention (baseline)")
  groups.model.add("--untied", action="store_true", advanced=True,
                   help="separate output embedding (the 'W/O PS' baseline)")
  add_fields(groups, defaults, names=seqrec_options.OPTIONS_AFTER_FLAGS)
  run_cli.add_run_arguments(
      groups, defaults, randomness="noise, batches and the histogram's noise",
      diagnostics="the exact training loss",
      run_dir_help="checkpoint here and keep the ledger and the secret noise key (DIR/secret: "
                   "keep it private) here; rerunning the same command resumes a killed run from "
                   "its last checkpoint (same batches and noise, no step paid twice); "
                   "`benchmarks/dpformer_amazon.py --curve` evaluates kept checkpoints")
  run_cli.add_fit_arguments(groups, defaults)
  _add_dp_forward_arguments(groups.dp_forward)
  parser.set_defaults(func=run, interrupted=interrupted.message)


# Arguments `run` reads itself (the negated flags, DP-Forward's settings): not fields of
# `SeqRecTrainOptions`.
READ = ("no_reattention", "untied", "forward_position", "forward_norm_bound", "forward_clip",
        "no_inference_noise", "forward_reduced_dim", "forward_encoder_updates", "label_epsilon")


def run(args):
  data_kinds.refuse_other_commands_data(args.data, "train seqrec")
  options = run_cli.options_from_args(seqrec_options.SeqRecTrainOptions, args, read=READ,
                                      reattention=not args.no_reattention, tied=not args.untied,
                                      dp_forward=None)
  if args.dp_forward:
    options = dataclasses.replace(options, dp_forward=_dp_forward_options(args),
                                  loss_positions="last", reattention=False, model="dpformer")
  from dprec.workflows import seqrec
  summary = seqrec.run(options)
  return run_summary.report(summary, options, result.train_seqrec(summary))


def _add_dp_forward_arguments(group):
  """`--dp-forward` and its settings, for `dprec train seqrec`, to `group` (an `OptionGroup`):
  listed by --help-all."""
  defaults = seqrec_options.DPForwardOptions  # the defaults of the Python API
  add = group.add_advanced
  add("--dp-forward", action="store_true", help="train with DP-Forward instead of DP-SGD")
  add("--forward-position", choices=("output", "attention"), default=defaults.position,
      help="noise the user representation (output) or the first attention output, residual "
           "removed (attention)")
  add("--forward-norm-bound", type=float, default=defaults.norm_bound, metavar="C",
      help="Frobenius norm C of the representation; sensitivity 2C")
  add("--forward-clip", action="store_true",
      help="clip the representation to norm <= C instead of normalising it to C")
  add("--forward-reduced-dim", type=int, metavar="D",
      help="trainable projection to D dimensions before the noise (default: none)")
  add("--forward-encoder-updates", choices=("none", "trusted"), default=defaults.encoder_updates,
      help="none: the user's side gets no gradients (covered by SeqLDP); trusted: the paper's "
           "experiments, encoder gradients from raw sequences (needs a trusted party)")
  add("--no-inference-noise", action="store_true",
      help="evaluate on clean representations (default: noised, each query (eps, delta)-LDP)")
  add("--label-epsilon", type=float, default=defaults.label_epsilon, metavar="E2",
      help="randomized response with a prior on the label at epsilon2, deducted from --epsilon "
           "(full LDP, epsilon1 + epsilon2; default 0: label in the clear)")


def _dp_forward_options(args):
  return seqrec_options.DPForwardOptions(
      position=args.forward_position, norm_bound=args.forward_norm_bound,
      bound="clip" if args.forward_clip else "normalize",
      at_inference=not args.no_inference_noise, reduced_dim=args.forward_reduced_dim,
      encoder_updates=args.forward_encoder_updates, label_epsilon=args.label_epsilon)
