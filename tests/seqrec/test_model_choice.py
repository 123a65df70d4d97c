"""`train seqrec --model auto`: a paid validation test chooses item2item on chain-ordered data
and the transformer (with the paper's schedule) on taste-ordered data; the run is one ledger
charge whose δ at ε is the union over the two branches, each dp_accounting's composition; the
validation test has sensitivity 1 and the noise it claims; item2item's top-up combines with
stage 1 to the noise inverse-variance weighting claims; a named model spends nothing on a
choice."""
import dataclasses
import json

import dp_accounting
import numpy as np
import pytest
import scipy.sparse

from dprec import cli, privacy
from dprec.data import synthetic
from dprec.data.sequences import SequenceData, make_examples
from dprec.errors import DprecError
from dprec.models.seqrec import warmup_linear_decay
from dprec.privacy import PrivacyLedger, item_pairs, user_histogram
from dprec.workflows import model_choice, seqrec

# Small and fast: the transformer branch trains one epoch of a one-block model.
FAST = dict(epsilon=5.0, epochs=1.0, dim=16, num_blocks=1, max_len=30, progress=False)


def _data(tmp_path, users, items, mean_length, **config):
  """A `dprec synth sequences` set split as the sequences job splits it (last item test, the
  one before validation)."""
  path = tmp_path / "seq.txt"
  synthetic.generate_sequences(str(path), users=users, items=items, seed=0, progress=False,
                               config=synthetic.SequenceSynthConfig(mean_length=mean_length,
                                                                    **config))
  pairs = np.loadtxt(path, dtype=np.int64).reshape(-1, 2)
  sequences = np.split(pairs[:, 1], np.flatnonzero(np.diff(pairs[:, 0])) + 1)
  counts = np.bincount(pairs[:, 1], minlength=items + 1).astype(np.float64)
  return SequenceData(users=np.arange(len(sequences)), train=[s[:-2] for s in sequences],
                      valid_items=np.array([s[-2] for s in sequences]),
                      test_items=np.array([s[-1] for s in sequences]),
                      item_frequencies=counts / counts.sum(), stats={}, item_ids=None)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  """Users walk item chains: the last item predicts the next (item2item ≫ most popular)."""
  return _data(tmp_path_factory.mktemp("chain"), users=300, items=100, mean_length=20)


@pytest.fixture(scope="module")
def taste(tmp_path_factory):
  """Items drawn from two favourite clusters (share 0.9) in random order: item2item below most
  popular. Smaller sets do not separate: at 300-600 users D is -3 to -14, one to three σ_t;
  here -28 to -40 over four draws, σ_t 5.3."""
  return _data(tmp_path_factory.mktemp("taste"), users=2000, items=500, mean_length=30,
               order="taste", taste_clusters=2, taste_share=0.9)


def _pld_delta(events, epsilon):
  accountant = dp_accounting.pld.PLDAccountant()
  for event, count in events:
    accountant.compose(event, count)
  return accountant.get_delta(epsilon)


def _check_union(summary, ledger_path):
  """The run's one charge is (ε, δ_A + δ_B), each branch's δ at ε dp_accounting's composition
  of its releases, each at most half the ledger's δ."""
  auto = summary["model_choice"]["privacy"]
  sigmas = auto["noise_multipliers"]
  ledger = PrivacyLedger(ledger_path)
  assert [(c["label"], c["epsilon"], c["delta"]) for c in ledger.charges] == [
      (model_choice.LABEL, auto["epsilon"], auto["delta"])]
  assert summary["epsilon"] == ledger.epsilon_spent() == auto["epsilon"] == 5.0
  assert summary["delta"] == ledger.delta
  # Branch A: five Gaussians, exactly one at 1/σ² = Σ 1/σ_k² (composed one by one, the PLD
  # grid's rounding differs a little).
  branch_a = list(sigmas["stage_1"].values()) + list(sigmas["top_up"].values())
  single = sum(s ** -2 for s in branch_a) ** -0.5
  delta_a = _pld_delta([(dp_accounting.GaussianDpEvent(single), 1)], 5.0)
  assert auto["delta_item2item_branch"] == pytest.approx(delta_a, rel=1e-6)
  assert _pld_delta([(dp_accounting.GaussianDpEvent(s), 1) for s in branch_a],
                    5.0) == pytest.approx(delta_a, rel=0.05)
  # Branch B: stage 1 (one Gaussian), the transformer's histogram and its Poisson-sampled steps.
  plan = auto["transformer_plan"]
  stage = sum(s ** -2 for s in sigmas["stage_1"].values()) ** -0.5
  delta_b = _pld_delta([
      (dp_accounting.GaussianDpEvent(stage), 1),
      (dp_accounting.GaussianDpEvent(plan["histogram_noise_multiplier"]), 1),
      (dp_accounting.PoissonSampledDpEvent(plan["sampling_rate"], dp_accounting.GaussianDpEvent(
          sigmas["transformer_steps"])), plan["steps"])], 5.0)
  assert auto["delta_transformer_branch"] == pytest.approx(delta_b, rel=1e-3)
  assert auto["delta"] == pytest.approx(delta_a + delta_b, rel=1e-3)
  for delta in (delta_a, delta_b):  # each planned at half the run's δ, and not far below
    assert 0.9 * ledger.delta / 2 < delta <= ledger.delta / 2


