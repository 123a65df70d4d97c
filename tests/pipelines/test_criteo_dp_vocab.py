"""DP top-k vocabularies: exact top-k as ε → ∞, random at small ε, candidates = the whole id
domain (checked against the exponential mechanism's probabilities), and the ledger charge."""
import dataclasses
import json
import math

import numpy as np
import pytest

from dprec.data import criteo_tfrecord
from dprec.errors import BudgetExceededError
from dprec.errors import DprecError
from pipelines import criteo
from pipelines import criteo_vocabulary


def test_huge_epsilon_is_exact_top_k():
  ids = np.arange(100, 150, dtype=np.int64)
  counts = np.random.default_rng(0).permutation(50) + 1  # Distinct counts 1..50.
  exact = ids[np.argsort(-counts)[:7]]
  for seed in range(5):
    chosen = criteo_vocabulary.dp_top_k_ids(ids, counts, 7, 1e9, np.random.default_rng(seed))
    assert chosen.tolist() == exact.tolist()


def test_small_epsilon_selection_varies_across_seeds():
  ids = np.arange(1, 31, dtype=np.int64)
  counts = np.arange(30, 0, -1)
  selections = {tuple(criteo_vocabulary.dp_top_k_ids(ids, counts, 5, 0.5,
                                                     np.random.default_rng(seed), domain=64))
                for seed in range(20)}
  assert len(selections) > 10


def test_unseen_ids_compete_with_exponential_mechanism_probabilities():
  # k = 1 is one exponential-mechanism draw over the whole domain: P(i) ∝ exp(ε·count_i).
  ids, counts, domain, epsilon = np.array([1, 4]), np.array([2, 1]), 6, 1.0
  rng = np.random.default_rng(7)
  draws = np.array([criteo_vocabulary.dp_top_k_ids(ids, counts, 1, epsilon, rng, domain)[0]
                    for _ in range(6000)])
  weights = np.array([math.exp(epsilon * c) for c in [0, 2, 0, 0, 1, 0]])
  expected = weights / weights.sum()
  observed = np.bincount(draws, minlength=domain) / len(draws)
  tolerance = 4 * np.sqrt(expected * (1 - expected) / len(draws))
  assert np.all(np.abs(observed - expected) < tolerance), (observed, expected)


def _dp_job(tmp_path, epsilon, seed=0, delta=1e-6):
  return criteo.CriteoJob(
      inputs=(str(tmp_path / "day_0"),), output=str(tmp_path / f"out_{seed}"),
      vocab=criteo_vocabulary.VocabConfig(mode="dp_top_k", top_k=1, epsilon=epsilon,
                               insecure_noise_seed=seed),
      ledger=str(tmp_path / "ledger.json"), epsilon_budget=5.0, delta=delta)


@pytest.fixture
def day_0(tmp_path, criteo_line):
  rng = np.random.default_rng(1)
  lines = [criteo_line(rng.integers(0, 2), {0: rng.integers(0, 9)},
                       {f"C{j}": f"{rng.zipf(1.5) % 40:08x}" for j in range(1, 27)})
           for _ in range(600)]
  (tmp_path / "day_0").write_text("\n".join(lines) + "\n")


def test_pipeline_charges_the_ledger_and_refuses_over_budget(tmp_path, day_0, in_process):
  summary = criteo.run(_dp_job(tmp_path, 2.0), in_process)
  assert summary["privacy"]["epsilon_charged"] == pytest.approx(2.0)
  assert summary["privacy"]["epsilon_per_draw"] == [pytest.approx(2.0 / 26)] * 26
  with open(tmp_path / "ledger.json") as stream:
    ledger = json.load(stream)
  assert [c["epsilon"] for c in ledger["charges"]] == [pytest.approx(2.0)]
  vocab = criteo_tfrecord.load_vocabulary(str(tmp_path / "out_0"))
  assert vocab.sizes == (2,) * 26 and all(not c.any() for c in vocab.counts)  # No exact counts.
  manifest = criteo_tfrecord.load_manifest(str(tmp_path / "out_0"))
  dataset = {"path": str(tmp_path / "out_0"), "id": manifest["dataset_id"]}
  assert ledger["charges"][0]["dataset"] == summary["privacy"]["dataset"] == dataset
  assert ledger["charges"][0]["stage"] == "preprocessing"
  assert manifest["vocab_privacy"]["dp"]
  charged = ledger["charges"][0]["epsilon"]
  assert manifest["vocab_privacy"]["epsilon"] == pytest.approx(2.0) == charged
  # Seeded (public) draws: the charge and the manifest say the selection is not private.
  assert ledger["charges"][0]["private"] is False and not manifest["vocab_privacy"]["private"]
  # The same rows into another output are the same data set: its selection composes in this
  # ledger (not a fresh budget), and one over the budget is refused, nothing recorded.
  again = criteo.run(_dp_job(tmp_path, 1.0, seed=1), in_process)
  assert again["dataset_id"] == manifest["dataset_id"]
  assert again["privacy"]["epsilon_spent"] == pytest.approx(3.0)
  with pytest.raises(BudgetExceededError):
    criteo.run(dataclasses.replace(_dp_job(tmp_path, 2.5, seed=2)), in_process)
  with open(tmp_path / "ledger.json") as stream:
    assert len(json.load(stream)["charges"]) == 2
  assert not (tmp_path / "out_2" / "manifest.json").exists()
  # Other rows are another data set: refused in one short line that offers no fresh budget.
  (tmp_path / "day_0").write_text((tmp_path / "day_0").read_text() * 2)
  with pytest.raises(DprecError, match="holds charges for another data set") as error:
    criteo.run(_dp_job(tmp_path, 0.5, seed=3), in_process)
  message = str(error.value).replace(str(tmp_path), "")
  assert len(message) < 350 and "new" not in message


def test_a_selection_that_can_keep_nothing_is_refused_before_any_charge(tmp_path, day_0,
                                                                        in_process, capsys):
  """k = 1 at ε = 0.5 on 600 lines: noise scale 26k/ε = 52 puts the count a bucket needs to beat
  the 2^32 never-seen ids at 52·ln(2^32 − 600) ≈ 1,153, above the 600 any bucket can have: refused
  in one line with the fix, nothing charged or written. With 26 values where only some
  features are hopeless, a warning names them and the selection runs."""
  with pytest.raises(DprecError, match=r"^--vocab-mode dp_top_k would release nothing useful: "
                     r"a bucket needs a count above 1,153 .* more than the input's 600 lines; "
                     r"nothing charged; use --top-k-epsilon 0.961 or more at this k, or more "
                     r"rows$"):
    criteo.run(_dp_job(tmp_path, 0.5), in_process)
  assert not (tmp_path / "ledger.json").exists() and not (tmp_path / "out_0").exists()
  mixed = _dp_job(tmp_path, 4.0, delta=None)
  mixed = dataclasses.replace(mixed, vocab=dataclasses.replace(mixed.vocab, top_k=(1,) * 25 + (9,)))
  criteo.run(mixed, in_process)
  assert "warning: dp_top_k keeps nothing in C26 (their ε is spent for nothing)" in (
      capsys.readouterr().err)
  with open(tmp_path / "ledger.json") as stream:  # a new ledger's δ: 1/N, as training's
    assert json.load(stream)["delta"] == 1 / 600
