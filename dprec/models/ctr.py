"""The pCTR model of Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large
Embedding Models", arXiv:2311.08357, App. D.1.1, trainable by every DP algorithm.

One DP embedding table per categorical feature with dimension int(2·V^0.25), concatenated with
the log-transformed integer features, four Dense(598, relu) layers and a scalar logit; binary
cross-entropy loss and AUC through a TFRS `tasks.Ranking`. The model is a `DPModel`, so the
algorithm (non-private, DP-SGD, DP-FEST, DP-AdaFEST, DP-AdaFEST+) is chosen at `compile` by the
`DPOptimizer` passed as optimizer.
"""
import dataclasses
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from dprec.layers.embedding import DPMultiEmbedding
from dprec.models.dp_model import DPModel

CAT_FEATURES = "cat_features"
INT_FEATURES = "int_features"


def embedding_dim(num_buckets: int) -> int:
  """int(2·V^0.25) with V the feature's number of buckets (App. D.1.1), at least 1."""
  return max(1, int(2 * num_buckets ** 0.25))


@dataclasses.dataclass(frozen=True)
class CTRConfig:
  """Shape of the pCTR model.

  Attributes:
    vocab_sizes: rows of each categorical feature's table, OOV/missing row 0 included (the
      `size` of `dprec.data.criteo.CriteoVocabulary`), in column order of `cat_features`.
    table_names: one name per table (DP-FEST row sets are keyed by it); default C1, C2, ...
    num_integer_features: width of `int_features` (13 for Criteo).
    hidden_units: the Dense(relu) layers (App. D.1.1: four of 598).
    embedding_dims: per-table widths; default `embedding_dim(size - 1)`, V counting the known
      buckets but not the OOV row, which reproduces Ghazi et al.'s (2023) dims for Table 3.
    auc_thresholds: thresholds of the Keras AUC (evenly spaced, so updates stay O(batch)).
    logit_bias: None: the logit layer starts as Keras' default (Glorot kernel, bias 0, so the
      untrained model scores p ≈ 0.5). A number b: zero kernel and bias b, so the untrained
      model predicts sigmoid(b) for every example, e.g. the logit of a (DP) base rate.
    stack_tables: False, or the tables of each width in one variable (True or 1: exact widths;
      an int m: widths rounded up to a multiple of m; `DPMultiEmbedding(stack_tables=)`): the
      same model and DP step (same key, same noise), with per-table work done per width.
  """
  vocab_sizes: Tuple[int, ...]
  table_names: Optional[Tuple[str, ...]] = None
  num_integer_features: int = 13
  hidden_units: Tuple[int, ...] = (598, 598, 598, 598)
  embedding_dims: Optional[Tuple[int, ...]] = None
  auc_thresholds: int = 10000
  logit_bias: Optional[float] = None
  stack_tables: Union[bool, int] = False

  def __post_init__(self):
    sizes = tuple(int(v) for v in self.vocab_sizes)
    if not sizes or min(sizes) < 1:
      raise ValueError(f"vocab_sizes must be a non-empty list of positive ints, got {sizes}")
    object.__setattr__(self, "vocab_sizes", sizes)
    names = tuple(self.table_names or (f"C{i + 1}" for i in range(len(sizes))))
    dims = tuple(self.embedding_dims or (embedding_dim(max(v - 1, 1)) for v in sizes))
    if len(names) != len(sizes) or len(dims) != len(sizes):
      raise ValueError(f"{len(sizes)} vocab_sizes but {len(names)} table_names and "
                       f"{len(dims)} embedding_dims")
    object.__setattr__(self, "table_names", names)
    object.__setattr__(self, "embedding_dims", dims)
    object.__setattr__(self, "hidden_units", tuple(int(u) for u in self.hidden_units))

  @property
  def embedding_parameters(self) -> int:
    """Σ V·d: the size of DP-SGD's dense embedding gradient."""
    return sum(v * d for v, d in zip(self.vocab_sizes, self.embedding_dims))


