"""`train seqrec --model dpformer-frozen`: the item table is fixed from the released
pairs, so a DP step leaves it bit for bit and noises only the blocks; one user moves the blocks'
clipped sum by ≤ C; ε is dp_accounting's composition of the histogram, the pair release and
the training steps; trained with the pair prior in its logits, it starts exactly at offset +
w·prior and its per-example norms are brute force's."""
import json

import numpy as np
import pytest
import scipy.sparse
import tensorflow as tf

from dprec import cli
from dprec.errors import DprecError
from dprec.models.item2item import Item2ItemModel
from dprec.models.logit_prior import TrainingPriorConfig, packed_pairs
from dprec.models.seqrec import NextItemLoss, SeqRecConfig, SeqRecModel
from dprec.optimizers.config import DPSGD
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.privacy import PrivacyLedger
from dprec.workflows import item2item, item_frequencies, seqrec

TRAIN = ["train", "seqrec", "--summary-json", "-"]  # the JSON summary on stdout

ITEMS = np.array([[0, 0, 3, 5, 3, 3], [1, 2, 4, 2, 7, 8], [0, 0, 0, 0, 0, 9],
                  [13, 12, 13, 1, 5, 6]], np.int32)
LABELS = np.array([[0, 0, 5, 3, 3, 5], [2, 4, 2, 7, 8, 2], [0, 0, 0, 0, 0, 9],
                   [12, 13, 1, 5, 6, 13]], np.int32)


def _frozen_model():
  tf.keras.utils.set_random_seed(0)
  model = SeqRecModel(SeqRecConfig(num_items=13, max_len=6, dim=8, ffn_dim=12, dropout=0.0,
                                   frozen_items=True))
  model({"items": ITEMS})
  rng = np.random.default_rng(1)
  model.set_frozen_items(rng.normal(0, 1, (14, 8)), rng.normal(0, 1, 13))
  return model


def _update(model, rows, clip, sigma):
  """The step's update Σ c_i·g_i/B + noise (SGD at lr 1, B = 4 expected) over `rows`."""
  model.compile(optimizer=DPOptimizer(DPSGD(clip, sigma), tf.keras.optimizers.SGD(1.0),
                                      expected_batch_size=len(ITEMS), insecure_noise_seed=0),
                run_eagerly=True)
  before = [v.numpy() for v in model.trainable_variables]
  model.train_on_batch({"items": ITEMS[rows]}, LABELS[rows])
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


def test_frozen_table_is_untouched_and_one_user_moves_the_blocks_by_at_most_c():
  """All positions here (ragged logits); the command test below trains the last position."""
  model = _frozen_model()
  table = model.item_embedding.embeddings
  assert not any(v is table or v is model.item_logit_offset for v in model.trainable_variables)
  assert model.extra_squared_norms() == []  # no Phantom: the registry covers every weight
  frozen = table.numpy(), model.item_logit_offset.numpy()
  noisy = _update(model, slice(None), 0.5, 2.0)
  np.testing.assert_array_equal(table.numpy(), frozen[0])
  np.testing.assert_array_equal(model.item_logit_offset.numpy(), frozen[1])
  assert max(np.abs(u).max() for u in noisy) > 0.1  # the blocks did get their noise
  weights = model.get_weights()
  clip = 1e-3  # below every user's gradient norm: each one is clipped to exactly C
  everyone = _update(_model_with(weights), slice(None), clip, 0.0)
  for user in (1, 2):  # the longest sequence and a single item
    others = _update(_model_with(weights), np.arange(len(ITEMS)) != user, clip, 0.0)
    moved = np.sqrt(sum((((a - b) * len(ITEMS)) ** 2).sum() for a, b in zip(everyone, others)))
    assert moved == pytest.approx(clip, rel=1e-3)


def _model_with(weights):
  model = _frozen_model()
  model.set_weights(weights)
  return model


def test_frozen_needs_a_tied_table_with_a_row_per_item():
  with pytest.raises(ValueError, match="frozen_items"):
    SeqRecConfig(num_items=13, frozen_items=True, item_rank=3)


FROZEN = ["--model", "dpformer-frozen", "--epochs", "1", "--batch-size", "32", "--max-len", "8",
          "--dim", "8", "--blocks", "1", "--pair-item-set", "30", "--loss-positions", "last",
          "--pair-share", "0.6", "--no-progress"]  # 0.88 leaves nothing to train at N = 109


