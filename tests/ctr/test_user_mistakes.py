"""Common mistakes of a new user of `dprec train ctr` and `make_private` get errors that say what
happened and what to do (a new user's walk-through)."""
import json

import pytest

from dprec import cli
from dprec.errors import DprecError
from dprec.privacy.ledger import PrivacyLedger
from dprec.workflows import ctr
from dprec.workflows.ctr import CTRTrainOptions

pytestmark = pytest.mark.commands

ARGS = ["--batch-size", "64", "--steps", "4", "--hidden-units", "8", "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(criteo_days):
  return criteo_days(1500, 3)



def test_output_paths_in_missing_directories_are_created(data_dir, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_adafest", "--epsilon",
                   "1", "--ledger", "run/ledger.json", "--summary-json", "run/summary.json",
                   "--log-dir", "run/tb", *ARGS]) == 0
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["epsilon"] <= 1 + 1e-6
  assert (tmp_path / "run" / "ledger.json").exists() and (tmp_path / "run" / "tb").is_dir()


def test_a_changed_argument_on_a_run_dir_is_named_as_one(data_dir, tmp_path, capsys, cli_error):
  run = ["train", "ctr", "--data", data_dir, "--epsilon", "1", "--run-dir", str(tmp_path / "r"),
         *ARGS]
  assert cli.main(run + ["--algorithm", "dp_adafest"]) == 0
  capsys.readouterr()
  err = cli_error(run + ["--algorithm", "dp_sgd"])
  assert "an argument changed (not the ledger)" in err and "'train ctr dp_adafest'" in err
  assert "deleted or replaced" not in err
  err = cli_error(["train", "ctr", "--data", data_dir, "--epsilon", "2", "--run-dir",
                        str(tmp_path / "r"), "--algorithm", "dp_adafest", *ARGS])
  assert "the ledger has 1.0, this run asks for 2.0" in err
  assert "ask for 1.0" in err and "new --run-dir" in err


def test_a_dp_run_on_too_few_rows_says_what_to_expect(data_dir, tmp_path):
  with pytest.warns(ctr.SmallDataWarning, match=r"training rows at ε = 1: .* near chance"):
    assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd", "--epsilon",
                     "1", *ARGS]) == 0


def test_warnings_print_as_one_line():
  line = cli._format_warning("what to expect", UserWarning, "f.py", 1)
  assert line == "dprec: warning: what to expect\n"


@pytest.mark.parametrize("extra, named", [
    (dict(strategy="mirrored"), "--strategy mirrored"), (dict(secure_noise=True), "--secure-noise"),
    (dict(optimizer="adam"), "--optimizer adam")])
def test_train_ctr_refuses_what_lazy_noise_cannot_run_before_paying(extra, named):
  """`train ctr`'s options refuse them up front (the step's own refusal comes after the ledger
  is paid), naming only what is wrong."""
  options = CTRTrainOptions(data="days", algorithm="dp_sgd_lazy", epsilon=1.0,
                            **{"optimizer": "table_sgd", **extra})
  with pytest.raises(DprecError, match="dp_sgd_lazy cannot run with") as refusal:
    options.validate()
  others = {"--strategy", "--secure-noise", "--optimizer"} - {named.split()[0]}
  assert named in str(refusal.value) and not any(other in str(refusal.value) for other in others)
  CTRTrainOptions(data="days", algorithm="dp_sgd_lazy", epsilon=1.0,
                  optimizer="table_sgd").validate()


def test_lazy_noise_on_padded_stacked_tables_is_refused_before_paying(data_dir, tmp_path,
                                                                      cli_error):
  """Stacked tables with padding columns (known once the model is built) are refused before the
  ledger is charged (the step's own refusal comes at its first trace, after)."""
  ledger = tmp_path / "ledger.json"
  err = cli_error(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd_lazy",
                   "--optimizer", "table_sgd", "--epsilon", "1", "--stack-tables", "8",
                   "--ledger", str(ledger), *ARGS])
  assert "padding columns" in err and "--stack-tables 1" in err
  assert not ledger.exists() or not PrivacyLedger.read(ledger).charges


def test_a_private_run_without_a_table_learning_rate_gets_the_measured_rule():
  """`--optimizer table_sgd` without `--table-learning-rate`: η = B·(1 − μ)/(80·C2) in a private
  run (0.1 was 1,000× too small at 5M rows), the fixed default without DP, the user's if given."""
  def rate(**kwargs):
    return ctr.table_learning_rate(CTRTrainOptions(
        data="days", optimizer="table_sgd", batch_size=16384, **kwargs))
  assert rate(algorithm="dp_sgd_lazy", l2_norm_clip=1.0) == pytest.approx(204.8)
  assert rate(algorithm="dp_sgd_lazy", l2_norm_clip=2.0, momentum=0.9) == pytest.approx(10.24)
  assert rate(algorithm="non_private") == ctr.NON_PRIVATE_TABLE_LEARNING_RATE
  assert rate(algorithm="dp_sgd_lazy", table_learning_rate=3.0) == 3.0
