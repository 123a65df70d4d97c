"""Phantom Clipping: per-example norms equal brute-force per-example gradient norms."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.clipping.phantom import phantom_squared_norms
from dprec.layers.reattention import ReAttentionConfig
from dprec.models.seqrec import NextItemLoss, SeqRecConfig, SeqRecModel
from dprec.optimizers.config import DPSGD
from dprec.optimizers.dp_optimizer import DPOptimizer

NUM_ITEMS, MAX_LEN = 13, 6


def _batch():
  """Left padding, repeated items, the target inside the input, one fully padded history."""
  items = np.array([[0, 0, 3, 5, 3, 3],
                    [1, 2, 4, 2, 7, 8],
                    [0, 0, 0, 0, 0, 9],
                    [13, 12, 13, 1, 5, 6]], np.int32)
  labels = np.array([[0, 0, 5, 3, 3, 5],
                     [2, 4, 2, 7, 8, 2],
                     [0, 0, 0, 0, 0, 9],
                     [12, 13, 1, 5, 6, 13]], np.int32)
  return items, labels


def _model(loss_positions, tied=True, reattention=ReAttentionConfig(), num_heads=1):
  tf.keras.utils.set_random_seed(0)
  config = SeqRecConfig(num_items=NUM_ITEMS, max_len=MAX_LEN, dim=8, num_blocks=2,
                        num_heads=num_heads, ffn_dim=12, dropout=0.0, tied=tied,
                        loss_positions=loss_positions, reattention=reattention)
  model = SeqRecModel(config)
  items, _ = _batch()
  model({"items": items})
  rng = np.random.default_rng(1)
  # Random (not initial) weights so no gradient term is accidentally tiny.
  for var in model.trainable_variables:
    var.assign(rng.normal(0, 0.5, var.shape).astype(np.float32))
  frequencies = rng.uniform(0.05, 1.0, NUM_ITEMS + 1)
  model.set_error_model(frequencies, noise_multiplier=1.0, l2_norm_clip=1.0, batch_size=8,
                        num_examples=100)
  return model


def _fast_squared_norms(model, items, labels):
  """The shared DP step's norm pass: registry (Dense, LayerNorm, positions) + Phantom hook."""
  model.compile(optimizer=DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1)),
                run_eagerly=True)
  return model.per_example_squared_norms({"items": items}, labels).numpy()


def _brute_force_squared_norms(model, items, labels):
  norms = []
  for i in range(len(items)):
    with tf.GradientTape() as tape:
      logits = model.forward(items[i:i + 1], training=True)[0]
      loss = tf.reduce_sum(NextItemLoss(reduction="none")(labels[i:i + 1], logits))
    grads = tape.gradient(loss, model.trainable_variables)
    norms.append(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
                     for g in grads if g is not None))
  return np.array(norms)


@pytest.mark.parametrize("loss_positions,tied,reattention,num_heads", [
    ("all", True, ReAttentionConfig(), 1),
    ("last", True, ReAttentionConfig(), 1),
    ("all", True, ReAttentionConfig(stop_gradient=False, scale_by_dim=False), 2),
    ("all", False, ReAttentionConfig(enabled=False), 2),
])
def test_model_norms_equal_brute_force(loss_positions, tied, reattention, num_heads):
  model = _model(loss_positions, tied, reattention, num_heads)
  items, labels = _batch()
  fast = _fast_squared_norms(model, items, labels)
  brute = _brute_force_squared_norms(model, items, labels)
  np.testing.assert_allclose(fast, brute, rtol=1e-5)
  assert np.all(brute > 1e-3)


def _tied_only_problem(rng, batch, length, num_items, dim, positions):
  ids = rng.integers(0, num_items + 1, size=(batch, length))
  ids[:, 1] = ids[:, 3]  # a repeated item in every sequence
  ids[0, :2] = 0  # padding
  table = tf.Variable(rng.normal(size=(num_items + 1, dim)))
  mix = tf.constant(rng.normal(size=(length, positions)))
  targets = rng.integers(0, num_items, size=(batch, positions))
  return ids, table, mix, targets


def test_phantom_formula_equals_naive_and_printed_formula_does_not():
  """Embedding only: the corrected Eq. 16 matches; squaring the ghost term (as printed) fails."""
  rng = np.random.default_rng(0)
  ids, table, mix, targets = _tied_only_problem(rng, 3, 7, 11, 4, positions=7)

  def forward(ids_b, targets_b):
    lookup = tf.gather(table, ids_b) * tf.cast(ids_b > 0, tf.float64)[..., None]
    hidden = tf.tanh(tf.einsum("blk,lt->btk", lookup, mix))
    logits = tf.einsum("btd,md->btm", hidden, table[1:])
    return lookup, hidden, logits, tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets_b, logits=logits)

  with tf.GradientTape(persistent=True) as tape:
    lookup = tf.gather(table, ids)
    tape.watch(lookup)
    masked = lookup * tf.cast(ids > 0, tf.float64)[..., None]
    hidden = tf.tanh(tf.einsum("blk,lt->btk", masked, mix))
    logits = tf.einsum("btd,md->btm", hidden, table[1:])
    loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets,
                                                                         logits=logits))
  grad_lookup, grad_logits = tape.gradient(loss, [lookup, logits])
  fast = phantom_squared_norms(ids, grad_lookup, hidden, grad_logits).numpy()
  naive = []
  for i in range(len(ids)):
    with tf.GradientTape() as t:
      loss_i = tf.reduce_sum(forward(ids[i:i + 1], targets[i:i + 1])[3])
    naive.append(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(t.gradient(loss_i, table))))))
  np.testing.assert_allclose(fast, naive, rtol=1e-10)
  valid = tf.cast(ids > 0, tf.float64)
  g = grad_lookup * valid[..., None]
  same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float64)
  ghost = tf.reduce_sum(same * tf.einsum("bld,bkd->blk", g, g), axis=[1, 2])
  printed = fast - ghost + ghost ** 2  # Eq. 16 as printed squares the ghost term again
  assert np.all(np.abs(printed.numpy() - naive) / np.array(naive) > 1e-3)
