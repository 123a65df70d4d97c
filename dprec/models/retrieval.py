"""Two-tower retrieval models that per-example clipping can make private.

TFRS's `tfrs.tasks.Retrieval` scores each query against the batch's own positives (in-batch
negatives): example j's item is a negative in every other example's loss, so removing j changes
every loss of the batch and clipping each example's gradient to C2 does not bound j's influence
(`dprec.make_private` refuses it; tests/workflows/test_make_private.py shows the bound failing).

Here the negatives do not depend on the batch. `two_tower`: a full softmax over the item corpus
(exact, but O(M·d) per example: a non-private 3-epoch run on Amazon Games, M = 23,716, did not
finish in 36 min). `SampledTwoTower`: each example draws its own K negatives (O(K·d) per
example), with the logQ correction. In `two_tower` the query
tower maps the user to q ∈ R^d; the candidate tower is the item table E [M, d], held as the
kernel of the output `Dense(M)` (plus a per-item bias: a popularity prior, which `make_private`
initialises from DP item counts), so the logits are q·Eᵀ + b and example i's loss, the sparse
categorical cross-entropy of its positive item, depends on example i alone. Its gradient in E
is the rank-one (p_i − e_{y_i}) ⊗ q_i, whose norm is the Dense layer's ghost norm
(`dprec.clipping.layer_norms`): no per-example gradient is materialised. Evaluate it by ranking
the whole corpus (`dprec.models.ranking_metrics`).
"""
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from dprec import privacy
from dprec.errors import DprecError

USER, ITEM, ITEM_LOGITS = "user", "item", "item_embedding"
MASKED_LOGIT = -1e9  # an accidental hit: a negative equal to the example's positive


def two_tower(num_users: int, num_items: int, dim: int = 32,
              hidden_units: Sequence[int] = (64,)) -> tf.keras.Model:
  """{"user": int ids [n]} → logits over the `num_items` items [n, M]: a user table of `dim`,
  `hidden_units` ReLU layers and a projection to `dim` (the query tower), then the item table
  as the output layer's kernel (`ITEM_LOGITS`). Train with
  `SparseCategoricalCrossentropy(from_logits=True)` on the positive item ids."""
  user = tf.keras.Input((), dtype=tf.int64, name=USER)
  query = user
  for layer in _query_tower(num_users, dim, hidden_units):
    query = layer(query)
  logits = tf.keras.layers.Dense(num_items, name=ITEM_LOGITS)(query)
  return tf.keras.Model({USER: user}, logits, name="two_tower")


def _query_tower(num_users, dim, hidden_units):
  """User table of `dim`, `hidden_units` ReLU layers, a projection to `dim` (shared by both)."""
  return ([tf.keras.layers.Embedding(num_users, dim, name="user_embedding")]
          + [tf.keras.layers.Dense(units, activation="relu") for units in hidden_units]
          + [tf.keras.layers.Dense(dim, name="query")])


