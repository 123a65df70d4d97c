"""`dprec train seqrec`: the command line of `dprec.workflows.seqrec` (parse, then call)."""
import argparse
import dataclasses

from dprec.workflows import dp_forward
from dprec.workflows import seqrec


def _epsilon(text):
  try:
    return float(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"must be a number or 'inf', got {text!r}") from error


def register(subparsers):
  """Adds `seqrec` to the `train` group."""
  parser = subparsers.add_parser(
      "seqrec", help="train DPFormer (sequential recommender) with or without DP",
      description="Train the DPFormer sequential recommender (Phantom Clipping, Re-Attention) on "
      "a `dprec preprocess sequences` output; prints a JSON summary with full-ranking NDCG@10 "
      "and HIT@10 overall and by item popularity (head/torso/tail).")
  add = parser.add_argument
  add("--data", required=True, help="directory written by `dprec preprocess sequences`")
  add("--epsilon", type=_epsilon, default=5.0, help="privacy budget ε; 'inf' trains non-privately")
  add("--delta", type=float, default=None, help="δ (default 1/N training users)")
  add("--epochs", type=float, default=100.0, help="epochs (expected passes over the users)")
  add("--batch-size", type=int, default=None,
      help="expected batch size B (q = B/N); default: min(1024, N/8) for the N training users")
  add("--learning-rate", type=float, default=5e-3, help="peak Adam learning rate")
  add("--optimizer", choices=("adamw", "adambc"), default="adamw",
      help="AdamW, or DP-AdamBC (seed 002: Adam with the noise variance subtracted; same "
           "schedule and weight decay)")
  add("--adambc-floor", type=float, default=seqrec.ADAMBC_FLOOR, help="γ' of --optimizer adambc")
  add("--l2-norm-clip", type=float, default=1.0, help="per-user gradient clip norm C")
  add("--normalize", type=float, nargs="?", const=0.01, default=None,
      dest="normalization_offset", metavar="GAMMA",
      help="normalise per-user gradients, C/(‖g‖+GAMMA) (automatic clipping, the paper's "
           "setting; GAMMA defaults to 0.01) instead of clipping min(1, C/‖g‖)")
  add("--max-len", type=int, default=50, help="maximum sequence length L")
  add("--dim", type=int, default=64, help="model dimension d")
  add("--item-rank", type=int, metavar="R",
      help="low-rank item table: M×R rows meeting the model through R×d projections, so the "
           "noise per item row shrinks from √d to √R (default: a full M×d table)")
  add("--blocks", type=int, default=2, dest="num_blocks", help="transformer blocks")
  add("--heads", type=int, default=1, dest="num_heads", help="attention heads")
  add("--dropout", type=float, default=0.5, help="dropout rate")
  add("--no-reattention", action="store_true", help="vanilla attention (baseline)")
  add("--untied", action="store_true", help="separate output embedding (the 'W/O PS' baseline)")
  add("--loss-positions", choices=("all", "last"), default="all",
      help="next-item loss at every position or at the last one only")
  add("--score-padding", action="store_true",
      help="score the padding positions too (fixed shapes; same loss, slower)")
  add("--variance-scale", type=float, default=1.0,
      help="multiplier of Re-Attention's effective-error variances σ_eff²")
  add("--item-frequencies", metavar="FILE",
      help="public Re-Attention frequencies p_i, lines 'ITEM_ID P' (ids as in the input logs); "
           "default: a DP histogram of users per item, charged to the ledger")
  add("--item-frequency-share", type=float, default=0.05, metavar="FRACTION",
      help="share of ε for the DP histogram of p_i (default 0.05; training's σ is calibrated "
           "for the rest)")
  add("--fixed-batches", action="store_true",
      help="fixed-size shuffled batches instead of Poisson sampling (ledger flags it)")
  add("--accountant", choices=("pld", "rdp"), default="pld", help="privacy accountant")
  add("--ledger", help="privacy ledger JSON file (default: DIR/ledger.json with --run-dir, "
      "else a temporary one)")
  add("--run-dir", metavar="DIR",
      help="checkpoint here and keep the ledger here; rerunning the same command resumes a "
           "killed run from its last checkpoint (same batches and noise, no step paid twice)")
  add("--checkpoint-every", type=int, default=100, metavar="N",
      help="steps between checkpoints with --run-dir (one is always written at the end)")
  add("--keep-checkpoints", type=int, default=2, metavar="K",
      help="keep the newest K checkpoints (0: all, e.g. for a learning curve with "
           "benchmarks/dpformer_amazon.py --curve)")
  add("--exclude-history", action="store_true", help="do not rank items already in the history")
  add("--eval-batch-size", type=int, default=256, help="users scored per evaluation batch")
  add("--seed", type=int, default=0,
      help="seed of initialisation and dropout only (public); noise and batches come from a "
           "secret key")
  add("--insecure-noise-seed", type=int, metavar="N",
      help="derive noise, batches and the histogram's noise from N: reproducible, NOT private "
           "(the summary and ledger say so)")
  add("--diagnostics", action="store_true",
      help="also report non-private diagnostics (the exact training loss), labelled so")
  _add_dp_forward_arguments(parser)
  add("--no-progress", action="store_true", help="no progress bars")
  add("--summary-json", help="also write the JSON summary to this file")
  parser.set_defaults(func=run)


