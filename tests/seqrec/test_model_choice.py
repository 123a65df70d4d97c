"""`train seqrec --model auto`: the rule picks item2item on short, sparse histories and the
transformer (with the paper's schedule) on long ones over few items; its one statistic is
released at the noise it claims, charged under its own ledger label as an (ε0, δ0) release and
composed with the chosen model's releases by basic composition; a named model spends nothing on
a choice."""
import json

import dp_accounting
import numpy as np
import pytest

from dprec import cli, privacy
from dprec.data import synthetic
from dprec.data.sequences import SequenceData, make_examples
from dprec.errors import DprecError
from dprec.models.seqrec import warmup_linear_decay
from dprec.privacy import PrivacyLedger
from dprec.workflows import item2item, item_frequencies, model_choice, seqrec

# The two shapes measured at ε = 5 (docs/guide/seqrec.md, "Which model"): Amazon Games and
# MovieLens-100k after 5-core (p near the cap L = 50).
AMAZON = dict(mean_positions=6.9, num_users=31_000, num_items=23_700)
MOVIELENS = dict(mean_positions=45.0, num_users=943, num_items=1_349)


def _examples(tmp_path, users, items, mean_length, max_len=50):
  """`train seqrec`'s examples of a `dprec synth sequences` file (last item test, the one
  before validation, as the sequences job splits them)."""
  path = tmp_path / f"seq_{users}_{items}_{mean_length}.txt"
  synthetic.generate_sequences(str(path), users=users, items=items, seed=0,
                               config=synthetic.SequenceSynthConfig(mean_length=mean_length),
                               progress=False)
  pairs = np.loadtxt(path, dtype=np.int64).reshape(-1, 2)
  sequences = np.split(pairs[:, 1], np.flatnonzero(np.diff(pairs[:, 0])) + 1)
  counts = np.bincount(pairs[:, 1], minlength=items + 1).astype(np.float64)
  data = SequenceData(users=np.arange(len(sequences)), train=[s[:-2] for s in sequences],
                      valid_items=np.array([s[-2] for s in sequences]),
                      test_items=np.array([s[-1] for s in sequences]),
                      item_frequencies=counts / counts.sum(), stats={}, item_ids=None)
  return make_examples(data, max_len, hold_out_validation=True)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
  """Amazon-like: short histories over many items."""
  return _examples(tmp_path_factory.mktemp("sparse"), users=400, items=1500, mean_length=9)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
  """MovieLens-like: long histories over few items."""
  return _examples(tmp_path_factory.mktemp("dense"), users=400, items=150, mean_length=80)


def test_rule_picks_item2item_on_amazon_and_the_transformer_on_movielens():
  assert model_choice.choose(**AMAZON)[0] == "item2item"
  assert model_choice.choose(**MOVIELENS)[0] == "dpformer"
  # Long histories over too many items, and short ones over few, stay with item2item.
  assert model_choice.choose(45.0, 943, 100_000)[0] == "item2item"
  assert model_choice.choose(8.0, 100_000, 100)[0] == "item2item"


@pytest.mark.parametrize("shape, model", [("sparse", "item2item"), ("dense", "dpformer")])
def test_auto_chooses_the_model_each_synthetic_shape_calls_for(shape, model, request):
  examples = request.getfixturevalue(shape)
  options = seqrec.SeqRecTrainOptions(epsilon=5.0)
  resolved, choice = model_choice.resolve(options, examples, 1 / len(examples.items),
                                          np.random.default_rng(0))
  assert resolved.model == choice["model"] == model and resolved.auto_model
  assert choice["ledger_label"] == model_choice.LABEL and choice["epsilon_share"] == 0.02
  assert (choice["epsilon"], choice["delta"]) == (0.1, 0.02 / len(examples.items))
  assert choice["noise_multiplier"] == privacy.calibrate_gaussian_mechanism(0.1, choice["delta"])
  exact = model_choice.scored_positions(examples).mean()
  assert abs(choice["mean_scored_positions"] - exact) < 5 * (
      choice["noise_multiplier"] * choice["sensitivity"] / len(examples.items))
  if model == "dpformer":  # the paper's MovieLens schedule where the options were defaults
    assert (resolved.epochs, resolved.dropout, resolved.normalization_offset,
            resolved.learning_rate) == (100.0, 0.2, 0.01, 5e-3)
    assert choice["settings_applied"] == {"dropout": 0.2, "normalization_offset": 0.01}
    given = seqrec.SeqRecTrainOptions(epsilon=5.0, dropout=0.3, epochs=20)
    kept, _ = model_choice.resolve(given, examples, 1 / len(examples.items),
                                   np.random.default_rng(0))
    assert (kept.model, kept.dropout, kept.epochs) == ("dpformer", 0.3, 20)
  else:
    assert choice["settings_applied"] == {} and resolved.dropout == options.dropout
  exact_run = seqrec.SeqRecTrainOptions(epsilon=float("inf"))  # the exact mean, charged nothing
  exact_resolved, exact_choice = model_choice.resolve(exact_run, examples, None,
                                                      np.random.default_rng(0))
  assert exact_choice["mean_scored_positions"] == pytest.approx(exact)
  assert exact_choice["model"] == model and exact_choice["noise_multiplier"] is None
  assert model_choice.selections(exact_resolved, 0.01) == {}


