"""`dprec train ctr --privacy-unit user` in memory: user-level sampling (ULS) and example-level
sampling with group privacy (ELS) end to end on tiny generated days with users, ε per user equal
to dp_accounting's, and the one-line refusals (nothing charged)."""
import dataclasses
import json
import os
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest

from dprec import cli
from dprec.data import ctr_data
from dprec.errors import DprecError
from dprec.privacy import PrivacyLedger
from dprec.privacy_unit import UNIT_KEY
from dprec.training import user_sampling
from dprec.workflows import ctr as ctr_workflow
from dprec.workflows import ctr_users
from dprec.workflows.ctr_options import CTRTrainOptions

pytestmark = pytest.mark.commands

STEPS, EPSILON, K = 4, 4.0, 3
# ELS's ε: small, so that its σ (per row, for k rows) keeps the mixture of Gaussians' PLD cheap
# (dp_accounting computes it point by point on its grid: minutes at σ near 1).
ELS_EPSILON = 0.05
needs_mixture = pytest.mark.skipif(
    not hasattr(dp_accounting.dp_event, "MixtureOfGaussiansDpEvent"),
    reason="dp-accounting < 0.4.4: no mixture of Gaussians PLD")


def _argv(data_dir, tmp_path, *extra, algorithm="dp_adafest", steps=STEPS, k=K,
          epsilon=EPSILON):
  return ["train", "ctr", "--data", data_dir, "--algorithm", algorithm, "--epsilon", str(epsilon),
          *(["--steps", str(steps)] if steps else []), "--hidden-units", "8", "--no-progress",
          "--summary-json", str(tmp_path / "summary.json"), "--ledger",
          str(tmp_path / "ledger.json"), "--privacy-unit", "user", "--max-rows-per-user", str(k),
          *extra]


def _train(data_dir, tmp_path, *extra, **kwargs):
  assert cli.main(_argv(data_dir, tmp_path, *extra, **kwargs)) == 0
  with open(tmp_path / "summary.json", encoding="utf-8") as stream:
    return json.load(stream)


@pytest.mark.parametrize("algorithm, extra", [("dp_adafest", ()), ("dp_sgd", ()),
                                              ("dp_fest", ("--top-k-total", "200",
                                                           "--top-k-epsilon", "0"))])
def test_user_level_sampling_spends_dp_accountings_epsilon_per_user(user_days, tmp_path,
                                                                    user_level_epsilon,
                                                                    algorithm, extra):
  summary = _train(user_days, tmp_path, "--batch-size", "16", *extra, algorithm=algorithm)
  users = len(np.unique(ctr_data.load_data(user_days, user_ids=True).train["user_id"]))
  assert summary["privacy_unit"] == "user" and summary["user_sampling"] == "users"
  assert summary["max_rows_per_user"] == K and summary["users"] == users
  assert summary["delta"] == pytest.approx(1.0 / users)
  assert summary["sampling_rate"] == pytest.approx(16 / users)
  assert summary["steps"] == STEPS and "user" in summary["epsilon_covers"]["epsilon"]
  # ULS: the sampled Gaussian at q over users; the releases are Gaussians at σ per user.
  assert summary["epsilon"] == pytest.approx(user_level_epsilon(summary, STEPS, K), rel=1e-3)
  assert 0.95 * EPSILON < summary["epsilon"] <= EPSILON * (1 + 1e-6)
  assert PrivacyLedger(str(tmp_path / "ledger.json")).unit == "user"
  assert 0.0 <= summary["auc"] <= 1.0


