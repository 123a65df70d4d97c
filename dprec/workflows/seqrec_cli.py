"""`dprec train seqrec`: the command line of `dprec.workflows.seqrec` (parse, then call). Parsing
needs only `seqrec_options` (no TensorFlow); `run` loads the workflow."""
import argparse
import dataclasses

from dprec.cli_help import OptionGroups
from dprec.workflows import data_kinds
from dprec.workflows import interrupted
from dprec.workflows import result
from dprec.workflows import run_summary
from dprec.workflows import run_cli
from dprec.workflows import seqrec_options


def _epsilon(text):
  try:
    return float(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"must be a number or 'inf', got {text!r}") from error


def _prior_weight(text):
  if text == "auto":
    return None
  try:
    return float(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"must be a number or 'auto', got {text!r}") from error


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
  data, privacy, model, training = groups.data, groups.privacy, groups.model, groups.training
  defaults = seqrec_options.SeqRecTrainOptions  # one source: the CLI's and the Python API's
  data.add("--data", required=True, help="directory written by `dprec preprocess sequences`")
  data.add("--max-len", type=int, default=defaults.max_len, help="maximum sequence length L")
  data.add("--no-hold-out-validation", action="store_false", dest="hold_out_validation",
           advanced=True,
           help="train on the validation item too (default: hold it out and report its metrics "
                "under 'validation' for model selection)")
  data.add("--exclude-history", action="store_true", advanced=True,
           help="do not rank items already in the history")
  data.add("--item-frequencies", metavar="FILE", advanced=True,
           help="public Re-Attention frequencies p_i, lines 'ITEM_ID P' (ids as in the input "
                "logs); default: a DP histogram of users per item, charged to the ledger")

  privacy.add("--epsilon", type=_epsilon, required=True,
              help="privacy budget ε, the total: what --ledger spent on this data before is "
                   "composed in; 'inf' trains non-privately")
  privacy.add("--delta", type=float, default=defaults.delta,
              help="δ (default: the --ledger's if it exists, else 1/N training users)")
  privacy.add("--l2-norm-clip", type=float, default=defaults.l2_norm_clip,
              help="per-user gradient clip norm C")
  privacy.add("--normalize", type=float, nargs="?", const=0.01,
              default=defaults.normalization_offset, dest="normalization_offset",
              metavar="GAMMA", advanced=True,
              help="normalise per-user gradients, C/(‖g‖+GAMMA) (automatic clipping, the "
                   "paper's setting; GAMMA defaults to 0.01) instead of clipping min(1, C/‖g‖)")
  privacy.add("--model-choice-share", type=float, default=defaults.model_choice_share,
              metavar="SHARE", advanced=True,
              help="--model auto: the share of item2item's pair release (of its Gaussian "
                   "budget μ²) released before the validation test; item2item's top-up or the "
                   "transformer takes the rest (default: %(default)s)")
  privacy.add("--item-norm-share", type=float, metavar="F", advanced=True,
              help="per-group clipping: the item table gets F of C² (clipped or normalised to "
                   "C·√F) and the rest of the model 1 − F, so the item rows get a set share of "
                   "each user's norm; the sensitivity stays C (default: one norm over all "
                   "weights)")
  privacy.add("--item-frequency-share", type=float, metavar="FRACTION", advanced=True,
              help="share of ε for the DP histogram of p_i (Re-Attention, "
                   "--item-vocab-threshold, --popularity-weights; item2item's popularity and "
                   "item set) (default 0.05 for dpformer, 0.3 for item2item; training's or the "
                   "pair release's σ is calibrated for the rest)")
  privacy.add("--item-histogram-items", type=int, metavar="K", advanced=True,
              help="the DP histogram counts each user's last K items only: sensitivity √K "
                   "instead of √L (default: --max-len for dpformer, 10 for item2item)")

  model.add("--model", choices=seqrec_options.MODELS, default=defaults.model,
            help="auto: releases item2item's histogram and --model-choice-share of its "
                 "pair release, then a "
                 "noisy validation test (item2item's NDCG@10 less most popular's, summed over "
                 "the validation users): item2item, topped up to nearly its own quality, when "
                 "it beats most popular, else dpformer with the rest, on the paper's MovieLens "
                 "schedule (100 epochs, warm-up and decay, --normalize, dropout 0.2, where those "
                 "options are left at their defaults); the run is one ledger charge, the union "
                 "over both branches; the summary's model_choice says which and why "
                 "(docs/guide/seqrec.md); item2item: each user's (item, later item) pairs, "
                 "scaled to norm 1, released once with Gaussian noise over the DP histogram's "
                 "top items and thresholded, scored from the user's recent items (best on Amazon "
                 "Games' validation items at eps 5, docs/experiments/seqrec_item2item.md); "
                 "dpformer: the transformer trained with DP-SGD (the model and training options); "
                 "hybrid: the transformer with its item rows initialised from the truncated SVD "
                 "of the released pairs (--pair-share of ε), then trained with DP-SGD on the "
                 "rest of ε, optionally with the pairs' score as a prior on its logits "
                 "(--prior-weight; below item2item on Amazon at the sizes measured); "
                 "dpformer-frozen: the transformer over a fixed item table, the released pairs' "
                 "truncated SVD (--pair-share of ε) with log DP counts as logit offsets, only its "
                 "blocks trained with DP-SGD on the rest of ε (--prior-weight as hybrid)")
  model.add("--dim", type=int, default=defaults.dim, help="model dimension d")
  model.add("--blocks", type=int, default=defaults.num_blocks, dest="num_blocks",
            help="transformer blocks")
  model.add("--heads", type=int, default=defaults.num_heads, dest="num_heads",
            help="attention heads")
  model.add("--dropout", type=float, default=defaults.dropout, help="dropout rate")
  model.add("--item-rank", type=int, metavar="R", advanced=True,
            help="low-rank item table: M×R rows meeting the model through R×d projections, so "
                 "the noise per item row shrinks from √d to √R (default: a full M×d table)")
  model.add("--item-vocab-threshold", type=float, metavar="T", advanced=True,
            help="DP-FEST item vocabulary: items whose user count (from the DP histogram of "
                 "--item-frequency-share, the same one release as Re-Attention's p_i, or from "
                 "--item-frequencies) is below T share one row; every item is still ranked (its "
                 "row's score plus its log share of the row's count) (default: a row per item)")
  model.add("--popularity-weights", action="store_true", advanced=True,
            help="item-row weights w_j ∝ n_j^(-1/2) from the same user counts (DP histogram or "
                 "--item-frequencies; floored at the DP count's noise std): row j is trained as "
                 "E[j] = w_j·Ẽ[j], so head rows cede share of each user's clipped norm to rarer "
                 "ones; the sensitivity stays C (default: off)")
  model.add("--no-reattention", action="store_true", advanced=True,
            help="vanilla attention (baseline)")
  model.add("--untied", action="store_true", advanced=True,
            help="separate output embedding (the 'W/O PS' baseline)")
  model.add("--loss-positions", choices=("all", "last"), default=defaults.loss_positions,
            advanced=True, help="next-item loss at every position or at the last one only")
  model.add("--score-padding", action="store_true", advanced=True,
            help="score the padding positions too (fixed shapes; same loss, slower)")
  model.add("--variance-scale", type=float, default=defaults.variance_scale, advanced=True,
            help="multiplier of Re-Attention's effective-error variances σ_eff²")

  training.add("--epochs", type=float, default=defaults.epochs,
               help="epochs (expected passes over the users)")
  training.add("--batch-size", type=int, default=defaults.batch_size,
               help="expected batch size B (q = B/N); default: min(1024, N/8) for the N "
                    "training users")
  training.add("--learning-rate", type=float, default=defaults.learning_rate,
               help="peak Adam learning rate")
  training.add("--optimizer", choices=("adamw", "adambc"), default=defaults.optimizer,
               advanced=True,
               help="AdamW, or DP-AdamBC (Adam with the noise variance subtracted, Tang et al. "
                    "2024, arXiv:2411.04205; same schedule and weight decay)")
  training.add("--adambc-floor", type=float, default=defaults.adambc_floor, advanced=True,
               help="γ' of --optimizer adambc")
  training.add("--eval-batch-size", type=int, default=defaults.eval_batch_size, advanced=True,
               help="users scored per evaluation batch")
  _add_item2item_arguments(groups.item2item)
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


