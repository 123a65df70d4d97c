"""The secret noise key, the DP optimizer's default randomness and the shared `Run`."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.optimizers.config import DPSGD
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.privacy.noise_key import InsecureNoiseWarning
from dprec.privacy.noise_key import NoiseKey
from dprec.workflows.run import Run


def test_fresh_keys_differ_and_derived_streams_are_independent_and_repeatable():
  first, second = NoiseKey.fresh(), NoiseKey.fresh()
  assert first.key_bytes() != second.key_bytes() and first.private
  assert first.derive("noise", 1) == first.derive("noise", 1) != first.derive("noise", 2)
  assert first.derive("noise", 1) != first.derive("poisson", 1)
  assert first.derive("noise", 1) != second.derive("noise", 1)
  assert len(set(first.tf_state("noise", 3).tolist())) == 3  # 192 derived bits of Philox state
  generator = first.tf_generator("noise", 0)
  draw = generator.normal([4]).numpy()
  first.reset(generator, "noise", 0)
  np.testing.assert_array_equal(generator.normal([4]).numpy(), draw)
  assert repr(first) == "NoiseKey(secret)" and first.key_bytes().hex() not in repr(first)


def test_an_insecure_key_is_deterministic_flagged_and_warns():
  with pytest.warns(InsecureNoiseWarning, match="NOT differentially private"):
    key = NoiseKey.insecure(3)
  with pytest.warns(InsecureNoiseWarning):
    again = NoiseKey.insecure(3)
  assert key.key_bytes() == again.key_bytes() and not key.private
  assert "--insecure-noise-seed 3" in key.note


def _noise(optimizer):
  return optimizer.generator.normal([3]).numpy()


def test_dp_optimizer_noise_is_secret_unless_flagged():
  plain = [DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1)) for _ in range(2)]
  assert all(o.private and o.privacy_note is None for o in plain)
  assert not np.array_equal(_noise(plain[0]), _noise(plain[1]))
  with pytest.raises(TypeError):
    DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1), seed=0)  # no silent seeding
  with pytest.warns(InsecureNoiseWarning):
    seeded = [DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1), insecure_noise_seed=3)
              for _ in range(2)]
  np.testing.assert_array_equal(_noise(seeded[0]), _noise(seeded[1]))
  assert not seeded[0].private
  with pytest.warns(InsecureNoiseWarning, match="caller-supplied"):
    given = DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1),
                        generator=tf.random.Generator.from_seed(1))
  assert not given.private
  with pytest.raises(ValueError, match="at most one"):
    DPOptimizer(DPSGD(1.0, 1.0), tf.keras.optimizers.SGD(0.1), noise_key=NoiseKey.fresh(),
                insecure_noise_seed=3)
  assert "secret" in repr(NoiseKey.fresh()) and "noise_key" not in repr(plain[0])


def test_run_keeps_its_id_and_key_and_refuses_a_changed_noise_setting(tmp_path):
  with Run("train ctr", str(tmp_path)) as run:
    key, run_id = run.key.key_bytes(), run.run_id
  assert os.stat(tmp_path / "secret" / "noise_key").st_mode & 0o777 == 0o600
  info = json.loads((tmp_path / "run.json").read_text())
  assert info["run_id"] == run_id and key.hex() not in (tmp_path / "run.json").read_text()
  with Run("train ctr", str(tmp_path)) as resumed:
    assert resumed.run_id == run_id and resumed.key.key_bytes() == key
  with pytest.raises(DprecError, match="insecure_noise_seed"):
    Run("train ctr", str(tmp_path), insecure_noise_seed=3)
  with pytest.raises(DprecError, match="belongs to `train ctr`"):
    Run("stream", str(tmp_path))
  os.remove(tmp_path / "secret" / "noise_key")
  with pytest.raises(DprecError, match="secret noise key is missing"):
    Run("train ctr", str(tmp_path))


def test_a_run_counts_only_its_own_charges(tmp_path):
  ledger_path = str(tmp_path / "ledger.json")
  with Run("stream", str(tmp_path / "a"), ledger_path) as first, \
      Run("stream", str(tmp_path / "b"), ledger_path) as second:
    ledger = first.budget.open_ledger(10.0, 1e-5, "rdp")
    ledger.charge_gaussian(1.0, 0.1, 5, label="stream period 0")
    assert first.budget.paid("stream period 0")
    assert first.budget.steps_paid("stream period 0") == 5
    theirs = second.budget.open_ledger(10.0, 1e-5, "rdp")
    assert not second.budget.paid("stream period 0")
    assert second.budget.steps_paid("stream period 0") == 0
    theirs.charge_gaussian(1.0, 0.1, 5, label="stream period 0")
    assert [c["run_id"] for c in theirs.charges] == [first.run_id, second.run_id]
  assert not os.path.exists(tmp_path / "secret")  # nothing outside the run directories