def test_release_noise_has_the_claimed_scale_and_bounded_contributions(dense):
  positions = model_choice.scored_positions(dense)
  assert positions.min() >= 1 and positions.max() <= 50  # in [0, L]: sensitivity L/2
  rng, sigma, n = np.random.default_rng(1), 3.0, len(dense.items)
  released = [model_choice.release(dense, 50, sigma, rng) for _ in range(4000)]
  expected = sigma * 25 / n
  assert abs(np.std(released) / expected - 1) < 0.05
  assert abs(np.mean(released) - positions.mean()) < 4 * expected / np.sqrt(4000)


def _epsilon(choice, delta, mechanism_sigmas, plan=None):
  """ε0 of the choice plus dp_accounting's PLD composition of the Gaussian mechanisms (and the
  plan's Poisson-sampled steps) at δ − δ0: basic composition of the choice with the rest."""
  accountant = dp_accounting.pld.PLDAccountant()
  for sigma in mechanism_sigmas:
    accountant.compose(dp_accounting.GaussianDpEvent(sigma))
  if plan is not None:
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        plan.sampling_rate, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), plan.steps)
  return choice["epsilon"] + accountant.get_epsilon(delta - choice["delta"])


def test_the_chosen_transformers_plan_composes_the_choice_with_its_releases(dense):
  n = len(dense.items)
  options = seqrec.SeqRecTrainOptions(epsilon=5.0, batch_size=100, epochs=5)
  resolved, choice = model_choice.resolve(options, dense, 1 / n, np.random.default_rng(0))
  plan = seqrec.plan_privacy(resolved, n)
  assert set(plan.mechanisms) == {item_frequencies.LABEL}
  assert plan.spent.selections == ((choice["epsilon"], choice["delta"]),)
  direct = _epsilon(choice, plan.delta, plan.mechanisms.values(), plan)
  assert abs(plan.planned_epsilon() - direct) <= 1e-3 * direct and 4.95 < direct <= 5.0 + 1e-6
  with pytest.raises(DprecError, match="resolved before planning"):
    seqrec.plan_privacy(options, n)  # an unresolved choice has no plan
  named = seqrec.plan_privacy(seqrec.SeqRecTrainOptions(model="dpformer", epsilon=5.0,
                                                        batch_size=100, epochs=5), n)
  assert not named.spent  # a named model: no choice charged
  assert named.noise_multiplier < plan.noise_multiplier


def test_auto_refuses_what_either_model_would_before_releasing(dense):
  for options in (seqrec.SeqRecTrainOptions(public_users=0.1),  # item2item's only
                  seqrec.SeqRecTrainOptions(model_choice_share=1.0)):
    with pytest.raises(DprecError):
      options.validate()


@pytest.mark.commands
def test_auto_end_to_end_charges_the_choice_under_its_own_label(sequences_dir, tmp_path, capsys):
  """Short histories (L = 8): item2item, with ε the composition of the choice, the histogram
  and the pair release, each its own ledger entry."""
  ledger = tmp_path / "ledger.json"
  assert cli.main(["train", "seqrec", "--data", sequences_dir, "--epsilon", "5", "--ledger",
                   str(ledger), "--max-len", "8", "--pair-item-set", "30", "--no-progress",
                   "--summary-json", "-"]) == 0
  summary = json.loads(capsys.readouterr().out)
  choice = summary["model_choice"]
  assert summary["model"] == choice["model"] == "item2item" and choice["by"] == "--model auto"
  assert choice["public"] == {"train_examples": summary["train_examples"],
                              "items": summary["items"], "max_len": 8}
  charges = {c["label"]: c for c in PrivacyLedger(str(ledger)).charges}
  assert set(charges) == {model_choice.LABEL, item_frequencies.LABEL, item2item.LABEL}
  assert (charges[model_choice.LABEL]["epsilon"], charges[model_choice.LABEL]["delta"]) == (
      choice["epsilon"], choice["delta"]) == (0.1, 0.02 * summary["delta"])
  direct = _epsilon(choice, summary["delta"], (summary["item_frequencies"]["noise_multiplier"],
                                               summary["noise_multiplier"]))
  assert abs(summary["epsilon"] - direct) <= 1e-3 * direct
  assert 4.95 < summary["epsilon"] <= 5.0 + 1e-6


def test_the_transformers_schedule_warms_up_over_a_fifth_then_decays_linearly():
  """Ding et al. 2023, §5: the learning rate rises over the first 20% of steps, then falls
  linearly to 0 (what `build_model` compiles for every transformer, auto's included)."""
  schedule = warmup_linear_decay(5e-3, 100)
  rates = np.array([float(schedule(step)) for step in range(100)])
  np.testing.assert_allclose(rates[[0, 9, 19, 59, 99]], 5e-3 * np.array([0.05, 0.5, 1, 0.5, 0]),
                             atol=1e-9)
  assert np.all(np.diff(rates[:20]) > 0) and np.all(np.diff(rates[19:]) < 0)