@needs_mixture
def test_example_level_sampling_is_accounted_as_a_group_of_k_rows(user_days, tmp_path,
                                                                  user_level_epsilon):
  summary = _train(user_days, tmp_path, "--user-sampling", "rows", "--batch-size", "16",
                   epsilon=ELS_EPSILON)
  train = ctr_data.load_data(user_days, user_ids=True).train
  counts = np.unique(train["user_id"], return_counts=True)[1]
  assert summary["user_sampling"] == "rows" and summary["users"] == len(counts)
  assert summary["bounded_rows"] == np.minimum(counts, K).sum() < len(train["label"])
  assert summary["sampling_rate"] == pytest.approx(16 / summary["bounded_rows"])
  assert summary["delta"] == pytest.approx(1.0 / len(counts))
  # Each of a user's <= k rows joins a step at q: the mixture of Gaussians; the releases read
  # <= k rows of a user at noise σ_row on a row's sensitivity: the Gaussian at σ_row / k.
  assert summary["epsilon"] == pytest.approx(user_level_epsilon(summary, STEPS, K), rel=1e-3)
  assert 0.95 * ELS_EPSILON < summary["epsilon"] <= ELS_EPSILON * (1 + 1e-6)
  charges = PrivacyLedger(str(tmp_path / "ledger.json")).charges
  assert all(c["unit"] == "user" and c["group_size"] == K for c in charges)


@pytest.mark.parametrize("users, bounded_rows, batch_size, steps", [
    (3925, 30407, 256, 119),  # ELS: 256 rows a batch, 119 steps (U/150 users: 64, 62 steps)
    (59248, 476446, 4096, 117),  # the 5M grid: ELS 4,096 rows, 117 steps (U/150: 512, 116)
    (100, 30407, 12, 119),  # B at most U/8 users
    (100, 200, 12, 9),  # one epoch of the users when that is longer (ELS: 25 rows, 8 steps)
])
def test_user_level_sampling_takes_example_level_samplings_plan_in_users(
    users, bounded_rows, batch_size, steps):
  """Without --batch-size and --steps, ULS samples as many users a batch as ELS samples rows (at
  most U/8) for as many steps as ELS (one epoch of the N_k bounded rows), or one epoch of the
  users if that is more; given values are kept."""
  options = CTRTrainOptions(data="d", epsilon=1.0, privacy_unit="user")
  uls = ctr_workflow.sized_for(options, users, bounded_rows)
  els = ctr_workflow.sized_for(dataclasses.replace(options, user_sampling="rows"), bounded_rows)
  assert (uls.batch_size, uls.steps) == (batch_size, steps)
  assert uls.batch_size == min(els.batch_size, users // 8)
  assert uls.steps == max(els.steps, -(-users // batch_size))
  given = dataclasses.replace(options, batch_size=8, steps=3)
  assert ctr_workflow.sized_for(given, users, bounded_rows).steps == 3


def test_a_user_level_run_without_steps_trains_example_level_samplings_steps(user_days,
                                                                             tmp_path):
  summary = _train(user_days, tmp_path, steps=None, k=16)
  counts = np.unique(ctr_data.load_data(user_days, user_ids=True).train["user_id"],
                     return_counts=True)[1]
  bounded = int(np.minimum(counts, 16).sum())
  els = ctr_workflow.sized_for(CTRTrainOptions(data="d"), bounded)
  assert summary["steps"] == els.steps > -(-len(counts) // summary["batch_size"])
  assert summary["bounded_rows"] == bounded and summary["steps_chosen"]


def test_user_level_batches_resume_where_an_uninterrupted_run_stands():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 40, 300)
  features = {"x": np.arange(300)[:, None].astype(np.float32)}
  labels = (np.arange(300) % 2).astype(np.int32)
  sampling = user_sampling.UserSampling(5, 2, entropy=7)  # tests only: a fixed entropy
  whole = list(ctr_users.user_level_batches(features, labels, ids, sampling, 6, 0))
  resumed = list(ctr_users.user_level_batches(features, labels, ids, sampling, 6, 4))
  assert len(resumed) == 2
  for (x, y), (x_whole, y_whole) in zip(resumed, whole[4:]):
    assert np.array_equal(y, y_whole) and np.array_equal(x[UNIT_KEY], x_whole[UNIT_KEY])


def test_held_out_user_ids_are_dropped_and_row_level_reads_user_columns(user_days):
  data = ctr_data.load_data(user_days)  # row level: the column is read and dropped
  assert "user_id" not in data.train and "user_id" not in data.eval
  users = ctr_data.load_data(user_days, user_ids=True)
  assert "user_id" in users.train and "user_id" not in users.eval


def _no_ledger(tmp_path):
  return not os.path.exists(tmp_path / "ledger.json")


def test_days_without_user_ids_are_refused_naming_the_file_line_and_field(criteo_days, tmp_path,
                                                                        cli_error):
  plain = criteo_days(600, 2)
  err = cli_error(_argv(plain, tmp_path))
  assert f"{plain}/day_0:1: field user_id: missing" in err and "--privacy-unit row" in err
  assert _no_ledger(tmp_path)


def test_a_user_id_that_is_not_an_integer_is_refused(user_days, tmp_path, cli_error):
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in ("day_0", "day_1"):
    with open(os.path.join(user_days, name), encoding="utf-8") as stream:
      lines = stream.read().splitlines()
    if name == "day_0":
      lines[2] = lines[2].rsplit("\t", 1)[0] + "\tabc"
    (bad / name).write_text("\n".join(lines[:200]) + "\n", encoding="utf-8")
  err = cli_error(_argv(str(bad), tmp_path))
  assert f"{bad}/day_0:3: field user_id: not a non-negative integer" in err
  assert "41st" in err and _no_ledger(tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"max_rows_per_user": 0}, "--max-rows-per-user 1 or more"),
    ({"privacy_unit": "row", "max_rows_per_user": 4}, "go with --privacy-unit user"),
    ({"privacy_unit": "row", "user_sampling": "rows"}, "go with --privacy-unit user"),
    ({"user_sampling": "groups"}, "--user-sampling must be one of users, rows"),
    ({"strategy": "mirrored"}, "--strategy mirrored: it trains on one device"),
    ({"algorithm": "non_private", "epsilon": None}, "training without DP protects no unit"),
    ({"algorithm": "dp_sgd_lazy", "optimizer": "table_sgd"}, "dp_sgd_lazy: its step clips per"),
    ({"algorithm": "dp_fest", "top_k": 100}, "--top-k-epsilon 0.1: its DP top-k counts"),
])
def test_what_the_user_level_path_cannot_run_is_refused_without_tensorflow(changes, message):
  options = CTRTrainOptions(**dict(dict(data="d", epsilon=1.0, privacy_unit="user"), **changes))
  with pytest.raises(DprecError) as error:
    options.validate()
  assert message in str(error.value)


