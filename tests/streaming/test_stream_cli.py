"""`dprec stream`: help, one-line errors for bad configurations and the privacy plan (no
training needed)."""
import json

import pytest

from dprec import cli
from dprec import privacy
from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CATEGORICAL_FEATURES
from dprec.privacy.ledger import PREPROCESSING
from dprec.training.period_source import BeamStreamSource
from dprec.workflows import ctr as ctr_workflow
from dprec.models import ctr
from dprec.workflows import result
from dprec.workflows import run as run_lib
from dprec.workflows import stream
from dprec.workflows import stream_options
from dprec.workflows.ctr import CTRTrainOptions


def test_help_names_the_interface(capsys):
  outs = {}
  for flag in ("--help", "--help-all"):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["stream", flag])
    assert exit_info.value.code == 0
    outs[flag] = capsys.readouterr().out
  for flag in ("--data", "--algorithm", "--epsilon", "--period-days", "--summary-json",
               "--train-days", "--top-k"):
    assert flag in outs["--help"]
  for flag in ("--checkpoint-every", "--insecure-noise-seed", "--secure-noise", "--diagnostics",
               "--calibration-level-prior-examples"):
    assert flag not in outs["--help"] and flag in outs["--help-all"]
  assert "table_sgd" not in outs["--help-all"]  # train ctr's alone: not offered, then refused