@pytest.mark.parametrize("kind, model", [("chain", "item2item"), ("taste", "dpformer")])
def test_auto_picks_the_better_model_by_the_paid_validation_test(kind, model, request, tmp_path):
  ledger = str(tmp_path / "ledger.json")
  summary = seqrec.run(seqrec.SeqRecTrainOptions(ledger=ledger, **FAST),
                       request.getfixturevalue(kind))
  choice = summary["model_choice"]
  assert summary["model"] == choice["model"] == model and choice["by"] == "--model auto"
  assert (choice["validation_difference"] > 0) == (model == "item2item")
  assert choice["test_noise_std"] == choice["privacy"]["noise_multipliers"]["stage_1"]["test"]
  assert choice["privacy"]["choice_share_of_pairs"] == 0.25
  _check_union(summary, ledger)
  if model == "dpformer":  # the paper's MovieLens schedule where the options were defaults
    assert choice["settings_applied"] == {"dropout": 0.2,
                                          "normalization_offset": 0.01}
    assert summary["noise_multiplier"] == choice["privacy"]["noise_multipliers"][
        "transformer_steps"]
  else:  # item2item at the combined noise of stage 1 and the top-up
    sigmas = choice["privacy"]["noise_multipliers"]
    combined = (sigmas["stage_1"]["pairs"] ** -2 + sigmas["top_up"]["pairs"] ** -2) ** -0.5
    assert summary["item_pairs"]["noise_multiplier"] == pytest.approx(combined)


def test_the_noise_multipliers_split_the_gaussian_budget_as_claimed(chain):
  examples = make_examples(chain, 30, True)
  n = len(examples.items)
  options = seqrec.SeqRecTrainOptions(batch_size=64, **FAST)
  auto = model_choice.plan(options, n, 1 / n, privacy.Spent(), seqrec.plan_model)
  mu = 1 / privacy.calibrate_gaussian_mechanism(5.0, 1 / n / 2)
  precision = lambda sigmas: sum(s ** -2 for s in sigmas)
  assert auto.stage["test"] == pytest.approx(1 / (mu * np.sqrt(model_choice.TEST_SHARE)))
  assert precision(list(auto.stage.values()) + list(auto.top_up.values())) == pytest.approx(
      mu ** 2)
  assert precision(auto.stage.values()) == pytest.approx(auto.stage_share * mu ** 2)
  # item2item gets all but the test, its histogram (whole, in stage 1) and pairs split as
  # `--model item2item` splits them, the pairs 0.25 in stage 1 and 0.75 in the top-up.
  alone = seqrec.plan_model(dataclasses.replace(options, model="item2item"), n, 1 / n / 2,
                            privacy.Spent())
  hist, pairs = alone.mechanisms["train seqrec item frequencies"], alone.noise_multiplier
  weight = hist ** -2 / (hist ** -2 + pairs ** -2)
  assert auto.histogram_share == pytest.approx(weight)
  assert precision([auto.stage["histogram"]]) == pytest.approx((1 - 0.02) * weight * mu ** 2)
  assert auto.stage["pairs"] ** -2 / auto.top_up["pairs"] ** -2 == pytest.approx(0.25 / 0.75)


def test_the_validation_difference_has_sensitivity_1_and_the_claimed_noise(chain):
  examples = make_examples(chain, 30, True)
  options = seqrec.SeqRecTrainOptions(batch_size=64, **FAST)
  auto = model_choice.plan(options, len(examples.items), 1 / len(examples.items),
                           privacy.Spent(), seqrec.plan_model)
  fixed = {purpose: 7 for purpose in model_choice.NOISE.values()}
  test_noise = np.random.default_rng(1)
  rng = lambda purpose: (test_noise if purpose == model_choice.NOISE["test"]
                         else np.random.default_rng(fixed[purpose]))
  # The released models fixed, each user moves D by at most 1 (brute force over users).
  stage = model_choice.stage_one(options, examples, auto, rng)
  resolved = dataclasses.replace(options, model="item2item")
  popularity = user_histogram.frequencies_of(stage.counts, len(examples.items)) * len(
      examples.items)
  model, _ = model_choice._model(resolved, stage.pairs, auto.stage["pairs"], popularity,
                                 stage.ids, examples.num_items)
  full, users = model_choice.validation_difference(model, popularity, examples, options)
  for user in range(0, users, 15):
    keep = np.arange(users) != user
    without = dataclasses.replace(examples, valid_histories=examples.valid_histories[keep],
                                  valid_items=examples.valid_items[keep])
    assert abs(full - model_choice.validation_difference(model, popularity, without,
                                                         options)[0]) <= 1 + 1e-9
  # The test's noise, measured from draws with the stage-1 releases fixed.
  draws = np.array([model_choice.stage_one(options, examples, auto, rng).difference
                    for _ in range(150)])
  assert abs(draws.std() / auto.stage["test"] - 1) < 0.25
  assert abs(draws.mean() - full) < 4 * auto.stage["test"] / np.sqrt(150)


