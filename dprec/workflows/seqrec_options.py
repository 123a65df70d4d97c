"""The options of `train seqrec` (`SeqRecTrainOptions`, with DP-Forward's `DPForwardOptions`) and
the names its command line offers, without TensorFlow: `dprec train seqrec` parses its arguments
(and refuses bad ones) before it loads `dprec.workflows.seqrec`, which trains with them."""
import argparse
import dataclasses
import math
from typing import Optional

from dprec.cli_help import option
from dprec.errors import DprecError
from dprec.optimizers.defaults import ADAMBC_FLOOR
from dprec.workflows import model_choice
from dprec.workflows import run as run_lib

FROZEN = "dpformer-frozen"
MODELS = (model_choice.AUTO, "item2item", "dpformer", "hybrid", FROZEN)
PAIR_MODELS = ("hybrid", FROZEN)  # the transformers built on the pair release
PRIOR_WEIGHTS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)
# `train seqrec`'s options from `SeqRecTrainOptions`' fields, in the order its help lists them:
# those before its two negated model flags (`seqrec_cli`), then those after.
OPTIONS_BEFORE_FLAGS = (
    "data", "max_len", "hold_out_validation", "exclude_history", "item_frequencies", "epsilon",
    "delta", "l2_norm_clip", "normalization_offset", "model_choice_share", "item_norm_share",
    "item_frequency_share", "item_histogram_items", "model", "dim", "num_blocks", "num_heads",
    "dropout", "item_rank", "item_vocab_threshold", "popularity_weights")
OPTIONS_AFTER_FLAGS = (
    "loss_positions", "score_padding", "variance_scale", "epochs", "batch_size", "learning_rate",
    "optimizer", "adambc_floor", "eval_batch_size", "pair_window", "pair_decay", "pair_max_items",
    "pair_item_set", "pair_threshold", "pair_recent", "pair_recent_decay",
    "pair_popularity_exponent", "pair_popularity_weight", "pair_share", "pair_init",
    "prior_weight", "train_prior_weight", "select_epochs", "public_users", "public_users_salt")


def _epsilon(text):
  """argparse type of `--epsilon`: a number or 'inf'."""
  try:
    return float(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"must be a number or 'inf', got {text!r}") from error


def _prior_weight(text):
  """argparse type of `--prior-weight`: a number, or 'auto' (None)."""
  if text == "auto":
    return None
  try:
    return float(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"must be a number or 'auto', got {text!r}") from error


@dataclasses.dataclass(frozen=True)
class DPForwardOptions:
  """The user-facing DP-Forward settings (`dprec train seqrec --dp-forward ...`)."""
  position: str = "output"
  norm_bound: float = 1.0
  bound: str = "normalize"
  at_inference: bool = True
  reduced_dim: Optional[int] = None
  encoder_updates: str = "none"
  label_epsilon: float = 0.0

  def model_config(self, noise_multiplier):
    from dprec.layers.forward_noise import DPForwardConfig
    return DPForwardConfig(noise_multiplier, self.norm_bound, self.position, self.bound,
                           self.at_inference, self.reduced_dim, self.encoder_updates)


_MODEL_HELP = (
    "auto: releases item2item's histogram and --model-choice-share of its pair release, then "
    "a noisy validation test (item2item's NDCG@10 less most popular's, summed over the "
    "validation users): item2item, topped up to nearly its own quality, when it beats most "
    "popular, else dpformer with the rest, on the paper's MovieLens schedule (100 epochs, "
    "warm-up and decay, --normalize, dropout 0.2, where those options are left at their "
    "defaults); the run is one ledger charge, the union over both branches; the summary's "
    "model_choice says which and why (docs/guide/seqrec.md); item2item: each user's (item, "
    "later item) pairs, scaled to norm 1, released once with Gaussian noise over the DP "
    "histogram's top items and thresholded, scored from the user's recent items (best on "
    "Amazon Games' validation items at eps 5, docs/experiments/seqrec_item2item.md); "
    "dpformer: the transformer trained with DP-SGD (the model and training options); hybrid: "
    "the transformer with its item rows initialised from the truncated SVD of the released "
    "pairs (--pair-share of ε), then trained with DP-SGD on the rest of ε, optionally with the "
    "pairs' score as a prior on its logits (--prior-weight; below item2item on Amazon at the "
    "sizes measured); dpformer-frozen: the transformer over a fixed item table, the released "
    "pairs' truncated SVD (--pair-share of ε) with log DP counts as logit offsets, only its "
    "blocks trained with DP-SGD on the rest of ε (--prior-weight as hybrid)")


