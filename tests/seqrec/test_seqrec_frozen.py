"""`train seqrec --model dpformer-frozen` (issue 53): the item table is fixed from the released
pairs, so a DP step leaves it bit for bit and noises only the blocks; one user moves the blocks'
clipped sum by ≤ C; ε is dp_accounting's composition of the histogram, the pair release and
the training steps."""
import json

import numpy as np
import pytest
import tensorflow as tf

from dprec import cli
from dprec.models.seqrec import SeqRecConfig, SeqRecModel
from dprec.optimizers.config import DPSGD
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.privacy import PrivacyLedger
from dprec.workflows import item2item, item_frequencies, seqrec

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
  assert cli.main(["train", "seqrec", "--data", sequences_dir, "--epsilon", "5", "--ledger",
                   str(ledger), *FROZEN]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["model"] == seqrec.FROZEN and summary["reattention"] is False
  histogram, pairs = summary["item_frequencies"], summary["item_pairs"]
  assert histogram["epsilon_share"] == 0.3 and pairs["epsilon_share"] == 0.6
  check_composition(summary, [histogram["noise_multiplier"], pairs["noise_multiplier"]])
  labels = {c["label"] for c in PrivacyLedger(str(ledger)).charges}
  assert labels == {item_frequencies.LABEL, item2item.LABEL, seqrec.LEDGER_LABEL}
  assert cli.main(["train", "seqrec", "--data", sequences_dir, "--epsilon", "5",
                   "--item-norm-share", "0.5", *FROZEN]) == 2
  assert "trains no item rows" in capsys.readouterr().err
