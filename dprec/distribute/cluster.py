"""The strategies a workflow trains under, and localhost clusters for trying them.

`--strategy mirrored`: `tf.distribute.MirroredStrategy` over this machine's devices (one process).
`--strategy multi_worker`: `tf.distribute.MultiWorkerMirroredStrategy`; each process is told its
role by the `TF_CONFIG` environment variable (`{"cluster": {"worker": [host:port, ...]},
"task": {"type": "worker", "index": i}}`), as on a real cluster; worker 0 is the chief.
`start_local_workers` starts such a cluster on localhost (free ports, one process per worker).
`--strategy parameter_server`: `dprec.distribute.parameter_server` (tables sharded over
parameter servers, steps scheduled by the chief).
"""
import json
import os
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

STRATEGIES = ("none", "mirrored", "multi_worker", "parameter_server")
# --strategy parameter_server: a variable is sharded only if each shard gets at least this many
# rows (`parameter_server.table_partitioner`)
MIN_ROWS_PER_SHARD = 1024


def make_strategy(name: str):
  """The `tf.distribute.Strategy` of `name` (None for "none": the default, one device)."""
  import tensorflow as tf
  if name == "none":
    return None
  if name == "mirrored":
    return tf.distribute.MirroredStrategy()
  if name == "parameter_server":
    raise ValueError("--strategy parameter_server: use dprec.distribute.parameter_server")
  if name == "multi_worker":
    if not os.environ.get("TF_CONFIG"):
      raise ValueError("--strategy multi_worker needs TF_CONFIG (the cluster and this "
                       "process's task), or --local-workers N to start a localhost cluster")
    return tf.distribute.MultiWorkerMirroredStrategy()
  raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")


def task() -> dict:
  """This process's task in TF_CONFIG ({} without one)."""
  try:
    return json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
  except ValueError as error:
    raise ValueError(f"TF_CONFIG: not valid JSON ({error})") from error


def is_chief() -> bool:
  """Whether this process writes the run's shared state (ledger, checkpoints, summary): the
  chief task, or worker 0 of a cluster without one, or a process outside any cluster."""
  role = task()
  return (not role or role.get("type") == "chief"
          or (role.get("type") == "worker" and int(role.get("index", 0)) == 0))


def free_ports(count: int) -> List[int]:
  """`count` distinct localhost ports free right now."""
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def local_tf_configs(num_workers: int) -> List[str]:
  """TF_CONFIG of each worker of a localhost cluster of `num_workers` on free ports."""
  if num_workers < 1:
    raise ValueError(f"a cluster needs at least one worker, got {num_workers}")
  workers = [f"localhost:{port}" for port in free_ports(num_workers)]
  return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
          for i in range(num_workers)]


def start_local_workers(args: Sequence[str], num_workers: int,
                        env: Optional[dict] = None) -> List[subprocess.Popen]:
  """Starts `python args...` once per worker of a new localhost cluster, each with its
  TF_CONFIG; returns the processes (worker 0, the chief, first)."""
  base = dict(os.environ if env is None else env)
  return [subprocess.Popen([sys.executable, *args], env=dict(base, TF_CONFIG=config))
          for config in local_tf_configs(num_workers)]


def wait_for_workers(processes: Sequence[subprocess.Popen], poll_seconds: float = 0.5):
  """Waits for every process; once one fails, stops the others (they would wait for it in their
  collectives forever). Returns the exit codes."""
  while any(p.poll() is None for p in processes):
    if any(p.poll() not in (None, 0) for p in processes):
      for p in processes:
        if p.poll() is None:
          p.kill()
    time.sleep(poll_seconds)
  return [p.returncode for p in processes]
