"""The pCTR model in a stream: tables grow for new ids and the DP-FEST set is refreshed per period
without losing what was learned (Ghazi et al., "Sparsity-Preserving Differentially Private Training
of Large Embedding Models", arXiv:2311.08357, §4.3 streaming-based frequency information)."""
import json

import numpy as np
import pytest

from dprec.models import ctr
from dprec.privacy import dp_platt_scaling
from dprec.training.period_source import ArrayPeriodSource
from dprec.training.stream_config import StreamConfig
from dprec.training.streaming import StreamingTrainer
from dprec.workflows.ctr import CTRTrainOptions
from dprec.workflows.plan import plan_stream
from dprec.workflows.run import Run
from dprec.workflows.stream import BASE_RATE, CALIBRATION, CTRPeriodModel

pytestmark = pytest.mark.commands


def _days(num_days=3, rows=300, seed=1):
  """Three categorical features whose ids grow from 6 to 6 + 12·day; 13 integer features."""
  rng = np.random.default_rng(seed)
  days = []
  for day in range(num_days):
    ids = rng.zipf(1.6, size=(rows, 3)) % (6 + 12 * day)
    ints = rng.normal(size=(rows, 13)).astype(np.float32)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-(ids[:, 0] % 2 + ints[:, 0] - 0.5))))
    days.append(({"cat_features": ids.astype(np.int32), "int_features": ints},
                 labels.astype(np.int32)))
  return days


class RecordingModel(CTRPeriodModel):
  """Records tables and Adagrad accumulators at every refresh of the row set."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.refreshes, self.dense_at_refresh = [], []

  def tables(self):
    """({table: rows}, {table: Adagrad accumulator}); Keras builds one accumulator per
    trainable variable, in order, after the `iterations` counter."""
    variables = [id(v) for v in self.model.trainable_variables]
    tables, slots = {}, {}
    for table in self.model.dp_tables:
      tables[table.table_name] = table.embeddings.numpy()
      index = variables.index(id(table.embeddings))
      slots[table.table_name] = self.optimizer.variables[1 + index].numpy()
    return tables, slots

  def dense(self):
    tables = {id(t.embeddings) for t in self.model.dp_tables}
    return [v.numpy() for v in self.model.trainable_variables if id(v) not in tables]

  def set_selected_rows(self, selected_rows):
    self.refreshes.append((selected_rows, self.tables()))
    self.dense_at_refresh.append(self.dense())
    super().set_selected_rows(selected_rows)


def test_refreshing_the_top_k_set_keeps_learned_rows(tmp_path):
  days = _days()
  source = ArrayPeriodSource(days, train_days=2)
  plan = plan_stream(50.0, 1e-5, expected_periods=2, examples_per_period=300, batch_size=30,
                     noise_multiplier=0.5, accountant="rdp")
  model = RecordingModel(CTRTrainOptions(data="", algorithm="dp_fest", optimizer="adagrad",
                                         hidden_units=(8,),
                                         learning_rate=0.5), plan.noise_multiplier, 30.0)
  ends = {}

  def progress(period, step, logs):
    del logs
    if step + 1 == plan.steps_per_period:
      ends[period] = model.tables()
      ends[f"dense {period}"] = model.dense()

  config = StreamConfig(top_k=3, train_periods=2, headroom=1.0)
  run = Run("stream", str(tmp_path))
  summary = StreamingTrainer(model, source, plan, config, run, progress=progress).run()
  assert summary["periods_trained"] == 2
  for before, after in zip(ends["dense 0"], model.dense_at_refresh[1]):  # dense layers carried
    np.testing.assert_array_equal(after, before)

  (first_rows, (initial, _)), (second_rows, (at_refresh, slots_at_refresh)) = model.refreshes
  for name, rows in first_rows.items():
    old, new = ends[0][0][name], at_refresh[name]
    assert new.shape[0] > old.shape[0], "day 1 brought new ids: the table must have grown"
    # Every learned row and its optimizer slot survive the refresh and the growth, bit for bit
    np.testing.assert_array_equal(new[:old.shape[0]], old)
    old_slot = ends[0][1][name]
    np.testing.assert_array_equal(slots_at_refresh[name][:old.shape[0]], old_slot)
    assert old_slot[rows].max() > old_slot.min(), "the selected rows' accumulators grew"
    # ... in particular the rows of buckets selected in both periods, which did learn.
    stay = np.intersect1d(rows, second_rows[name])
    assert stay.size > 0
    assert np.abs(old[stay] - initial[name][stay]).max() > 0
    # Rows outside the period-0 set were never updated (DP-FEST: frozen at initialisation).
    frozen = np.setdiff1d(np.arange(initial[name].shape[0]), rows)
    np.testing.assert_array_equal(old[frozen], initial[name][frozen])
    # Period 1 trains the new set only, continuing from the learned values.
    final = model.tables()[0][name]
    outside = np.setdiff1d(np.arange(final.shape[0]), second_rows[name])
    np.testing.assert_array_equal(final[outside], new[outside])
    assert np.abs(final[second_rows[name]] - new[second_rows[name]]).max() > 0


def test_base_rate_start_and_platt_scaling_on_the_output_only(tmp_path):
  """The first period starts the logit layer at the DP base rate; each period's DP Platt
  scaling (charged with it, on its days) is an affine on the output that evaluation applies and
  the next period's training does not see."""
  days = _days(num_days=3, rows=400)
  source = ArrayPeriodSource(days, train_days=2)
  plan = plan_stream(20.0, 1e-5, expected_periods=2, examples_per_period=400, batch_size=40,
                     noise_multiplier=1.0, mechanisms=[(BASE_RATE, 0.01)],
                     period_mechanisms=[(CALIBRATION, 0.1)])
  options = CTRTrainOptions(data="", algorithm="dp_sgd", hidden_units=(8,))
  model = CTRPeriodModel(options, plan.noise_multiplier, 40.0)
  logit_layer = {}
  original_before = model.before_training

  def before(features, labels, releases):
    released = original_before(features, labels, releases)
    logit_layer["start"] = (model.model.logit.kernel.numpy().copy(),
                            model.model.logit.bias.numpy().copy())
    return released

  model.before_training = before
  summary = StreamingTrainer(model, source, plan, StreamConfig(train_periods=2),
                             Run("stream", str(tmp_path))).run()
  kernel, bias = logit_layer["start"]
  rate = summary["periods"][0]["base_rate"]
  assert not kernel.any() and bias[0] == pytest.approx(np.log(rate / (1 - rate)))
  assert abs(rate - days[0][1].mean()) < 4 * plan.mechanisms[BASE_RATE] / 400  # DP: σ_b / N
  scale, shift = model.calibration.numpy()
  last = summary["periods"][-1]
  assert (scale, shift) == pytest.approx((last["calibration_scale"], last["calibration_shift"]))
  assert (scale, shift) != pytest.approx((1.0, 0.0))
  # Evaluation applies the affine to the raw logits; the logit layer itself is not rescaled.
  features, labels = days[2]
  raw = ctr.predict_logits(model.model, features)
  expected = np.mean(np.logaddexp(0, scale * raw + shift) - labels * (scale * raw + shift))
  assert model.evaluate(features, labels)["loss"] == pytest.approx(expected, rel=1e-5)
  row = summary["periods"][0]
  assert row["log_loss"] == row["eval_loss"] and row["base_rate_log_loss"] == pytest.approx(
      ctr.log_loss_of_constant(days[1][1], rate))
  charges = json.loads((tmp_path / "ledger.json").read_text())["charges"]
  assert {(c["label"], tuple(c["days"])) for c in charges if c["sampling_rate"] == 1} == {
      ("stream base rate", (0,)), ("stream period 0 calibration", (0,)),
      ("stream period 1 calibration", (1,))}