@pytest.mark.commands
def test_frozen_epsilon_composes_histogram_pairs_and_training(sequences_dir, tmp_path, capsys,
                                                              check_composition):
  ledger = tmp_path / "ledger.json"
  assert cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--ledger",
                   str(ledger), *FROZEN]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["model"] == seqrec.FROZEN and summary["reattention"] is False
  histogram, pairs = summary["item_frequencies"], summary["item_pairs"]
  assert histogram["epsilon_share"] == 0.3 and pairs["epsilon_share"] == 0.6
  check_composition(summary, [histogram["noise_multiplier"], pairs["noise_multiplier"]])
  labels = {c["label"] for c in PrivacyLedger(str(ledger)).charges}
  assert labels == {item_frequencies.LABEL, item2item.LABEL, seqrec.LEDGER_LABEL}
  assert cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5",
                   "--item-norm-share", "0.5", *FROZEN]) == 2
  assert "trains no item rows" in capsys.readouterr().err


def _prior_model(pairs):
  """The frozen model trained with the pair prior (`training_prior`) at w = 2 over `pairs`."""
  tf.keras.utils.set_random_seed(0)
  model = SeqRecModel(SeqRecConfig(num_items=13, max_len=6, dim=8, ffn_dim=12, dropout=0.0,
                                   frozen_items=True, loss_positions="last",
                                   training_prior=TrainingPriorConfig(2.0, items=8)))
  model({"items": ITEMS})
  rng = np.random.default_rng(1)
  model.set_frozen_items(rng.normal(0, 1, (14, 8)), rng.normal(0, 1, 13))
  model.set_training_prior(*packed_pairs(pairs, 8))
  return model


def _pairs():
  rng = np.random.default_rng(2)
  dense = np.zeros((14, 14), np.float32)
  dense[[3, 5, 2, 13, 6], [5, 3, 4, 12, 13]] = rng.uniform(1, 5, 5)
  return scipy.sparse.csr_matrix(dense)


def test_training_prior_starts_at_offset_plus_prior_and_its_norms_are_brute_force():
  """Untrained: logits = b + w·Σ_k ρ^(k−1)·S̃[h_k, j] exactly (`Item2ItemModel`'s scores);
  with every weight random, the registry's per-example norms (the zero-initialised output
  projection included) equal per-example gradients', and a noised step leaves the table,
  the offset and the released pairs bit for bit."""
  pairs = _pairs()
  model = _prior_model(pairs)
  expected = (model.item_logit_offset.numpy()
              + 2.0 * Item2ItemModel(pairs, np.ones(14)).transition_scores(ITEMS))
  np.testing.assert_allclose(model.score_items(ITEMS).numpy(), expected, rtol=1e-6)
  assert model.output_projection.kernel in model.trainable_variables
  rng = np.random.default_rng(3)
  for variable in model.trainable_variables:  # random, so no gradient term is tiny
    variable.assign(rng.normal(0, 0.5, variable.shape).astype(np.float32))
  model.compile(optimizer=DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1)),
                run_eagerly=True)
  fast = model.per_example_squared_norms({"items": ITEMS}, LABELS).numpy()
  brute = []
  for i in range(len(ITEMS)):
    with tf.GradientTape() as tape:
      logits = model.forward(ITEMS[i:i + 1], training=True)[0]
      loss = tf.reduce_sum(NextItemLoss(reduction="none")(LABELS[i:i + 1], logits))
    brute.append(sum(float(tf.reduce_sum(tf.square(g)))
                     for g in tape.gradient(loss, model.trainable_variables)))
  np.testing.assert_allclose(fast, brute, rtol=1e-5)
  fixed = [v.numpy() for v in (model.item_embedding.embeddings, model.item_logit_offset,
                               model.prior_slot, model.prior_pairs)]
  _update(model, slice(None), 0.5, 2.0)
  for value, variable in zip(fixed, (model.item_embedding.embeddings, model.item_logit_offset,
                                     model.prior_slot, model.prior_pairs)):
    np.testing.assert_array_equal(variable.numpy(), value)


def test_training_prior_needs_the_frozen_table_and_the_last_position():
  with pytest.raises(ValueError, match="training_prior"):
    SeqRecConfig(num_items=13, frozen_items=True, training_prior=TrainingPriorConfig(1.0))
  with pytest.raises(DprecError, match="slots"):
    packed_pairs(_pairs(), 3)


@pytest.mark.commands
def test_frozen_trained_with_the_prior_keeps_the_best_epoch_on_validation(sequences_dir, capsys,
                                                                          check_composition):
  assert cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", *FROZEN,
                   "--epochs", "2", "--train-prior-weight", "1", "--select-epochs"]) == 0
  summary = json.loads(capsys.readouterr().out)
  selection = summary["epoch_selection"]
  assert summary["train_prior_weight"] == 1.0 and selection["selected_on"] == "validation"
  by_step = {int(s): v for s, v in selection["validation_ndcg_by_step"].items()}
  assert min(by_step) == 0 and max(by_step) == summary["steps"] and len(by_step) == 3
  assert by_step[selection["selected_step"]] == max(by_step.values())
  check_composition(summary, [summary["item_frequencies"]["noise_multiplier"],
                              summary["item_pairs"]["noise_multiplier"]])
