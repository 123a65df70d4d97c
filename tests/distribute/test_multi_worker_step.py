"""The DP step under MultiWorkerMirroredStrategy, 2 worker processes on localhost (TF_CONFIG),
equals the one-device step on the same global batch (one small step per algorithm), and the
workers stop together with a chief that stops early: one cluster start runs both (`dist_steps.py`
as a script), the tests read its outputs."""
import os

import numpy as np
import pytest

from dprec.distribute import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cluster_run(steps, once_per_session):
  """(their output directory, the exit codes of the 2 workers): one cluster start a session."""
  def run(out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])), TF_CPP_MIN_LOG_LEVEL="2")
    workers = cluster.start_local_workers([steps.__file__, str(out)], 2, env)
    try:
      return [worker.wait(timeout=480) for worker in workers]
    finally:
      for worker in workers:
        if worker.poll() is None:
          worker.kill()

  return once_per_session("multi_worker_cluster", run)


@pytest.mark.multiprocess
def test_multi_worker_step_equals_one_device_step(steps, cluster_run):
  out_dir, codes = cluster_run
  assert codes == [0, 0]
  outputs = [out_dir / f"worker{i}.npz" for i in range(2)]
  for algorithm in steps.CONFIGS:
    single = steps.one_step(algorithm)
    for out in outputs:
      with np.load(out) as saved:
        got = [saved[f"{algorithm}_{i}"] for i in range(len(single))]
      for g, want in zip(got, single):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5, err_msg=f"{algorithm} {out}")


@pytest.mark.multiprocess
def test_workers_stop_with_a_chief_that_stops_early(cluster_run):
  """The chief alone stops after 2 of 4 steps (as at the budget): `SharedStop` stops the other
  worker at the same step instead of leaving it waiting in the next step's collectives."""
  out_dir, codes = cluster_run
  assert codes == [0, 0]
  assert [int(np.load(out_dir / f"stop{i}.npz")["steps"]) for i in range(2)] == [2, 2]
