"""Fixtures of the `train ctr` tests."""
import pytest

from dprec import cli


@pytest.fixture
def cli_error(capsys):
  """`cli_error(argv)`: runs `dprec argv`, checks that it failed with one line (exit status 2, no
  traceback) and returns that line."""
  def run(argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err

  return run


@pytest.fixture(scope="session")
def user_days(tmp_path_factory):
  """Three tiny TSV days whose lines end with a user id (`synth criteo --users`): 1,500 rows of
  150 users; tests only read it."""
  from dprec.data import synthetic
  directory = str(tmp_path_factory.mktemp("criteo_users"))
  synthetic.generate_criteo(directory, rows=1500, days=3, seed=0, vocab="scaled:3k",
                            config=synthetic.CriteoSynthConfig(users=150), progress=False)
  return directory


@pytest.fixture(scope="session")
def user_level_epsilon():
  """`user_level_epsilon(summary, steps, k)`: the ε per user of a `train ctr --privacy-unit user`
  summary composed by dp_accounting directly (PLD, add or remove one): ULS the Poisson-sampled
  Gaussian at q over users, the releases Gaussians at σ per user; ELS each of a user's <= k rows
  joining a step at q (the mixture of Gaussians), the releases reading <= k rows of a user at σ
  on a row's sensitivity (the Gaussian at σ / k)."""
  import dp_accounting
  from scipy import stats

  from dprec.privacy import accounting

  def epsilon(summary, steps, k):
    q, sigma = summary["sampling_rate"], summary["sigma2"]
    if summary["sigma1"] is not None:
      sigma = accounting.composed_noise_multiplier(summary["sigma1"], summary["sigma2"])
    if summary["user_sampling"] == "users":
      step, group = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 1
    else:
      step, group = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
          sigma, [float(m) for m in range(k + 1)], list(stats.binom.pmf(range(k + 1), k, q))), k
    events = [dp_accounting.GaussianDpEvent(summary[name] / group)
              for name in ("base_rate_noise_multiplier", "calibration_noise_multiplier")]
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return accountant.compose(dp_accounting.ComposedDpEvent(
        events + [dp_accounting.SelfComposedDpEvent(step, steps)])).get_epsilon(summary["delta"])

  return epsilon