def test_table_sgd_is_not_offered(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["stream", "--data", "d", "--optimizer", "table_sgd"])
  assert exit_info.value.code == 2 and "invalid choice: 'table_sgd'" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--algorithm", "dp_sgd", "--train-days", "3"], "needs a positive --epsilon"),
    (["--algorithm", "dp_fest", "--epsilon", "1", "--train-days", "3"],
     "needs --top-k-per-feature"),
    (["--algorithm", "dp_fest", "--top-k-per-feature", "5", "--epsilon", "1", "--train-days", "3",
      "--privacy-unit", "user"], "cannot refresh a DP top-k set"),
    (["--algorithm", "dp_sgd", "--epsilon", "1", "--max-rows-per-user", "2"],
     "goes with --privacy-unit user"),
    (["--algorithm", "dp_sgd", "--epsilon", "1"], "no complete day yet; give --expected"),
    (["--algorithm", "dp_sgd", "--epsilon", "1", "--idle-timeout", "5"],
     "a live stream (--idle-timeout > 0) needs --expected-periods"),
    (["--algorithm", "dp_sgd", "--epsilon", "1", "--train-days", "3"],
     "no complete period yet"),
    (["--algorithm", "dp_sgd", "--epsilon", "1", "--train-days", "3",
      "--calibration-level-prior-examples", "-1"], "--calibration-level-prior-examples must be"),
])
def test_bad_configurations_are_one_line_errors(tmp_path, capsys, extra, message):
  code = cli.main(["stream", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run")] + extra)
  err = capsys.readouterr().err
  assert code == 2 and message in err and err.count("\n") == 1


def _criteo_output(directory, days=3, rows=300, dataset_id="stream-data"):
  """A preprocessing output's manifest (no TFRecords: planning reads only the manifest)."""
  directory.mkdir()
  manifest = {"format": criteo_tfrecord.FORMAT, "categorical_features": CATEGORICAL_FEATURES,
              "vocab_sizes": {name: 5 for name in CATEGORICAL_FEATURES}, "vocab_dir": "vocab",
              "days": [{"day": d, "dir": f"day_{d}", "files": [], "rows": rows}
                       for d in range(days)], identity.DATASET_ID: dataset_id}
  (directory / criteo_tfrecord.MANIFEST).write_text(json.dumps(manifest))
  return str(directory)


def test_the_plan_composes_what_the_ledger_spent_on_the_data_before(tmp_path):
  data, ledger = _criteo_output(tmp_path / "out"), str(tmp_path / "ledger.json")
  dataset = identity.dataset_identity(data)
  privacy.PrivacyLedger(ledger, 1.0, 1e-5, "rdp", run_id=dataset["id"], marks={
      "stage": PREPROCESSING, "dataset": dataset}).charge_pure(0.2, label="dp top-k vocabulary")
  options = stream_options.StreamOptions(
      data=data, run_dir=str(tmp_path / "run"), ledger=ledger, algorithm="dp_sgd",
      epsilon_total=1.0, train_days=2, batch_size=30, accountant="rdp", progress=False)
  source = BeamStreamSource(data, options.period_days, options.train_days)
  with run_lib.Run(stream.COMMAND, options.run_dir, ledger, data=data) as run:
    plan = stream.plan_privacy(options, source, 2, run)
    assert plan.delta == 1e-5 and plan.spent == privacy.Spent(selections=((0.2, 0.0),))
    # Rows: the costliest period (the first: its steps, DP base rate and DP Platt scaling)
    gaussian = privacy.gaussian_epsilon(
        [privacy.gaussian_mechanism_period(plan.mechanisms[stream.BASE_RATE]),
         privacy.gaussian_mechanism_period(plan.period_mechanisms[stream.CALIBRATION]),
         privacy.TrainingPeriod(plan.noise_multiplier, plan.sampling_rate,
                                plan.steps_per_period)], 1e-5, "rdp")
    assert gaussian == pytest.approx(0.8, rel=5e-3) and gaussian <= 0.8 + 1e-9
    assert plan.planned_epsilon() == pytest.approx(gaussian + 0.2, rel=1e-6)
    summary = stream.build_trainer(options, source, plan, run).summary()  # before any period
  assert summary["epsilon"] == pytest.approx(0.2) and summary["dataset"]["id"] == "stream-data"
  assert summary["epsilon_parts"]["preprocessing_selection"]["epsilon"] == 0.2


def test_the_step_defaults_are_train_ctrs_but_the_measured_overrides():
  """One source: every hyper-parameter of the model and its step defaults to `train ctr`'s (the
  learning rate its private default) but those of `STEP_OVERRIDES`; the batch is 1024, at most
  N/8, not `train ctr`'s N/150; DP Platt scaling's bound and priors are `train ctr`'s."""
  options = stream_options.StreamOptions(data="out", epsilon_total=1.0)
  model = options.model_options()
  assert {field: getattr(model, field) for field in stream_options.MODEL_FIELDS} == {
      field: stream_options.STEP_OVERRIDES.get(field, getattr(CTRTrainOptions, field))
      for field in stream_options.MODEL_FIELDS}
  assert set(stream_options.STEP_OVERRIDES) < set(stream_options.MODEL_FIELDS)
  assert (options.ratio, options.threshold) == (CTRTrainOptions.ratio, CTRTrainOptions.threshold)
  assert (options.calibration_logit_bound, options.calibration_prior_examples,
          options.calibration_level_prior_examples) == (
              privacy.recalibration.LOGIT_BOUND, privacy.recalibration.PRIOR_EXAMPLES, 0.0)
  assert ctr_workflow.learning_rate(model) == ctr_workflow.DEFAULT_LEARNING_RATES["private"]
  assert stream.default_batch_size(25_000) == 1024 != ctr_workflow.default_batch_size(25_000)
  assert stream.default_batch_size(4_000) == 500


def test_a_stream_worse_than_the_constant_at_the_held_out_rate_is_flagged(monkeypatch):
  """As `train ctr`: the summary's yardstick is the constant predictor at the click rate of the
  last period evaluated (the result line's, not the first period's DP rate the model starts
  from), and `stream.run` warns in one line when the model's log loss is worse."""
  periods = [{"eval_period": 1, "auc": 0.6, "log_loss": 0.55, "eval_base_rate": 0.25,
              "base_rate_log_loss": 0.58},
             {"eval_period": 2, "auc": 0.55, "log_loss": 0.57, "eval_base_rate": 0.25,
              "base_rate_log_loss": 0.58},
             {"auc": None, "eval_base_rate": None}]
  constant = ctr.log_loss_of_constant([0.25], 0.25)
  summary = {"algorithm": "dp_sgd", "periods_trained": 3, "periods": periods, "epsilon": 0.9,
             "epsilon_total": 1.0, "delta": 1e-6, **stream.last_evaluation(periods)}
  assert summary["eval_log_loss"] == 0.57 and summary["eval_base_rate"] == 0.25
  assert summary["base_rate_log_loss"] == pytest.approx(constant) and 0.55 < constant < 0.57
  assert summary["worse_than_base_rate"] is True
  assert f"log loss 0.5700 nats (constant at the held-out click rate: {constant:.4f})" in (
      result.stream(summary))
  assert stream.last_evaluation(periods[:1])["worse_than_base_rate"] is False
  assert stream.last_evaluation(periods[2:])["worse_than_base_rate"] is None
  monkeypatch.setattr(stream, "_run", lambda options: dict(summary))
  with pytest.warns(ctr_workflow.WorseThanBaseRateWarning,
                    match=f"held-out log loss 0.5700 is worse than {constant:.4f}"):
    stream.run(stream_options.StreamOptions(data="out", epsilon_total=1.0))