class SampledTwoTower(tf.keras.Model):
  """A two-tower retriever trained by a sampled softmax with per-example negatives.

  Inputs {"user": int [n], "item": int [n]} (the positive item in 0..M−1) → logits [n, 1 + K]
  over (the positive, K negatives), the positive in column 0: train with
  `SparseCategoricalCrossentropy(from_logits=True)` on labels 0 (`positive_labels`). Example
  i's K negatives are drawn for it alone, independently of the batch and of the data, from
  Q ∝ countᵅ over the items (`sampling_exponent` α: 0 uniform, 1 popularity; counts from
  `set_item_counts`, uniform before), so its loss depends on example i alone and clipping its
  gradient to C2 bounds its influence. Logits are s(u, j) − log Q(j) for the positive and every
  negative (the logQ correction of Yi et al. 2019 §3, Eq. 3; as `tf.nn.sampled_softmax_loss`
  with `subtract_log_q`), where s(u, j) = q_u·e_j + b_j + log P(j): a trained per-item bias b
  (zero at init) and, with `popularity_prior`, a fixed logit bias log P(j) of the item
  frequencies given to `set_item_counts`. A negative equal to the positive (accidental hit) is
  masked out. Per example the step costs O(K·d + K·log M) (inverse-CDF sampling), never O(M·d).
  `score_items(users)` gives the full-corpus scores s(u, ·) [n, M] for ranking.

  Privacy: the negatives use an ordinary RNG (`seed`; OS entropy if None), not the run's key:
  the DP guarantee holds conditionally on any negatives drawn independently of the data (the
  per-example clipping bound holds for every draw), so the proof does not rely on their
  secrecy. Q and P come from counts that must be public or DP: under `dprec.make_private`,
  `initialise_output` releases the DP item histogram (one-hot counts, L2 sensitivity 1 per
  example, Gaussian noise from the run's key, charged to the run's ledger as the output-bias
  release) and sets them.
  """

  def __init__(self, num_users: int, num_items: int, dim: int = 32,
               hidden_units: Sequence[int] = (64,), num_negatives: int = 100,
               sampling_exponent: float = 0.0, popularity_prior: bool = True,
               seed: Optional[int] = None, **kwargs):
    super().__init__(**kwargs)
    if int(num_negatives) < 1 or not 0 <= sampling_exponent <= 1:
      raise DprecError(f"num_negatives must be ≥ 1 and sampling_exponent in [0, 1], got "
                       f"{num_negatives}, {sampling_exponent}")
    self.num_items, self.num_negatives = int(num_items), int(num_negatives)
    self.sampling_exponent, self.popularity_prior = float(sampling_exponent), popularity_prior
    self.tower = _query_tower(num_users, dim, hidden_units)
    self.item_embedding = tf.keras.layers.Embedding(num_items, dim, name="item_embedding")
    self.item_bias = tf.keras.layers.Embedding(num_items, 1, embeddings_initializer="zeros",
                                               name="item_bias")
    # Public (or DP) statistics of the items, not trained: log Q for sampling and the logQ
    # correction, its CDF, and the fixed prior log P.
    self.log_q = self.add_weight("log_q", (num_items,), trainable=False,
                                 initializer=tf.keras.initializers.Constant(-np.log(num_items)))
    self.cdf = self.add_weight("sampling_cdf", (num_items,), trainable=False,
                               initializer=tf.keras.initializers.Constant(
                                   np.arange(1, num_items + 1) / num_items))
    self.log_prior = self.add_weight("log_prior", (num_items,), initializer="zeros",
                                     trainable=False)
    self.reset_negative_sampling(seed)

  @property
  def rows_per_example(self) -> int:
    """Embedding rows an example looks up: its user's, and the item and item-bias rows of its
    positive and K negatives (what DP-AdaFEST's contribution clip C1 is shared by)."""
    return 1 + 2 * (self.num_negatives + 1)

  def reset_negative_sampling(self, seed: Optional[int] = None):
    """Restarts the negatives' ordinary RNG (not tracked, not saved): from `seed`, or from
    OS entropy when None."""
    rng = (tf.random.Generator.from_seed(seed) if seed is not None
           else tf.random.Generator.from_non_deterministic_state())
    object.__setattr__(self, "_negative_rng", rng)

  def set_item_counts(self, counts):
    """Sets Q ∝ countᵅ and the prior P ∝ count from item counts [M] (public or DP; counts
    below 1 count as 1)."""
    counts = np.maximum(np.asarray(counts, np.float64).reshape(-1), 1.0)
    if counts.shape != (self.num_items,):
      raise DprecError(f"item counts need {self.num_items} entries, got {counts.shape[0]}")
    q = counts ** self.sampling_exponent
    q /= q.sum()
    self.log_q.assign(np.log(q).astype(np.float32))
    self.cdf.assign(np.cumsum(q).astype(np.float32))
    self.log_prior.assign(np.log(counts / counts.sum()).astype(np.float32))

  def initialise_output(self, x, y, noise_multiplier, rng):
    """`dprec.make_private`'s one-off release before training: the item histogram of the
    positives with N(0, σ²) per item (σ = `noise_multiplier`, L2 sensitivity 1: each example
    adds one to one count; `rng` from the run's key), given to `set_item_counts`."""
    del y  # the labels are the positive's column, 0
    self.set_item_counts(privacy.dp_class_counts(np.asarray(x[ITEM]), self.num_items,
                                                 noise_multiplier, rng))

  def query(self, users):
    """q_u [n, d]."""
    query = users
    for layer in self.tower:
      query = layer(query)
    return query

  def sample_negatives(self, n):
    """K item ids per example [n, K], drawn from Q by inverse CDF (ordinary RNG: see the class
    docstring). Example i's draws are the i-th row of one uniform draw, so a batch without its
    last example gets the same negatives for the others (tests rely on it)."""
    uniform = self._negative_rng.uniform([n, self.num_negatives])
    ids = tf.searchsorted(self.cdf, tf.reshape(uniform, [-1]), side="right", out_type=tf.int64)
    return tf.reshape(tf.minimum(ids, self.num_items - 1), [n, self.num_negatives])

  def candidate_logits(self, query, candidates):
    """s(u, j) − log Q(j) for candidates [n, C] → [n, C]."""
    logits = tf.einsum("nd,ncd->nc", query, self.item_embedding(candidates))
    logits += tf.squeeze(self.item_bias(candidates), -1) - tf.gather(self.log_q, candidates)
    if self.popularity_prior:
      logits += tf.gather(self.log_prior, candidates)
    return logits

  def call(self, inputs, training=None):
    positives = tf.cast(inputs[ITEM], tf.int64)[:, tf.newaxis]
    negatives = self.sample_negatives(tf.shape(positives)[0])
    logits = self.candidate_logits(self.query(inputs[USER]),
                                   tf.concat([positives, negatives], axis=1))
    hits = tf.concat([tf.zeros_like(positives, tf.bool), tf.equal(negatives, positives)], 1)
    return tf.where(hits, tf.constant(MASKED_LOGIT, logits.dtype), logits)

  def score_items(self, users):
    """Full-corpus scores s(u, j) [n, M] (no logQ: that corrects only the sampling)."""
    scores = tf.matmul(self.query(users), self.item_embedding.embeddings, transpose_b=True)
    scores += tf.reshape(self.item_bias.embeddings, [1, -1])
    if self.popularity_prior:
      scores += self.log_prior[tf.newaxis]
    return scores


def positive_labels(n: int) -> np.ndarray:
  """The labels of `SampledTwoTower`'s logits: the positive's column, 0, for each example."""
  return np.zeros([n], np.int64)
