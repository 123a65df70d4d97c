"""The options of `train seqrec` (`SeqRecTrainOptions`, with DP-Forward's `DPForwardOptions`) and
the names its command line offers, without TensorFlow: `dprec train seqrec` parses its arguments
(and refuses bad ones) before it loads `dprec.workflows.seqrec`, which trains with them."""
import dataclasses
import math
from typing import Optional

from dprec.errors import DprecError
from dprec.optimizers.defaults import ADAMBC_FLOOR
from dprec.workflows import model_choice
from dprec.workflows import run as run_lib

FROZEN = "dpformer-frozen"
MODELS = (model_choice.AUTO, "item2item", "dpformer", "hybrid", FROZEN)
PAIR_MODELS = ("hybrid", FROZEN)  # the transformers built on the pair release
PRIOR_WEIGHTS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)


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


@dataclasses.dataclass
class SeqRecTrainOptions(run_lib.FitOptions):
  """Everything one `train seqrec` run needs (defaults: the Amazon setting of Ding et al.,
  "DPFormer: Learning Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633,
  §5–7)."""
  # A resumed run may also evaluate differently.
  NOT_FINGERPRINTED = run_lib.FitOptions.NOT_FINGERPRINTED + (
      "exclude_history", "eval_batch_size", "reattention_at_eval")
  data: Optional[str] = None
  # as `dprec train seqrec`'s: "auto" chooses item2item or dpformer (`model_choice`)
  model: str = model_choice.AUTO
  model_choice_share: float = 0.25  # --model auto: stage 1's share of item2item's pairs
  auto_model: bool = False  # set by `model_choice.resolve`: the run was paid as a whole
  epsilon: float = 5.0
  delta: Optional[float] = None
  epochs: float = 100.0
  batch_size: Optional[int] = None  # None: chosen from N (poisson.default_batch_size)
  learning_rate: float = 5e-3
  optimizer: str = "adamw"
  adambc_floor: float = ADAMBC_FLOOR
  weight_decay: float = 1e-5
  l2_norm_clip: float = 1.0
  normalization_offset: Optional[float] = None
  max_len: int = 50
  dim: int = 64
  item_rank: Optional[int] = None
  item_norm_share: Optional[float] = None
  item_vocab_threshold: Optional[float] = None
  popularity_weights: bool = False
  hold_out_validation: bool = True
  num_blocks: int = 2
  num_heads: int = 1
  dropout: float = 0.5
  reattention: bool = True
  tied: bool = True
  loss_positions: str = "all"
  score_padding: bool = False
  reattention_scale_by_dim: bool = True
  reattention_at_eval: bool = True
  variance_scale: float = 1.0
  item_frequencies: Optional[str] = None  # public p_i file; None: DP histogram
  item_frequency_share: Optional[float] = None  # None: 0.05 (dpformer), 0.3 (item2item)
  item_histogram_items: Optional[int] = None  # None: max_len (dpformer), 10 (item2item)
  exclude_history: bool = False
  eval_batch_size: int = 256
  dp_forward: Optional[DPForwardOptions] = None
  # --model item2item (dprec.workflows.item2item)
  pair_window: int = 2
  pair_decay: float = 0.5
  pair_max_items: Optional[int] = 20
  pair_item_set: Optional[int] = 1000
  pair_threshold: float = 3.0
  pair_recent: int = 3
  pair_recent_decay: float = 0.5
  pair_popularity_exponent: float = 0.0
  pair_popularity_weight: float = 1e-3
  # --model hybrid / dpformer-frozen: the pair release's ε share (None: 0.3 / 0.88)
  pair_share: Optional[float] = None
  pair_init: bool = True  # --model hybrid: item rows from the released pairs' SVD
  # --model hybrid / dpformer-frozen: w of the item2item prior on the logits
  # (dprec.models.logit_prior); None: the weight of PRIOR_WEIGHTS best on the validation items
  # (not covered by ε)
  prior_weight: Optional[float] = 0.0
  # --model dpformer-frozen: w of the same prior in the training logits (0: none)
  train_prior_weight: float = 0.0
  # keep the weights (before training or after an epoch) best on the validation items
  select_epochs: bool = False
  # Opt-in public users (dprec.data.public_users): their share and the rule's public salt.
  public_users: float = 0.0
  public_users_salt: int = 0

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