def run(args):
  options = seqrec.SeqRecTrainOptions(
      data=args.data, epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
      batch_size=args.batch_size, learning_rate=args.learning_rate, optimizer=args.optimizer,
      adambc_floor=args.adambc_floor,
      l2_norm_clip=args.l2_norm_clip, normalization_offset=args.normalization_offset,
      max_len=args.max_len, dim=args.dim, item_rank=args.item_rank,
      num_blocks=args.num_blocks, num_heads=args.num_heads, dropout=args.dropout,
      reattention=not args.no_reattention, tied=not args.untied,
      loss_positions=args.loss_positions, score_padding=args.score_padding,
      variance_scale=args.variance_scale, item_frequencies=args.item_frequencies,
      item_frequency_share=args.item_frequency_share,
      fixed_batches=args.fixed_batches, accountant=args.accountant, ledger=args.ledger,
      run_dir=args.run_dir, checkpoint_every=args.checkpoint_every,
      keep_checkpoints=args.keep_checkpoints,
      exclude_history=args.exclude_history, eval_batch_size=args.eval_batch_size,
      seed=args.seed, insecure_noise_seed=args.insecure_noise_seed,
      diagnostics=args.diagnostics, progress=not args.no_progress,
      summary_json=args.summary_json)
  if args.dp_forward:
    options = dataclasses.replace(options, dp_forward=_dp_forward_options(args),
                                  loss_positions="last", reattention=False)
  return seqrec.run(options)


def _add_dp_forward_arguments(parser):
  """`--dp-forward` and its settings, for `dprec train seqrec`."""
  group = parser.add_argument_group(
      "DP-Forward (seed 003)", "noise on each user's representation instead of on gradients: "
      "SeqLDP per user (local DP of the sequence; the next-item label is sent in the clear "
      "unless --label-epsilon), not central DP; the service trains with non-private steps. "
      "Implies --loss-positions last and no Re-Attention; --epochs must be whole")
  add = group.add_argument
  add("--dp-forward", action="store_true", help="train with DP-Forward instead of DP-SGD")
  add("--forward-position", choices=("output", "attention"), default="output",
      help="noise the user representation (output) or the first attention output, residual "
           "removed (attention) (default: output)")
  add("--forward-norm-bound", type=float, default=1.0, metavar="C",
      help="Frobenius norm C of the representation; sensitivity 2C (default: 1)")
  add("--forward-clip", action="store_true",
      help="clip the representation to norm <= C instead of normalising it to C")
  add("--forward-reduced-dim", type=int, metavar="D",
      help="trainable projection to D dimensions before the noise (default: none)")
  add("--forward-encoder-updates", choices=("none", "trusted"), default="none",
      help="none: the user's side gets no gradients (covered by SeqLDP); trusted: the paper's "
           "experiments, encoder gradients from raw sequences (needs a trusted party) "
           "(default: none)")
  add("--no-inference-noise", action="store_true",
      help="evaluate on clean representations (default: noised, each query (eps, delta)-LDP)")
  add("--label-epsilon", type=float, default=0.0, metavar="E2",
      help="randomized response with a prior on the label at epsilon2, deducted from --epsilon "
           "(full LDP, epsilon1 + epsilon2; default 0: label in the clear)")


def _dp_forward_options(args):
  return dp_forward.DPForwardOptions(
      position=args.forward_position, norm_bound=args.forward_norm_bound,
      bound="clip" if args.forward_clip else "normalize",
      at_inference=not args.no_inference_noise, reduced_dim=args.forward_reduced_dim,
      encoder_updates=args.forward_encoder_updates, label_epsilon=args.label_epsilon)
