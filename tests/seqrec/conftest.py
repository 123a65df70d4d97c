"""Shared fixture of the `train seqrec` tests: a public item frequency file for the suite's tiny
synthetic sequences (`sequences_dir`, tests/conftest.py), and the check that a DP run's ε is
dp_accounting's composition of its releases."""
import dp_accounting
import numpy as np
import pytest

from dprec.data.sequences import load_sequences


@pytest.fixture(scope="session")
def frequency_file(sequences_dir, tmp_path_factory):
  """(path, p_1..p_M): public frequencies in [0.5, 1] (above 1/N, so used as they are) by
  original item id, with comments, a blank line and an id the data set does not hold."""
  data = load_sequences(sequences_dir)
  values = np.linspace(0.5, 1.0, data.num_items)
  lines = ["# public purchase shares", ""] + [
      f"{item}\t{float(value)!r}  # item {index}" for index, (item, value)
      in enumerate(zip(data.item_ids, values), start=1)] + ["not-in-the-data 0.5"]
  path = tmp_path_factory.mktemp("frequencies") / "p.txt"
  path.write_text("\n".join(lines) + "\n")
  return str(path), values


@pytest.fixture
def check_composition():
  """check(summary, sigmas): the summary's ε equals dp_accounting's PLD composition of a
  Gaussian mechanism per σ of `sigmas` and the summary's T Poisson-sampled steps, and is at most
  the budget of 5 (within 2%)."""

  def check(summary, sigmas):
    accountant = dp_accounting.pld.PLDAccountant()
    for sigma in sigmas:
      accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        summary["sampling_rate"], dp_accounting.GaussianDpEvent(summary["noise_multiplier"])),
        summary["steps"])
    direct = accountant.get_epsilon(summary["delta"])
    assert abs(summary["epsilon"] - direct) <= 1e-3 * direct
    assert 4.9 < summary["epsilon"] <= 5.0 + 1e-6

  return check