@pytest.mark.parametrize("level_prior_examples", [0.0, 1e5])
def test_platt_scaling_of_a_period_is_the_mechanism_with_the_streams_bound_centre_and_priors(
    level_prior_examples):
  """A period's calibration is `dp_platt_scaling` on its rows with the stream's L, centred on
  the base rate's logit, and the stream's priors (n0 on the affine, n1 on the level; σ_c = 0
  here: exact, comparable); the level prior moves it."""
  features, labels = _days(num_days=1, rows=400)[0]
  options = CTRTrainOptions(data="", algorithm="dp_sgd", hidden_units=(8,))
  model = CTRPeriodModel(options, 1.0, 40.0, calibration_logit_bound=1.0,
                         calibration_prior_examples=5000.0,
                         calibration_level_prior_examples=level_prior_examples)
  model.build({"t0": 20, "t1": 20, "t2": 20})
  model.base_rate.assign(0.3)
  released = model.after_training(features, labels, {CALIBRATION: (0.0, np.random.default_rng(0))})
  logits = ctr.predict_logits(model.model, features)
  center = np.log(0.3 / 0.7)
  expected = dp_platt_scaling(logits, labels, 0.0, 0.3, logit_bound=1.0, center=center,
                              prior_examples=5000.0, level_prior_examples=level_prior_examples)
  assert (released["calibration_scale"], released["calibration_shift"]) == pytest.approx(expected)
  other = dp_platt_scaling(logits, labels, 0.0, 0.3, logit_bound=1.0, center=center,
                           prior_examples=5000.0, level_prior_examples=1e5 - level_prior_examples)
  assert expected != pytest.approx(other)
