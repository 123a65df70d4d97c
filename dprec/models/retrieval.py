"""A two-tower retrieval model that per-example clipping can make private.

TFRS's `tfrs.tasks.Retrieval` scores each query against the batch's own positives (in-batch
negatives): example j's item is a negative in every other example's loss, so removing j changes
every loss of the batch and clipping each example's gradient to C2 does not bound j's influence
(`dprec.make_private` refuses it; tests/workflows/test_make_private.py shows the bound failing).

Here the negatives do not depend on the batch: a full softmax over the item corpus. The query
tower maps the user to q ∈ R^d; the candidate tower is the item table E [M, d], held as the
kernel of the output `Dense(M)` (plus a per-item bias: a popularity prior, which `make_private`
initialises from DP item counts), so the logits are q·Eᵀ + b and example i's loss, the sparse
categorical cross-entropy of its positive item, depends on example i alone. Its gradient in E
is the rank-one (p_i − e_{y_i}) ⊗ q_i, whose norm is the Dense layer's ghost norm
(`dprec.clipping.layer_norms`): no per-example gradient is materialised. Evaluate it by ranking
the whole corpus (`dprec.models.ranking_metrics`).
"""
from typing import Sequence

import tensorflow as tf

USER, ITEM_LOGITS = "user", "item_embedding"


def two_tower(num_users: int, num_items: int, dim: int = 32,
              hidden_units: Sequence[int] = (64,)) -> tf.keras.Model:
  """{"user": int ids [n]} → logits over the `num_items` items [n, M]: a user table of `dim`,
  `hidden_units` ReLU layers and a projection to `dim` (the query tower), then the item table
  as the output layer's kernel (`ITEM_LOGITS`). Train with
  `SparseCategoricalCrossentropy(from_logits=True)` on the positive item ids."""
  user = tf.keras.Input((), dtype=tf.int64, name=USER)
  query = tf.keras.layers.Embedding(num_users, dim, name="user_embedding")(user)
  for units in hidden_units:
    query = tf.keras.layers.Dense(units, activation="relu")(query)
  query = tf.keras.layers.Dense(dim, name="query")(query)
  logits = tf.keras.layers.Dense(num_items, name=ITEM_LOGITS)(query)
  return tf.keras.Model({USER: user}, logits, name="two_tower")