def test_the_top_up_combines_to_the_inverse_variance_noise():
  """Stage 1 and the top-up of the same cells, combined: noise std 1/√(1/σ1² + 1/σ2²)."""
  rng, sigma1, sigma2 = np.random.default_rng(0), 3.0, 1.5
  clean = np.zeros((301, 301))
  clean[2, 3] = 5.0
  values, sigma = item_pairs.combine([
      (item_pairs.noisy_dense(scipy.sparse.csr_matrix(clean), sigma1, rng), sigma1),
      (item_pairs.noisy_dense(scipy.sparse.csr_matrix(clean), sigma2, rng), sigma2)])
  expected = (sigma1 ** -2 + sigma2 ** -2) ** -0.5
  assert sigma == pytest.approx(expected)
  noise = (values - clean)[1:, 1:][~np.eye(300, dtype=bool)]
  assert abs(noise.std() / expected - 1) < 4 / np.sqrt(2 * noise.size)
  assert abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)
  assert values[0].sum() == values[:, 0].sum() == np.trace(values) == 0  # padding, diagonal
  released = item_pairs.thresholded(values, sigma, 3 * sigma)
  assert released.matrix.min() == 0 and released.matrix.data.min() >= 3 * sigma
  counts = np.array([[1, 2], [2, 3]])
  combined, _ = item_pairs.combine([
      (user_histogram.noisy_users_per_item(counts, 3, sigma1, rng), sigma1),
      (user_histogram.noisy_users_per_item(counts, 3, sigma2, rng), sigma2)])
  assert combined[0] == 0 and combined.shape == (4,)


def test_a_ledger_spent_before_leaves_the_run_what_basic_composition_allows(tmp_path):
  ledger = PrivacyLedger(str(tmp_path / "ledger.json"), epsilon_budget=5.0, delta=1e-3)
  ledger.charge_gaussian(2.0, 0.1, 200, label="another run")
  ledger.charge_pure(0.2, label="vocabulary")
  epsilon, delta = model_choice.run_budget(5.0, 1e-3, ledger.spent_before("run"), "pld")
  assert delta == pytest.approx(0.5e-3) and 0 < epsilon < 4.8
  ledger.charge_approximate(epsilon, delta * (1 - 1e-9), label=model_choice.LABEL)
  assert ledger.epsilon_spent() <= 5.0 + 1e-9
  assert model_choice.run_budget(5.0, 1e-3, privacy.Spent(), "pld") == (5.0, 1e-3)


def test_without_dp_the_test_is_exact_and_nothing_is_charged(chain):
  summary = seqrec.run(seqrec.SeqRecTrainOptions(**dict(FAST, epsilon=float("inf"))), chain)
  choice = summary["model_choice"]
  assert summary["model"] == choice["model"] == "item2item" and not choice["private"]
  assert choice["test_noise_std"] is None and summary["epsilon"] is None


def test_auto_refuses_before_paying(chain, tmp_path):
  for options in (seqrec.SeqRecTrainOptions(public_users=0.1),  # item2item's only
                  seqrec.SeqRecTrainOptions(model_choice_share=1.0),
                  seqrec.SeqRecTrainOptions(pair_item_set=None)):
    with pytest.raises(DprecError):
      options.validate()
  no_validation = dataclasses.replace(chain, valid_items=np.zeros_like(chain.valid_items))
  ledger = tmp_path / "ledger.json"
  with pytest.raises(DprecError, match="validation items"):
    seqrec.run(seqrec.SeqRecTrainOptions(ledger=str(ledger), hold_out_validation=False,
                                         **FAST), no_validation)
  assert not ledger.exists() or not PrivacyLedger(str(ledger)).charges


def test_a_named_model_spends_nothing_on_a_choice(sequences_dir, capsys):
  assert cli.main(["train", "seqrec", "--data", sequences_dir, "--epsilon", "5", "--model",
                   "item2item", "--max-len", "8", "--pair-item-set", "30", "--no-progress",
                   "--summary-json", "-"]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["model_choice"] == {"model": "item2item", "by": "--model"}


def test_the_transformers_schedule_warms_up_over_a_fifth_then_decays_linearly():
  """Ding et al. 2023, §5: the learning rate rises over the first 20% of steps, then falls
  linearly to 0 (what `build_model` compiles for every transformer, auto's included)."""
  schedule = warmup_linear_decay(5e-3, 100)
  rates = np.array([float(schedule(step)) for step in range(100)])
  np.testing.assert_allclose(rates[[0, 9, 19, 59, 99]], 5e-3 * np.array([0.05, 0.5, 1, 0.5, 0]),
                             atol=1e-9)
  assert np.all(np.diff(rates[:20]) > 0) and np.all(np.diff(rates[19:]) < 0)