@dataclasses.dataclass
class SeqRecTrainOptions(run_lib.FitOptions):
  """Everything one `train seqrec` run needs (defaults: the Amazon setting of Ding et al.,
  "DPFormer: Learning Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633,
  §5–7)."""
  # A resumed run may also evaluate differently.
  NOT_FINGERPRINTED = run_lib.FitOptions.NOT_FINGERPRINTED + (
      "exclude_history", "eval_batch_size", "reattention_at_eval")
  data: Optional[str] = option(
      None, group="data", required=True,
      help="directory written by `dprec preprocess sequences`")
  # as `dprec train seqrec`'s: "auto" chooses item2item or dpformer (`model_choice`)
  model: str = option(model_choice.AUTO, group="model", choices=MODELS, help=_MODEL_HELP)
  model_choice_share: float = option(  # --model auto: stage 1's share of item2item's pairs
      0.25, group="privacy", metavar="SHARE", advanced=True,
      help="--model auto: the share of item2item's pair release (of its Gaussian budget μ²) "
           "released before the validation test; item2item's top-up or the transformer takes "
           "the rest (default: %(default)s)")

  auto_model: bool = False  # set by `model_choice.resolve`: the run was paid as a whole
  epsilon: float = option(
      5.0, group="privacy", type=_epsilon, required=True, parsed_default=None,
      help="privacy budget ε, the total: what --ledger spent on this data before is composed "
           "in; 'inf' trains non-privately")
  delta: Optional[float] = option(
      None, group="privacy",
      help="δ (default: the --ledger's if it exists, else 1/N training users)")
  epochs: float = option(100.0, group="training", help="epochs (expected passes over the users)")
  batch_size: Optional[int] = option(  # None: chosen from N (poisson.default_batch_size)
      None, group="training",
      help="expected batch size B (q = B/N); default: min(1024, N/8) for the N training "
           "users")
  learning_rate: float = option(5e-3, group="training", help="peak Adam learning rate")
  optimizer: str = option(
      "adamw", group="training", choices=("adamw", "adambc"), advanced=True,
      help="AdamW, or DP-AdamBC (Adam with the noise variance subtracted, Tang et al. 2024, "
           "arXiv:2411.04205; same schedule and weight decay)")
  adambc_floor: float = option(
      ADAMBC_FLOOR, group="training", advanced=True,
      help="γ' of --optimizer adambc")
  weight_decay: float = 1e-5
  l2_norm_clip: float = option(1.0, group="privacy", help="per-user gradient clip norm C")
  normalization_offset: Optional[float] = option(
      None, group="privacy", flag="--normalize", nargs="?", const=0.01, metavar="GAMMA",
      advanced=True,
      help="normalise per-user gradients, C/(‖g‖+GAMMA) (automatic clipping, the paper's "
           "setting; GAMMA defaults to 0.01) instead of clipping min(1, C/‖g‖)")
  max_len: int = option(50, group="data", help="maximum sequence length L")
  dim: int = option(64, group="model", help="model dimension d")
  item_rank: Optional[int] = option(
      None, group="model", metavar="R", advanced=True,
      help="low-rank item table: M×R rows meeting the model through R×d projections, so the "
           "noise per item row shrinks from √d to √R (default: a full M×d table)")
  item_norm_share: Optional[float] = option(
      None, group="privacy", metavar="F", advanced=True,
      help="per-group clipping: the item table gets F of C² (clipped or normalised to C·√F) "
           "and the rest of the model 1 − F, so the item rows get a set share of each user's "
           "norm; the sensitivity stays C (default: one norm over all weights)")
  item_vocab_threshold: Optional[float] = option(
      None, group="model", metavar="T", advanced=True,
      help="DP-FEST item vocabulary: items whose user count (from the DP histogram of "
           "--item-frequency-share, the same one release as Re-Attention's p_i, or from "
           "--item-frequencies) is below T share one row; every item is still ranked (its "
           "row's score plus its log share of the row's count) (default: a row per item)")
  popularity_weights: bool = option(
      False, group="model", action="store_true", advanced=True,
      help="item-row weights w_j ∝ n_j^(-1/2) from the same user counts (DP histogram or "
           "--item-frequencies; floored at the DP count's noise std): row j is trained as E[j] "
           "= w_j·Ẽ[j], so head rows cede share of each user's clipped norm to rarer ones; the "
           "sensitivity stays C (default: off)")
  hold_out_validation: bool = option(
      True, group="data", flag="--no-hold-out-validation", action="store_false", advanced=True,
      help="train on the validation item too (default: hold it out and report its metrics "
           "under 'validation' for model selection)")
  num_blocks: int = option(2, group="model", flag="--blocks", help="transformer blocks")
  num_heads: int = option(1, group="model", flag="--heads", help="attention heads")
  dropout: float = option(0.5, group="model", help="dropout rate")
  reattention: bool = True
  tied: bool = True
  loss_positions: str = option(
      "all", group="model", choices=("all", "last"), advanced=True,
      help="next-item loss at every position or at the last one only")
  score_padding: bool = option(
      False, group="model", action="store_true", advanced=True,
      help="score the padding positions too (fixed shapes; same loss, slower)")
  reattention_scale_by_dim: bool = True
  reattention_at_eval: bool = True
  variance_scale: float = option(
      1.0, group="model", advanced=True,
      help="multiplier of Re-Attention's effective-error variances σ_eff²")
  item_frequencies: Optional[str] = option(  # public p_i file; None: DP histogram
      None, group="data", metavar="FILE", advanced=True,
      help="public Re-Attention frequencies p_i, lines 'ITEM_ID P' (ids as in the input logs); "
           "default: a DP histogram of users per item, charged to the ledger")
  item_frequency_share: Optional[float] = option(  # None: 0.05 (dpformer), 0.3 (item2item)
      None, group="privacy", metavar="FRACTION", advanced=True,
      help="share of ε for the DP histogram of p_i (Re-Attention, --item-vocab-threshold, "
           "--popularity-weights; item2item's popularity and item set) (default 0.05 for "
           "dpformer, 0.3 for item2item; training's or the pair release's σ is calibrated for "
           "the rest)")
  item_histogram_items: Optional[int] = option(  # None: max_len (dpformer), 10 (item2item)
      None, group="privacy", metavar="K", advanced=True,
      help="the DP histogram counts each user's last K items only: sensitivity √K instead of "
           "√L (default: --max-len for dpformer, 10 for item2item)")
  exclude_history: bool = option(
      False, group="data", action="store_true", advanced=True,
      help="do not rank items already in the history")
  eval_batch_size: int = option(
      256, group="training", advanced=True,
      help="users scored per evaluation batch")
  dp_forward: Optional[DPForwardOptions] = None
  # --model item2item (dprec.workflows.item2item)
  pair_window: int = option(
      2, group="item2item", metavar="W", advanced=True,
      help="pairs (s_t, s_t+g) for gaps g <= W")
  pair_decay: float = option(
      0.5, group="item2item", advanced=True,
      help="weight decay^(g-1) of a pair at gap g (before the user's scaling to norm 1)")
  pair_max_items: Optional[int] = option(
      20, group="item2item", metavar="N", advanced=True,
      help="pairs from each user's last N items")
  pair_item_set: Optional[int] = option(
      1000, group="item2item", metavar="K", advanced=True,
      help="release pairs among the K items of largest DP count (the other items are ranked "
           "by popularity only)")
  pair_threshold: float = option(
      3.0, group="item2item", metavar="SIGMAS", advanced=True,
      help="release a pair where its noisy value reaches SIGMAS times the noise std")
  pair_recent: int = option(
      3, group="item2item", metavar="R", advanced=True,
      help="score from the user's R most recent items")
  pair_recent_decay: float = option(
      0.5, group="item2item", advanced=True,
      help="weight decay^(k-1) of the k-th most recent item")
  pair_popularity_exponent: float = option(
      0.0, group="item2item", metavar="ALPHA", advanced=True,
      help="divide item j's pair score by its DP count^ALPHA")
  pair_popularity_weight: float = option(
      1e-3, group="item2item", metavar="LAMBDA", advanced=True,
      help="add LAMBDA times the item's DP count / the largest count")
  # --model hybrid / dpformer-frozen: the pair release's ε share (None: 0.3 / 0.88)
  pair_share: Optional[float] = option(
      None, group="item2item", metavar="SHARE", advanced=True,
      help="--model hybrid / dpformer-frozen: the pair release's share of ε, calibrated alone "
           "(default 0.3 / 0.88; the histogram gets --item-frequency-share, default 0.1 / 0.3, "
           "and training what their composition leaves)")
  pair_init: bool = option(  # --model hybrid: item rows from the released pairs' SVD
      True, group="item2item", flag="--no-pair-init", action="store_false", advanced=True,
      help="--model hybrid: keep the random item rows (default: the rows of items a released "
           "pair touches from the pairs' truncated SVD)")
  # --model hybrid / dpformer-frozen: w of the item2item prior on the logits
  # (dprec.models.logit_prior); None: the weight of PRIOR_WEIGHTS best on the validation items
  # (not covered by ε)
  prior_weight: Optional[float] = option(
      0.0, group="item2item", type=_prior_weight, metavar="W", advanced=True,
      help="--model hybrid / dpformer-frozen: add W times the released pairs' item-to-item "
           "score of the user's recent items (--pair-recent) to the transformer's logits "
           "(post-processing); 'auto': the weight of "
           f"{', '.join(f'{w:g}' for w in PRIOR_WEIGHTS)} with the best validation NDCG@10, a "
           "choice not covered by ε (default: %(default)s)")

  # --model dpformer-frozen: w of the same prior in the training logits (0: none)
  train_prior_weight: float = option(
      0.0, group="item2item", metavar="W", advanced=True,
      help="--model dpformer-frozen: train with W times that prior in the logits and the "
           "transformer's output initialised to 0, so its blocks learn the prior's residual "
           "(needs --loss-positions last; 0: none; default: %(default)s)")

  # keep the weights (before training or after an epoch) best on the validation items
  select_epochs: bool = option(
      False, group="item2item", action="store_true", advanced=True,
      help="evaluate the validation items before training and after every epoch and keep the "
           "best weights (a choice not covered by ε)")
  # Opt-in public users (dprec.data.public_users): their share and the rule's public salt.
  public_users: float = option(
      0.0, group="item2item", metavar="FRACTION", advanced=True,
      help="treat this share of users, picked by a public hash of the user index and "
           "--public-users-salt (not by their data), as public, opted-in data: their exact "
           "counts and pairs are added to the released ones, charged nothing; ε covers, and the "
           "metrics evaluate, the other users only")
  public_users_salt: int = option(
      0, group="item2item", metavar="SALT", advanced=True,
      help="the public salt of the --public-users rule")

  def __post_init__(self):
    if isinstance(self.dp_forward, dict):  # from a checkpoint's fingerprint
      self.dp_forward = DPForwardOptions(**self.dp_forward)

  @property
  def private(self):
    return math.isfinite(self.epsilon)

  def validate(self):
    super().validate()
    checks = [
        (self.model in MODELS, f"--model must be one of {', '.join(MODELS)}, got {self.model}"),
        (0 < self.model_choice_share < 1,
         f"--model-choice-share must be in (0, 1), got {self.model_choice_share}"),
        (self.model != model_choice.AUTO or (self.pair_item_set is not None
                                             and self.pair_item_set <= model_choice.MAX_ITEM_SET),
         f"--model auto releases the pairs densely over the item set: give --pair-item-set "
         f"at most {model_choice.MAX_ITEM_SET}, got {self.pair_item_set}"),
        (self.model != model_choice.AUTO or self.dp_forward is None,
         "--model auto does not combine with --dp-forward (which trains the transformer)"),
        (self.model != "item2item" or self.dp_forward is None,
         "--model item2item does not combine with --dp-forward"),
        (0 <= self.public_users < 1, f"--public-users must be in [0, 1), got "
                                     f"{self.public_users}"),
        (self.model not in PAIR_MODELS or (self.dp_forward is None and self.item_rank is None
                                           and self.item_vocab_threshold is None and self.tied
                                           and not self.popularity_weights),
         f"--model {self.model} sets a tied item table with a row per item: it does not combine "
         "with --dp-forward, --item-rank, --item-vocab-threshold, --popularity-weights or "
         "--untied"),
        (self.model != FROZEN or (self.item_norm_share is None and self.pair_init),
         "--model dpformer-frozen trains no item rows: --item-norm-share and --no-pair-init "
         "do not apply"),
        (self.pair_share is None or 0 < self.pair_share < 1,
         f"--pair-share must be in (0, 1), got {self.pair_share}"),
        (self.prior_weight is None or self.prior_weight >= 0,
         f"--prior-weight must be >= 0 or auto, got {self.prior_weight}"),
        (self.model in PAIR_MODELS or (self.pair_init and self.prior_weight == 0),
         "--no-pair-init and --prior-weight are --model hybrid's (--prior-weight also "
         "dpformer-frozen's)"),
        (self.train_prior_weight == 0 or (
            self.train_prior_weight > 0 and self.model == FROZEN
            and self.loss_positions == "last" and self.pair_item_set is not None),
         "--train-prior-weight is --model dpformer-frozen's, > 0, with --loss-positions last "
         "and a --pair-item-set"),
        (not self.select_epochs or self.hold_out_validation,
         "--select-epochs selects on the validation items: it needs them held out"),
        (self.prior_weight is not None or self.hold_out_validation,
         "--prior-weight auto selects the weight on the validation items: it needs them held "
         "out"),
        (self.public_users == 0 or self.model == "item2item",
         "--public-users is built for --model item2item only"),
        (self.pair_window >= 1 and 0 < self.pair_decay <= 1
         and (self.pair_max_items is None or self.pair_max_items >= 2)
         and (self.pair_item_set is None or self.pair_item_set >= 2),
         f"--pair-window must be >= 1, --pair-decay in (0, 1], --pair-max-items and "
         f"--pair-item-set >= 2, got {self.pair_window}, {self.pair_decay}, "
         f"{self.pair_max_items}, {self.pair_item_set}"),
        (self.epsilon > 0, f"--epsilon must be positive (or inf), got {self.epsilon}"),
        (self.epochs > 0 and (self.batch_size is None or self.batch_size >= 1),
         f"--epochs and --batch-size must be positive, got {self.epochs}, {self.batch_size}"),
        (self.dim % self.num_heads == 0,
         f"--dim {self.dim} must be divisible by --heads {self.num_heads}"),
        (self.item_rank is None or 1 <= self.item_rank <= self.dim,
         f"--item-rank must be in [1, --dim {self.dim}], got {self.item_rank}"),
        (self.item_rank is None or self.dp_forward is None,
         "--item-rank does not combine with --dp-forward"),
        (self.item_norm_share is None or 0 < self.item_norm_share < 1,
         f"--item-norm-share must be in (0, 1), got {self.item_norm_share}"),
        (self.item_vocab_threshold is None or self.item_vocab_threshold > 0,
         f"--item-vocab-threshold must be positive, got {self.item_vocab_threshold}"),
        (self.dp_forward is None or (self.item_norm_share is None
                                     and self.item_vocab_threshold is None
                                     and not self.popularity_weights),
         "--item-norm-share, --item-vocab-threshold and --popularity-weights do not combine "
         "with --dp-forward"),
        (self.item_histogram_items is None
         or 1 <= self.item_histogram_items <= self.max_len,
         f"--item-histogram-items must be in [1, --max-len {self.max_len}], got "
         f"{self.item_histogram_items}"),
        (self.item_frequency_share is None or 0 < self.item_frequency_share < 1,
         f"--item-frequency-share must be in (0, 1), got {self.item_frequency_share}"),
        (self.optimizer in ("adamw", "adambc") and self.adambc_floor > 0,
         f"--optimizer must be adamw or adambc and --adambc-floor positive, got "
         f"{self.optimizer}, {self.adambc_floor}"),
        (self.dp_forward is None or (self.private and self.loss_positions == "last"),
         "--dp-forward needs a finite --epsilon and --loss-positions last")]
    for holds, message in checks:
      if not holds:
        raise DprecError(message)
    if self.model == model_choice.AUTO:  # refused before the choice's release, whatever it is
      for candidate in model_choice.candidates(self):
        candidate.validate()

  def model_config(self, num_items, table_rows=None):
    """`table_rows`: the rows of a DP-FEST vocabulary (None: one per item)."""
    from dprec.layers.reattention import ReAttentionConfig
    from dprec.models.logit_prior import TrainingPriorConfig
    from dprec.models.seqrec import SeqRecConfig
    return SeqRecConfig(
        num_items=num_items, max_len=self.max_len, dim=self.dim, num_blocks=self.num_blocks,
        num_heads=self.num_heads, ffn_dim=self.dim, dropout=self.dropout, tied=self.tied,
        item_rank=self.item_rank, item_norm_share=self.item_norm_share,
        item_table_rows=table_rows, popularity_weights=self.popularity_weights,
        frozen_items=self.model == FROZEN, loss_positions=self.loss_positions,
        training_prior=self.train_prior_weight and TrainingPriorConfig(
            self.train_prior_weight, self.pair_item_set, self.pair_recent,
            self.pair_recent_decay) or None,
        score_padding=self.score_padding,
        reattention=ReAttentionConfig(enabled=self.reattention and self.model != FROZEN,
                                      scale_by_dim=self.reattention_scale_by_dim,
                                      at_eval=self.reattention_at_eval))
