"""An algorithm is one object: the DP step asks it for its rows, the workflows for its noise split,
its construction and whether it needs rows drawn before training, the audit for its claim."""
import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf

from dprec.audit import white_box
from dprec.optimizers import DPFEST, DPSGD, DPOptimizer, SparseSGD
from dprec.optimizers import config as config_lib
from dprec.sparse import kept_rows as kept_rows_lib
from dprec.workflows import ctr
from dprec.workflows import private_options

SIGMA = 0.8
OPTIONS = types.SimpleNamespace(l2_norm_clip=1.5, ratio=2.0, contribution_clip=1.0,
                                threshold=3.0)
FEST_ROWS = {"a0": [0, 2, 3], "a1": [4], "m": [1, 2, 5]}


@pytest.mark.parametrize("name", list(config_lib.ALGORITHMS))
def test_from_plan_is_accounted_at_the_planned_sigma(name):
  algorithm = config_lib.ALGORITHMS[name]
  config = algorithm.from_plan(SIGMA, OPTIONS, FEST_ROWS if algorithm.preselected else None)
  assert type(config) is algorithm and config.name == name
  assert config_lib.is_private(config) == algorithm.private
  if not algorithm.private:
    assert config.accounting_noise_multiplier is None
    assert algorithm.split_noise(SIGMA, OPTIONS.ratio) == (None, None)
    return
  assert config.accounting_noise_multiplier == pytest.approx(SIGMA)
  assert config.l2_norm_clip == OPTIONS.l2_norm_clip
  sigma1, sigma2 = algorithm.split_noise(SIGMA, OPTIONS.ratio)
  assert config.noise_multiplier == sigma2
  assert getattr(config, "contribution_noise_multiplier", None) == sigma1
  if sigma1 is not None:
    assert sigma1 == pytest.approx(OPTIONS.ratio * sigma2)
  assert (config_lib.fixed_rows(config) is not None) == algorithm.preselected


def test_the_workflows_lists_come_from_the_algorithms():
  assert ctr.ALGORITHMS == tuple(config_lib.ALGORITHMS)
  assert set(ctr.FEST_ALGORITHMS) == {"dp_fest", "dp_adafest_plus"}
  assert private_options.ALGORITHMS == ("auto", "dp_sgd", "dp_sgd_lazy", "dp_adafest")


def test_the_audit_claim_is_the_algorithms():
  adafest = config_lib.DPAdaFEST(1.0, 1.0, contribution_clip=1.0,
                                 contribution_noise_multiplier=2.0, threshold=3.0)
  claim = white_box.Claim.of(adafest, 0.1)
  # Ψ((τ − 1)/(σ1·C1)) with and Ψ(τ/(σ1·C1)) without the canary's one contribution.
  assert claim.keep_in == pytest.approx(0.158655, abs=1e-5)
  assert claim.keep_out == pytest.approx(0.066807, abs=1e-5)
  assert white_box.Claim.of(config_lib.NonPrivate(), 0.1) == white_box.Claim(0.1, 0.0)
  assert white_box.Claim.of(DPSGD(1.0, 2.0), 0.1) == white_box.Claim(0.1, 2.0)


@dataclasses.dataclass(frozen=True)
class _FixedByMethod(DPSGD):
  """A new algorithm defined outside `dprec.optimizers.config`: DP-SGD whose rows are a fixed
  set, chosen by its own `kept_rows` alone."""
  rows: tuple = ()

  def kept_rows(self, layout, pairs, batch_size, generator, replicas=None):
    return kept_rows_lib.fixed_set_rows(layout, dict(self.rows), pairs)


def _step(lib, config):
  model = lib.build_model()
  model.compile(DPOptimizer(config, SparseSGD(0.1), insecure_noise_seed=3), loss=lib.loss)
  x, y = lib.make_batch()
  return [(v.name, tf.convert_to_tensor(g).numpy()) for g, v in model.dp_gradients(x, y)]


def test_the_step_takes_its_rows_and_noise_from_the_object(lib):
  """An algorithm's own `kept_rows` decides the update's rows and where the noise goes: a
  subclass selecting DP-FEST's rows steps exactly as DP-FEST (same key), not as DP-SGD."""
  rows = tuple((name, np.asarray(ids)) for name, ids in FEST_ROWS.items())
  got = _step(lib, _FixedByMethod(1.0, 0.5, rows=rows))
  fest = _step(lib, DPFEST(1.0, 0.5, selected_rows=FEST_ROWS))
  sgd = _step(lib, DPSGD(1.0, 0.5))
  assert len(got) == len(fest) == len(sgd)
  for (_, grad), (_, expected) in zip(got, fest):
    np.testing.assert_array_equal(grad, expected)
  table = [name for name, _ in got].index("m/embeddings:0")
  untouched = np.setdiff1d(np.arange(lib.vocabs["m"]), FEST_ROWS["m"])
  assert not np.any(got[table][1][untouched]) and np.all(sgd[table][1][untouched] != 0)