def _add_item2item_arguments(group):
  """The pair statistics and scoring of `--model item2item` (defaults: the dataclass's), to
  `group` (an `OptionGroup`): listed by --help-all."""
  defaults = seqrec_options.SeqRecTrainOptions()
  add = group.add_advanced
  add("--pair-window", type=int, default=defaults.pair_window, metavar="W",
      help="pairs (s_t, s_t+g) for gaps g <= W")
  add("--pair-decay", type=float, default=defaults.pair_decay,
      help="weight decay^(g-1) of a pair at gap g (before the user's scaling to norm 1)")
  add("--pair-max-items", type=int, default=defaults.pair_max_items, metavar="N",
      help="pairs from each user's last N items")
  add("--pair-item-set", type=int, default=defaults.pair_item_set, metavar="K",
      help="release pairs among the K items of largest DP count (the other items are ranked "
           "by popularity only)")
  add("--pair-threshold", type=float, default=defaults.pair_threshold, metavar="SIGMAS",
      help="release a pair where its noisy value reaches SIGMAS times the noise std")
  add("--pair-recent", type=int, default=defaults.pair_recent, metavar="R",
      help="score from the user's R most recent items")
  add("--pair-recent-decay", type=float, default=defaults.pair_recent_decay,
      help="weight decay^(k-1) of the k-th most recent item")
  add("--pair-popularity-exponent", type=float, default=defaults.pair_popularity_exponent,
      metavar="ALPHA", help="divide item j's pair score by its DP count^ALPHA")
  add("--pair-popularity-weight", type=float, default=defaults.pair_popularity_weight,
      metavar="LAMBDA", help="add LAMBDA times the item's DP count / the largest count")
  add("--pair-share", type=float, default=defaults.pair_share, metavar="SHARE",
      help="--model hybrid / dpformer-frozen: the pair release's share of ε, calibrated alone "
           "(default 0.3 / 0.88; the histogram gets --item-frequency-share, default 0.1 / 0.3, "
           "and training what their composition leaves)")
  add("--no-pair-init", action="store_false", dest="pair_init",
      help="--model hybrid: keep the random item rows (default: the rows of items a released "
           "pair touches from the pairs' truncated SVD)")
  add("--prior-weight", type=_prior_weight, default=defaults.prior_weight, metavar="W",
      help="--model hybrid / dpformer-frozen: add W times the released pairs' item-to-item "
           "score of the user's recent items (--pair-recent) to the transformer's logits "
           "(post-processing); 'auto': "
           f"the weight of {', '.join(f'{w:g}' for w in seqrec_options.PRIOR_WEIGHTS)} with the "
           "best "
           "validation NDCG@10, a choice not covered by ε (default: %(default)s)")
  add("--train-prior-weight", type=float, default=defaults.train_prior_weight, metavar="W",
      help="--model dpformer-frozen: train with W times that prior in the logits and the "
           "transformer's output initialised to 0, so its blocks learn the prior's residual "
           "(needs --loss-positions last; 0: none; default: %(default)s)")
  add("--select-epochs", action="store_true",
      help="evaluate the validation items before training and after every epoch and keep the "
           "best weights (a choice not covered by ε)")
  add("--public-users", type=float, default=defaults.public_users, metavar="FRACTION",
      help="treat this share of users, picked by a public hash of the user index and "
           "--public-users-salt (not by their data), as public, opted-in data: their exact "
           "counts and pairs are added to the released ones, charged nothing; ε covers, and the "
           "metrics evaluate, the other users only")
  add("--public-users-salt", type=int, default=defaults.public_users_salt, metavar="SALT",
      help="the public salt of the --public-users rule")


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