def test_the_options_validate_without_loading_tensorflow():
  code = ("import sys; from dprec.workflows.ctr_options import CTRTrainOptions; "
          "CTRTrainOptions(data='d', epsilon=1.0, privacy_unit='user').validate(); "
          "print('tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
  assert out.stdout.strip() == "False"


def test_releases_read_k_rows_of_a_user_at_k_times_the_per_user_noise():
  """ULS: the plan's σ are per user, a release adds k·σ on a row's sensitivity; ELS: the plan's
  σ are per row already (k times the same per-user σ), charged converted for a group of k."""
  options = CTRTrainOptions(data="d", epsilon=0.01, privacy_unit="user",
                            max_rows_per_user=5, batch_size=10, steps=3)
  uls = ctr_workflow.plan_privacy(options, 1000, num_users=1000)
  per_user = uls.mechanisms[ctr_workflow.BASE_RATE_LABEL]
  assert ctr_workflow.release_noise_multiplier(uls, ctr_workflow.BASE_RATE_LABEL) == 5 * per_user
  els = ctr_workflow.plan_privacy(dataclasses.replace(options, user_sampling="rows"), 3000,
                                  num_users=1000)
  assert els.charge_fields == {"unit": "row", "group_size": 5}
  assert ctr_workflow.release_noise_multiplier(els, ctr_workflow.BASE_RATE_LABEL) == (
      els.mechanisms[ctr_workflow.BASE_RATE_LABEL]) == pytest.approx(5 * per_user)
