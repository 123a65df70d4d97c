"""`dprec train seqrec --model item2item`: the DP pair release end to end on tiny data: ε is
dp_accounting's composition of the histogram and the release, both charged to the ledger, and
the model reads only released values."""
import json

import dp_accounting
import numpy as np

from dprec import cli
from dprec.data.sequences import load_sequences, make_examples
from dprec.privacy import PrivacyLedger, item_pairs
from dprec.workflows import item2item, item_frequencies, seqrec

SMALL = ["--max-len", "8", "--pair-item-set", "30", "--no-progress"]


def _run(capsys, *argv):
  assert cli.main(["train", "seqrec", *argv]) == 0
  return json.loads(capsys.readouterr().out)


def test_dp_run_epsilon_is_the_composition_of_histogram_and_pair_release(data_dir, tmp_path,
                                                                        capsys):
  ledger = tmp_path / "ledger.json"
  summary = _run(capsys, "--data", data_dir, "--epsilon", "5", "--ledger", str(ledger), *SMALL)
  assert summary["model"] == "item2item" and summary["public_users"] == 0.0
  assert summary["item_pairs"]["item_set"] == 30 and summary["item_pairs"]["threshold"] > 0
  for key in ("ndcg_at_10", "hit_at_10", "by_popularity", "distinct_top10_items"):
    assert key in summary
  histogram = summary["item_frequencies"]
  assert histogram["epsilon_share"] == 0.3 and histogram["max_items_per_user"] == 8
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(histogram["noise_multiplier"]))
  accountant.compose(dp_accounting.GaussianDpEvent(summary["noise_multiplier"]))
  direct = accountant.get_epsilon(summary["delta"])
  assert abs(summary["epsilon"] - direct) <= 1e-3 * direct
  assert 4.95 < summary["epsilon"] <= 5.0 + 1e-6
  labels = {c["label"] for c in PrivacyLedger(str(ledger)).charges}
  assert labels == {item_frequencies.LABEL, item2item.LABEL}


def test_non_private_run_uses_the_exact_statistics(data_dir, capsys):
  summary = _run(capsys, "--data", data_dir, "--epsilon", "inf", *SMALL)
  assert summary["model"] == "item2item" and summary["epsilon"] == float("inf")
  assert summary["item_pairs"]["private"] is False
  assert 0.0 <= summary["ndcg_at_10"] <= summary["hit_at_10"] <= 1.0


def test_the_model_reads_only_released_values(data_dir, monkeypatch):
  """Two data sets with the same released histogram and pairs give the same scores."""
  data = load_sequences(data_dir)
  options = seqrec.SeqRecTrainOptions(model="item2item", max_len=8, pair_item_set=None)
  first = make_examples(data, 8, True)
  rng = np.random.default_rng(0)
  second = first.__class__(**dict(vars(first), items=rng.permutation(first.items),
                                  labels=rng.permutation(first.labels)))
  fixed = item_pairs.pair_statistics([np.array([1, 2, 3])], first.num_items)
  monkeypatch.setattr(item_pairs, "release",
                      lambda *a, **k: item_pairs.ReleasedPairs(fixed, 1.0, 1.0, 0.0))
  p_i = np.linspace(0.1, 0.9, first.num_items + 1)
  plan = seqrec.plan_privacy(options, len(first.items))
  scores = [item2item.build_model(options, examples, plan, p_i, np.random.default_rng(1))[0]
            .score_items(first.test_histories) for examples in (first, second)]
  np.testing.assert_array_equal(scores[0], scores[1])
