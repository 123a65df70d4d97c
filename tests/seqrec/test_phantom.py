"""Phantom Clipping: per-example norms equal brute-force per-example gradient norms."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.clipping.phantom import phantom_squared_norms, scored_positions
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


def _model(loss_positions, tied=True, reattention=ReAttentionConfig(), num_heads=1,
           score_padding=False):
  tf.keras.utils.set_random_seed(0)
  config = SeqRecConfig(num_items=NUM_ITEMS, max_len=MAX_LEN, dim=8, num_blocks=2,
                        num_heads=num_heads, ffn_dim=12, dropout=0.0, tied=tied,
                        loss_positions=loss_positions, score_padding=score_padding,
                        reattention=reattention)
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


@pytest.mark.parametrize("loss_positions,tied,reattention,num_heads,score_padding", [
    ("all", True, ReAttentionConfig(), 1, False),
    ("all", True, ReAttentionConfig(), 1, True),
    ("last", True, ReAttentionConfig(), 1, False),
    ("all", True, ReAttentionConfig(stop_gradient=False, scale_by_dim=False), 2, False),
    ("all", False, ReAttentionConfig(enabled=False), 2, False),
])
def test_model_norms_equal_brute_force(loss_positions, tied, reattention, num_heads,
                                       score_padding):
  """Ragged lengths (left padding of 0–4), packed or padded scores, tied or not."""
  model = _model(loss_positions, tied, reattention, num_heads, score_padding)
  items, labels = _batch()
  fast = _fast_squared_norms(model, items, labels)
  brute = _brute_force_squared_norms(model, items, labels)
  np.testing.assert_allclose(fast, brute, rtol=1e-5)
  assert np.all(brute > 1e-3)


def _tied_only_problem(rng, batch, length, num_items, dim):
  ids = rng.integers(0, num_items + 1, size=(batch, length))
  ids[:, 1] = ids[:, 3]  # a repeated item in every sequence
  ids[0, :2] = 0  # padding
  table = tf.Variable(rng.normal(size=(num_items + 1, dim)))
  mix = tf.constant(rng.normal(size=(length, length)))
  targets = rng.integers(0, num_items, size=(batch, length))
  return ids, table, mix, targets


def _tied_only_forward(table, mix, ids, targets, row_lengths):
  """Lookup (masked), a position mixer, then scores of each example's last T_i positions."""
  lookup = tf.gather(table, ids)
  masked = lookup * tf.cast(ids > 0, tf.float64)[..., None]
  scored = scored_positions(row_lengths, ids.shape[1])
  hidden = tf.boolean_mask(tf.tanh(tf.einsum("blk,lt->btk", masked, mix)), scored)
  logits = tf.matmul(hidden, table[1:], transpose_b=True)
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.boolean_mask(targets, scored), logits=logits)
  return lookup, hidden, logits, tf.reduce_sum(losses)


def _phantom_and_naive(row_lengths, seed=0):
  rng = np.random.default_rng(seed)
  ids, table, mix, targets = _tied_only_problem(rng, len(row_lengths), 7, 11, 4)
  row_lengths = np.asarray(row_lengths)
  with tf.GradientTape() as tape:
    tape.watch(table)
    lookup, hidden, logits, loss = _tied_only_forward(table, mix, ids, targets, row_lengths)
  grad_lookup, grad_logits = tape.gradient(loss, [lookup, logits])
  fast = phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, row_lengths).numpy()
  naive = []
  for i in range(len(ids)):
    with tf.GradientTape() as t:
      loss_i = _tied_only_forward(table, mix, ids[i:i + 1], targets[i:i + 1],
                                  row_lengths[i:i + 1])[3]
    grad = t.gradient(loss_i, table)
    naive.append(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(grad)))))
  return ids, grad_lookup, fast, np.array(naive)


def test_phantom_formula_equals_naive_and_printed_formula_does_not():
  """Embedding only: the corrected Eq. 16 matches; squaring the ghost term (as printed) fails."""
  ids, grad_lookup, fast, naive = _phantom_and_naive([7, 7, 7])
  np.testing.assert_allclose(fast, naive, rtol=1e-10)
  valid = tf.cast(ids > 0, tf.float64)
  g = grad_lookup * valid[..., None]
  same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float64)
  ghost = tf.reduce_sum(same * tf.einsum("bld,bkd->blk", g, g), axis=[1, 2])
  printed = fast - ghost + ghost ** 2  # Eq. 16 as printed squares the ghost term again
  assert np.all(np.abs(printed.numpy() - naive) / naive > 1e-3)


def test_phantom_formula_with_ragged_scored_positions():
  """Examples score different numbers of last positions (0 to L, unsorted): the packed,
  per-example output side stays exact."""
  row_lengths = [3, 0, 7, 1, 5, 7, 2, 4, 1, 6, 0, 3]
  _, _, fast, naive = _phantom_and_naive(row_lengths, seed=1)
  np.testing.assert_allclose(fast, naive, rtol=1e-10)
  scoring = np.array(row_lengths) > 0
  assert np.all(naive[scoring] > 1e-3) and np.all(fast[~scoring] == 0)  # no target, no loss
