"""Common mistakes of a new user of `dprec train ctr` and `make_private` get errors that say what
happened and what to do (issue 48's walk-through)."""
import json

import pytest

from dprec import cli
from dprec.errors import DprecError
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
  from dprec.workflows import ctr  # pylint: disable=import-outside-toplevel
  with pytest.warns(ctr.SmallDataWarning, match=r"training rows at ε = 1: .* near chance"):
    assert cli.main(["train", "ctr", "--data", data_dir, "--algorithm", "dp_sgd", "--epsilon",
                     "1", *ARGS]) == 0


def test_warnings_print_as_one_line():
  line = cli._format_warning("what to expect", UserWarning, "f.py", 1)  # pylint: disable=protected-access
  assert line == "dprec: warning: what to expect\n"


@pytest.mark.parametrize("extra", [dict(strategy="mirrored"), dict(secure_noise=True),
                                   dict(optimizer="adam")])
def test_train_ctr_refuses_what_lazy_noise_cannot_run_before_paying(extra):
  """`train ctr`'s options refuse them up front (the step's own refusal comes after the ledger
  is paid)."""
  options = CTRTrainOptions(data="days", algorithm="dp_sgd_lazy", epsilon=1.0,
                            **{"optimizer": "table_sgd", **extra})
  with pytest.raises(DprecError, match="dp_sgd_lazy runs on one device"):
    options.validate()
  CTRTrainOptions(data="days", algorithm="dp_sgd_lazy", epsilon=1.0,
                  optimizer="table_sgd").validate()
