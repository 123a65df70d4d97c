"""`dprec train seqrec --model item2item`: the DP pair release end to end on tiny data: ε is
dp_accounting's composition of the histogram and the release, both charged to the ledger, and
the model reads only released values."""
import json

import dp_accounting
import numpy as np

from dprec import cli
from dprec.data import public_users
from dprec.data.sequences import load_sequences, make_examples
from dprec.models.item2item import Item2ItemModel
from dprec.models.logit_prior import LogitPrior
from dprec.privacy import PrivacyLedger, item_pairs, user_histogram
from dprec.workflows import item2item, item_frequencies, seqrec

TRAIN = ["train", "seqrec", "--summary-json", "-"]  # the JSON summary on stdout

SMALL = ["--model", "item2item", "--max-len", "8", "--pair-item-set", "30", "--no-progress"]


def _run(capsys, *argv):
  assert cli.main([*TRAIN, *argv]) == 0
  return json.loads(capsys.readouterr().out)


def test_dp_run_epsilon_is_the_composition_of_histogram_and_pair_release(sequences_dir, tmp_path,
                                                                        capsys):
  ledger = tmp_path / "ledger.json"
  summary = _run(capsys, "--data", sequences_dir, "--epsilon", "5", "--ledger", str(ledger), *SMALL)
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


def test_non_private_run_uses_the_exact_statistics(sequences_dir, capsys):
  summary = _run(capsys, "--data", sequences_dir, "--epsilon", "inf", *SMALL)
  assert summary["model"] == "item2item" and summary["epsilon"] is None
  assert summary["item_pairs"]["private"] is False
  assert 0.0 <= summary["ndcg_at_10"] <= summary["hit_at_10"] <= 1.0


def test_the_model_reads_only_released_values(sequences_dir, monkeypatch):
  """Two data sets with the same released histogram and pairs give the same scores."""
  data = load_sequences(sequences_dir)
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


def _public_split(sequences_dir, fraction=0.3):
  data = load_sequences(sequences_dir)
  private, public = public_users.split(data, fraction)
  return make_examples(private, 8, True), make_examples(public, 8, True)


def test_public_users_enter_exactly_and_private_users_only_through_the_release(sequences_dir):
  """With a threshold no noisy cell reaches, the released matrix is exactly the public users'
  statistics: fails if public users were noised (thresholded away) or if a private user's pairs
  entered without noise."""
  examples, public = _public_split(sequences_dir)
  options = seqrec.SeqRecTrainOptions(model="item2item", max_len=8, pair_item_set=None,
                                      pair_threshold=1e6, public_users=0.3)
  plan = seqrec.plan_privacy(options, len(examples.items))
  p_i = np.linspace(0.1, 0.9, examples.num_items + 1)
  model, summary = item2item.build_model(options, examples, plan, p_i,
                                         np.random.default_rng(0), public)
  exact_public = item2item.pair_statistics(options, public)
  exact_private = item2item.pair_statistics(options, examples)
  assert (exact_private - exact_private.multiply(exact_public > 0)).nnz > 0  # private-only pairs
  assert summary["released_pairs"] == 0 and summary["public_pairs"] == exact_public.nnz
  np.testing.assert_allclose(model.matrix.toarray(), exact_public.toarray(), rtol=1e-6)
  # The popularity: the DP counts of the private users plus the public users' exact counts.
  counts = item2item.popularity(options, examples, p_i, public)
  np.testing.assert_allclose(counts, p_i * len(examples.items) + user_histogram.users_per_item(
      public.items[:, -item_frequencies.histogram_items(options):], examples.num_items))


def test_public_users_noise_covers_the_private_users_at_sensitivity_one(sequences_dir):
  """Without a threshold, released − public − private statistics is the Gaussian noise of the
  plan's σ on every cell (sensitivity 1: the private release is unchanged by the public users)."""
  examples, public = _public_split(sequences_dir)
  options = seqrec.SeqRecTrainOptions(model="item2item", max_len=8, pair_item_set=None,
                                      pair_threshold=-np.inf, public_users=0.3)
  plan = seqrec.plan_privacy(options, len(examples.items))
  model, _ = item2item.build_model(options, examples, plan, np.full(examples.num_items + 1, 0.5),
                                   np.random.default_rng(1), public)
  noise = (model.matrix - item2item.pair_statistics(options, public)
           - item2item.pair_statistics(options, examples)).toarray()[1:, 1:]
  noise = noise[~np.eye(examples.num_items, dtype=bool)]
  assert abs(noise.std() / (plan.noise_multiplier * item_pairs.SENSITIVITY) - 1) < 0.1


