"""StreamingTrainer with the stand-in model: budget stop, idle/resume, metrics outputs."""
import csv
import json
import os

import dp_accounting
import numpy as np
import pytest

from dprec.training.period_source import ArrayPeriodSource


def _pld_epsilon(sigma, q, steps, delta=1e-5):
  accountant = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
  accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                     steps)
  return accountant.get_epsilon(delta)


def _journal(run_dir):
  with open(os.path.join(run_dir, "steps.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_budget_stops_cleanly_before_the_period_that_would_exceed_it(tmp_path, standin):
  source = ArrayPeriodSource(standin.make_days(5))
  q, steps = 40 / 400, 10  # the stand-in plan: B = 40 of 400 examples per period, one epoch
  two, three = _pld_epsilon(2.0, q, 2 * steps), _pld_epsilon(2.0, q, 3 * steps)
  # A user's rows recur across periods: the periods compose sequentially.
  trainer = standin.make_trainer(str(tmp_path), (two + three) / 2, source, noise_multiplier=2.0,
                                 privacy_unit="user", examples_per_period=400)
  summary = trainer.run()
  assert [row["period"] for row in summary["periods"]] == [0, 1]
  assert "privacy budget" in summary["stopped"] and "period 2" in summary["stopped"]
  assert summary["epsilon"] == pytest.approx(two, rel=1e-6)
  assert summary["periods"][0]["epsilon_so_far"] == pytest.approx(
      _pld_epsilon(2.0, q, steps), rel=1e-6)
  assert summary["periods"][1]["auc"] is not None  # period 1's model was evaluated on period 2
  assert len(_journal(tmp_path)) == 2 * steps
  # Restarting does not train on: the stop is part of the checkpoint, the ledger is unchanged.
  ledger = (tmp_path / "ledger.json").read_text()
  trainer.run_state.close()  # the process ends: its run directory is free again
  again = standin.make_trainer(str(tmp_path), (two + three) / 2, source, noise_multiplier=2.0,
                               privacy_unit="user", examples_per_period=400)
  resumed = again.run()
  assert resumed["periods_trained"] == 2 and not resumed["trained_now"]
  assert "privacy budget" in resumed["stopped"]  # looked at again: still too costly
  assert (tmp_path / "ledger.json").read_text() == ledger


def test_an_idle_stream_resumes_when_periods_arrive_without_repeating_any(tmp_path, standin):
  days = standin.make_days(4)
  source = ArrayPeriodSource(days[:2])
  lines = []
  first = standin.make_trainer(str(tmp_path), 50.0, source, idle_timeout=0.05,
                               log=lines.append).run()
  assert "idle" in first["stopped"] and first["periods_trained"] == 2
  assert [line.split(":")[0] for line in lines] == [
      "period 0 (days 0)", "period 1 (days 1)", "waiting up to 0.05 s for period 2"]
  assert "AUC" in lines[1] and "epsilon so far" in lines[1]
  source.days.extend(days[2:])  # two more days land
  second = standin.make_trainer(str(tmp_path), 50.0, source).run()
  assert second["resumed"] and second["periods_trained"] == 4 and second["trained_now"]
  trained = [(r["period"], r["step"]) for r in _journal(tmp_path)]
  assert trained == [(p, s) for p in range(4) for s in range(10)]
  assert second["periods"][1]["auc"] is not None  # evaluated on period 2 once it arrived
  labels = [c["label"] for c in json.loads((tmp_path / "ledger.json").read_text())["charges"]]
  assert labels == [f"stream period {p}" for p in range(4)]


def test_per_period_metrics_csv_tensorboard_plot_and_holdout(tmp_path, standin):
  source = ArrayPeriodSource(standin.make_days(4), train_days=3)
  summary = standin.make_trainer(str(tmp_path), 50.0, source, train_periods=3).run()
  assert summary["stopped"] == "trained the 3 training periods"
  assert summary["holdout"]["days"] == [3] and 0 < summary["holdout"]["auc"] < 1
  rows = summary["periods"]
  assert [r["eval_period"] for r in rows] == [1, 2, 3]
  assert all(r["gradient_size_reduction"] >= 1 for r in rows)
  epsilons = [r["epsilon_so_far"] for r in rows]
  assert epsilons == sorted(epsilons) and epsilons[0] > 0
  assert [r["new_ids"] for r in rows] == [0, 2 * 3, 2 * 3]  # two new ids per feature per day
  with open(tmp_path / "metrics.csv") as f:
    table = list(csv.DictReader(f))
  assert [int(r["period"]) for r in table] == [0, 1, 2]
  assert float(table[2]["auc"]) == pytest.approx(rows[2]["auc"])
  assert (tmp_path / "auc_epsilon.png").read_bytes()[:4] == b"\x89PNG"
  assert json.loads((tmp_path / "summary.json").read_text())["periods"] == rows
  import tensorflow as tf
  tags = set()
  for event_file in tf.io.gfile.glob(str(tmp_path / "tensorboard" / "events.*")):
    for event in tf.compat.v1.train.summary_iterator(event_file):
      tags.update(v.tag for v in event.summary.value)
  assert {"stream/auc", "stream/epsilon_so_far", "stream/gradient_size_reduction"} <= tags


def test_new_ids_get_rows_and_unseen_ids_evaluate_as_oov(tmp_path, standin):
  source = ArrayPeriodSource(standin.make_days(3))
  trainer = standin.make_trainer(str(tmp_path), 50.0, source, train_periods=2)
  trainer.run()
  sizes = {name: int(t.shape[0]) for name, t in trainer.model.tables.items()}
  # day 1 brought ids up to 5 (6 rows); tables were allocated with headroom, never shrunk
  assert all(size >= 6 for size in sizes.values())
  assert trainer.state["vocab_sizes"] == {f"C{j + 1}": 6 for j in range(3)}
  features, _ = source.period(2).load()
  known = trainer._known_ids(features)["cat_features"]
  assert known.max() <= 5 and np.array_equal(known == 0, (features["cat_features"] == 0)
                                             | (features["cat_features"] > 5))


def test_a_shorter_period_trains_and_pays_proportionally_fewer_steps(tmp_path, standin):
  # Two-day periods over five days: the last period has one day, so half the plan's steps. A
  # period with fewer rows but all its days trains the full plan: step counts come from public
  # day counts, never from the exact (private) number of rows.
  days = standin.make_days(5)
  features, labels = days[2]
  days[2] = ({k: v[:200] for k, v in features.items()}, labels[:200])  # half a day
  source = ArrayPeriodSource(days, period_days=2, train_days=5)
  summary = standin.make_trainer(str(tmp_path), 50.0, source, train_periods=3).run()
  assert [r["steps"] for r in summary["periods"]] == [20, 20, 10]
  charges = json.loads((tmp_path / "ledger.json").read_text())["charges"]
  assert [c["steps"] for c in charges] == [20, 20, 10]
  assert {c["sampling_rate"] for c in charges} == {0.05}  # q fixed by the plan