class CTRModel(DPModel):
  """Embeddings ⊕ integer features → Dense(598, relu)×4 → logit (Ghazi et al. 2023, App. D.1.1).

  Inputs: {"cat_features": int [n, F] vocabulary indices, "int_features": float [n, 13]}.
  Output: logits [n, 1]. Labels: 0/1 of shape [n] or [n, 1].
  """

  def __init__(self, config: CTRConfig, **kwargs):
    super().__init__(**kwargs)
    self.config = config
    self.embedding = DPMultiEmbedding(config.vocab_sizes, config.embedding_dims,
                                      table_names=config.table_names,
                                      stack_tables=config.stack_tables, name="embedding")
    self.hidden = [tf.keras.layers.Dense(units, activation="relu", name=f"hidden_{i}")
                   for i, units in enumerate(config.hidden_units)]
    if config.logit_bias is None:
      self.logit = tf.keras.layers.Dense(1, name="logit")
    else:
      self.logit = tf.keras.layers.Dense(
          1, kernel_initializer="zeros",
          bias_initializer=tf.keras.initializers.Constant(config.logit_bias), name="logit")
    self.task = tfrs.tasks.Ranking(  # per-example losses: averaged in `compute_loss`
        loss=tf.keras.losses.BinaryCrossentropy(from_logits=True,
                                                reduction=tf.keras.losses.Reduction.NONE),
        metrics=[tf.keras.metrics.AUC(num_thresholds=config.auc_thresholds, from_logits=True,
                                      name="auc")])
    self.loss_tracker = tf.keras.metrics.Mean(name="loss")

  def call(self, inputs, training=False):
    activations = tf.concat([self.embedding(inputs[CAT_FEATURES]),
                             tf.cast(inputs[INT_FEATURES], tf.float32)], axis=1)
    for layer in self.hidden:
      activations = layer(activations)
    return self.logit(activations)

  def lookup_pass(self, x):
    """The table lookups of the forward pass alone (`DPStep.lookup_pass`)."""
    self.embedding(x[CAT_FEATURES])

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
    """The TFRS ranking task: mean BCE, and the AUC metric updated on the way. Under
    `tf.distribute` the returned loss is the replica's share of the global mean (Keras sums the
    replicas' gradients of a non-private step); the logged loss is the mean."""
    losses = self.task(labels=_column(y), predictions=y_pred, sample_weight=sample_weight)
    batch = tf.shape(y_pred)[0]
    self.loss_tracker.update_state(
        tf.math.divide_no_nan(tf.reduce_sum(losses), tf.cast(batch, losses.dtype)),
        sample_weight=batch)
    return tf.nn.compute_average_loss(losses)

  def per_example_loss(self, y, y_pred, sample_weight=None):
    """BCE of each example [n], which the DP step clips (the task's loss before its mean)."""
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=_column(y), logits=y_pred)[:, 0]
    if sample_weight is not None:
      losses *= tf.reshape(tf.cast(sample_weight, losses.dtype), [-1])
    return losses


def _column(labels):
  return tf.reshape(tf.cast(labels, tf.float32), [-1, 1])


def build_ctr_model(vocab_sizes: Sequence[int], **config_kwargs) -> CTRModel:
  """A built `CTRModel` (variables created) for tables of `vocab_sizes` rows."""
  return model_from_config(CTRConfig(vocab_sizes=tuple(vocab_sizes), **config_kwargs))


def model_from_config(config: CTRConfig) -> CTRModel:
  """A built `CTRModel` of `config` (e.g. a copy of a model's architecture)."""
  model = CTRModel(config)
  model({CAT_FEATURES: tf.zeros([1, len(config.vocab_sizes)], tf.int32),
         INT_FEATURES: tf.zeros([1, config.num_integer_features], tf.float32)})
  return model


def evaluate(model: CTRModel, features, labels, batch_size: int = 8192) -> dict:
  """Held-out metrics of a pCTR model: `auc` and `loss` (mean log loss)."""
  return model.evaluate({key: features[key] for key in (CAT_FEATURES, INT_FEATURES)}, labels,
                        batch_size=batch_size, verbose=0, return_dict=True)


def predict_logits(model: CTRModel, features, batch_size: int = 8192) -> np.ndarray:
  """The model's logits [n] on `features` (a dict with `cat_features` and `int_features`)."""
  return model.predict({key: features[key] for key in (CAT_FEATURES, INT_FEATURES)},
                       batch_size=batch_size, verbose=0)[:, 0]


def log_loss_of_constant(labels, rate) -> float:
  """Mean binary cross-entropy of predicting `rate` for every example (the base-rate yardstick
  a calibrated pCTR model must beat)."""
  positive = float(np.mean(labels))
  return -(positive * np.log(rate) + (1 - positive) * np.log1p(-rate))