def test_public_users_are_not_charged(sequences_dir, tmp_path, capsys):
  """ε, δ = 1/N and σ are those of the private users alone; the summary names the public ones and
  evaluates the private users only."""
  examples, public = _public_split(sequences_dir)
  summary = _run(capsys, "--data", sequences_dir, "--epsilon", "5", "--public-users", "0.3",
                 "--ledger", str(tmp_path / "ledger.json"), *SMALL)
  assert summary["public_users"] == 0.3
  selection = summary["public_user_selection"]
  assert selection["users"] == 120 - selection["private_users"] > 0
  assert summary["train_examples"] == len(examples.items)
  assert summary["test_users"] == len(examples.test_items)
  assert summary["delta"] == 1.0 / len(examples.items)
  plan = seqrec.plan_privacy(seqrec.SeqRecTrainOptions(model="item2item"), len(examples.items))
  assert summary["noise_multiplier"] == plan.noise_multiplier
  assert 4.95 < summary["epsilon"] <= 5.0 + 1e-6
  assert "public_users" in summary["epsilon_covers"]


HYBRID = ["--model", "hybrid", "--epochs", "1", "--batch-size", "32", "--max-len", "8",
          "--dim", "8", "--blocks", "1", "--pair-item-set", "30", "--no-progress"]


def test_hybrid_epsilon_composes_histogram_pairs_and_training(sequences_dir, tmp_path, capsys,
                                                              check_composition):
  ledger = tmp_path / "ledger.json"
  summary = _run(capsys, "--data", sequences_dir, "--epsilon", "5", "--ledger", str(ledger),
                 *HYBRID)
  assert summary["model"] == "hybrid"
  histogram, pairs = summary["item_frequencies"], summary["item_pairs"]
  assert histogram["epsilon_share"] == 0.1 and pairs["epsilon_share"] == 0.3
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(pairs["noise_multiplier"]))
  assert abs(accountant.get_epsilon(summary["delta"]) - 0.3 * 5) <= 1e-3 * 1.5  # alone
  check_composition(summary, [pairs["noise_multiplier"], histogram["noise_multiplier"]])
  labels = {c["label"] for c in PrivacyLedger(str(ledger)).charges}
  assert labels == {item_frequencies.LABEL, item2item.LABEL, seqrec.LEDGER_LABEL}


def test_hybrid_item_rows_read_only_released_pairs(sequences_dir):
  """The factorisation is a function of the released matrix only (its top singular values, untouched
  items 0); the model's table takes the rows where given (scaled to the random rows' mean norm)
  and keeps its random rows elsewhere."""
  examples = make_examples(load_sequences(sequences_dir), 8, True)
  num_items = examples.num_items
  released = item_pairs.pair_statistics([np.array([1, 2, 3]), np.array([2, 3, 1, 4])], num_items)
  factors = Item2ItemModel(released, np.ones(num_items + 1)).item_factors(8)
  np.testing.assert_array_equal(factors, Item2ItemModel(released, np.arange(num_items + 1.0))
                                .item_factors(8))
  untouched = np.r_[0, 5:num_items + 1]
  assert not factors[untouched].any()
  symmetric = ((released + released.T) * 0.5).toarray()[1:5, 1:5]
  top = np.sort(np.linalg.svd(symmetric, compute_uv=False))[::-1][:3]  # rank min(d, 4 − 1)
  np.testing.assert_allclose(np.sort((factors ** 2).sum(axis=0))[::-1][:3], top, rtol=1e-5)
  options = seqrec.SeqRecTrainOptions(model="hybrid", max_len=8, dim=8, num_blocks=1,
                                      epsilon=float("inf"), batch_size=4)
  model = seqrec.build_model(options, examples, seqrec.plan_privacy(options, len(examples.items)))
  before = model.item_embedding.embeddings.numpy()
  seqrec.initialise_item_rows(model, factors)
  after = model.item_embedding.embeddings.numpy()
  np.testing.assert_array_equal(after[untouched], before[untouched])
  scale = after[1, 0] / factors[1, 0]
  np.testing.assert_allclose(after[1:5], factors[1:5] * scale, rtol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(after[1:5], axis=1).mean(),
                             np.linalg.norm(before[1:5], axis=1).mean(), rtol=1e-5)


def test_logit_prior_adds_the_released_pairs_score_and_reads_only_released_values(sequences_dir):
  """LogitPrior at w is the model's logits plus w·Σ_{k≤3} ½^(k−1)·S̃[h_k, j] (brute force over
  the dense matrix), the same for two models sharing the released matrix but not the
  popularity; `score_weights` gives every weight's scores from one pass."""
  examples = make_examples(load_sequences(sequences_dir), 8, True)
  num_items = examples.num_items
  released = item_pairs.pair_statistics([np.array([1, 2, 3]), np.array([2, 3, 1, 4])], num_items)
  options = seqrec.SeqRecTrainOptions(model="hybrid", max_len=8, dim=8, num_blocks=1,
                                      epsilon=float("inf"), batch_size=4)
  model = seqrec.build_model(options, examples, seqrec.plan_privacy(options, len(examples.items)))
  histories = np.array([[0, 0, 0, 0, 0, 1, 2, 3], [5, 6, 7, 8, 9, 4, 1, 2],
                        [0, 0, 0, 0, 0, 0, 0, 9], [3, 3, 3, 3, 3, 3, 2, 1]])
  logits = model.score_items(histories).numpy()
  dense = released.toarray()
  expected = np.stack([sum(0.5 ** k * dense[h, 1:] for k, h in enumerate(row[::-1][:3]))
                       for row in histories])
  assert expected.any()
  priors = [Item2ItemModel(released, np.ones(num_items + 1)),
            Item2ItemModel(released, np.arange(num_items + 1.0))]
  weights = [0.0, 0.5, 10.0]
  together = LogitPrior(model, priors[0]).score_weights(histories, weights)
  for weight, scores in zip(weights, together):
    alone = [LogitPrior(model, prior, weight).score_items(histories) for prior in priors]
    np.testing.assert_array_equal(alone[0], alone[1])
    np.testing.assert_array_equal(alone[0], scores)
    np.testing.assert_allclose(scores, logits + weight * expected, rtol=1e-5, atol=1e-5)


def test_hybrid_prior_weight_auto_is_the_best_candidate_on_validation(sequences_dir, capsys):
  summary = _run(capsys, "--data", sequences_dir, "--epsilon", "5", "--prior-weight", "auto",
                 "--no-pair-init", *HYBRID)
  prior = summary["logit_prior"]
  by_weight = prior["validation_by_weight"]
  assert set(by_weight) == {str(w) for w in seqrec.PRIOR_WEIGHTS}
  assert prior["selected_on"] == "validation" and summary["item_pairs"]["init"] is False
  best = max(m["ndcg_at_10"] for m in by_weight.values())
  assert by_weight[str(prior["weight"])]["ndcg_at_10"] == best
  assert summary["validation"]["ndcg_at_10"] == best
  assert prior["without_prior"]["validation"]["ndcg_at_10"] == by_weight["0.0"]["ndcg_at_10"]
  assert "prior" in summary["epsilon_covers"]["held_out_evaluation"]


def test_prior_weight_auto_needs_validation_items_and_the_hybrid(sequences_dir, capsys):
  assert cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "inf",
                   "--prior-weight", "auto", "--no-hold-out-validation", *HYBRID]) == 2
  assert "validation items" in capsys.readouterr().err
  assert cli.main([*TRAIN, "--data", sequences_dir, "--epsilon", "5", "--prior-weight",
                   "1", *SMALL]) == 2
  assert "--model hybrid's" in capsys.readouterr().err
