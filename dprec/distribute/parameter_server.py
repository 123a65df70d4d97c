"""Sharded embedding tables under `tf.distribute.experimental.ParameterServerStrategy`.

Embedding tables are partitioned by rows across the parameter servers (`table_partitioner`:
each table a `ShardedVariable`); the other variables stay whole. A `ClusterCoordinator` (the
chief) schedules whole DP steps on the workers, asynchronously (`fit`): step t gets the chief's
Poisson batch t (drawn from the run's secret key, as on one machine) and the state of its noise
generator, derived from the run's secret key and t (`NoiseKey.tf_state("dp step", t)`, what
`KeyedNoiseCallback` gives a one-machine step), so its draws are identical whichever worker
runs it. The worker gathers the rows its batch touches, computes the clipped sums, the kept
rows and the noise itself, and sends each parameter server the update of its kept rows only
(`DPModel` splits an `IndexedSlices` gradient by shard); the optimizer's sparse update then
reads and writes those rows and their slots on the parameter server. DP-SGD sends every row.

Privacy under asynchrony: each scheduled step is one Poisson-subsampled Gaussian mechanism
(DP-AdaFEST: the composed pair) applied to fresh sampled data, with fresh noise (no step index
is scheduled twice). The model it reads may already hold other steps' updates, but those are
outputs of earlier mechanisms, so the steps compose adaptively exactly as sequential DP-SGD
does (the accountant's T-fold composition assumes no order among them); stale parameters cost
utility, not privacy. The ledger is charged on the chief, ahead of scheduling
(`PrivacyBudgetCallback`), so every scheduled step is paid before its result exists.

Workers draw noise from a generator of their own (`worker_generator`: a per-worker variable),
reset at the start of each step; one generator on a parameter server, shared by concurrent
steps, would interleave their draws.
"""
import collections
import os
from typing import Iterable, Optional, Sequence

import tensorflow as tf
# Per-worker variables have no public class to extend (TF 2.21).
from tensorflow.python.distribute import ps_values  # pylint: disable=no-name-in-module

MIN_ROWS_PER_SHARD = 1024  # a variable is sharded only if each shard gets at least this many rows


def table_partitioner(num_shards: int, min_rows: int = MIN_ROWS_PER_SHARD):
  """A `variable_partitioner` splitting by rows, into at most `num_shards` shards of at least
  `min_rows` rows each: embedding tables (10⁴–10⁹ rows) are sharded, dense kernels, biases and
  small states (a few hundred rows at most) stay whole, as the DP step's per-layer clipping
  expects."""
  if num_shards < 1 or min_rows < 1:
    raise ValueError(f"need num_shards >= 1 and min_rows >= 1, got {num_shards}, {min_rows}")

  def partition(shape, dtype):  # pylint: disable=unused-argument
    rows = shape[0] if shape.rank else 1
    return [max(1, min(num_shards, rows // min_rows))] + [1] * max(shape.rank - 1, 0)

  return partition


def make_strategy(cluster_resolver=None, min_rows: int = MIN_ROWS_PER_SHARD):
  """(`ParameterServerStrategy` with tables sharded over all its parameter servers, its
  `ClusterCoordinator`), for the cluster of `cluster_resolver` (default: TF_CONFIG's)."""
  if cluster_resolver is None:
    if not os.environ.get("TF_CONFIG"):
      raise ValueError("--strategy parameter_server needs TF_CONFIG (chief, workers and ps), or "
                       "--local-workers N --local-ps K to start a localhost cluster")
    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  num_ps = cluster_resolver.cluster_spec().num_tasks("ps")
  if not num_ps:
    raise ValueError("a parameter-server cluster needs at least one 'ps' task")
  strategy = tf.distribute.experimental.ParameterServerStrategy(
      cluster_resolver, variable_partitioner=table_partitioner(num_ps, min_rows))
  return strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def serve():
  """Runs this process's worker or ps task of TF_CONFIG until the cluster is stopped (the chief
  schedules the steps; the workers need neither the data nor the secret key)."""
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                       task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc",
                       start=True).join()


def num_workers(strategy) -> int:
  """The workers of a `ParameterServerStrategy`'s cluster."""
  # Its public `cluster_resolver` is None (TF 2.21); the one it was built with is kept here.
  return strategy._cluster_resolver.cluster_spec().num_tasks("worker")  # pylint: disable=protected-access


def in_scope() -> bool:
  """Whether variables now created go to a `ParameterServerStrategy`'s parameter servers."""
  return isinstance(tf.distribute.get_strategy(),
                    tf.distribute.experimental.ParameterServerStrategy)


class _OrderedPerWorkerVariable(ps_values.PerWorkerVariable):
  """A per-worker variable whose uses in one traced function share one handle, so automatic
  control dependencies order them (TF's own gives each use a new handle: a generator's reset
  and draws would run in any order)."""

  @property
  def handle(self):
    if tf.executing_eagerly():
      return super().handle
    self._maybe_create_per_worker_vars()
    closure, spec = self.handle_call_time_value()
    return tf.compat.v1.get_default_graph().capture_call_time_value(
        closure, spec, key=("dprec per-worker variable", id(self)))


class _WorkerGenerator(tf.random.Generator):
  """A `tf.random.Generator` whose state lives on each worker (one per worker)."""

  def _create_variable(self, *args, **kwargs):
    variable = super()._create_variable(*args, per_worker_variable=True, **kwargs)
    variable.__class__ = _OrderedPerWorkerVariable
    return variable


def worker_generator(state) -> tf.random.Generator:
  """A Philox generator on `state` with one state per worker (create it in the strategy's
  scope); each scheduled step resets it to the step's own state before drawing."""
  return _WorkerGenerator.from_state(state, alg="philox")


def _step_function(model, x, y, noise_state):
  """The scheduled step: one DP step of `model` on batch (x, y) with its generator on
  `noise_state` first (a non-private model has no generator to reset). Traced once for every
  batch size (Poisson batches vary): its signature leaves the batch dimension of (x, y) open."""
  generator = getattr(model, "dp_optimizer", None) and model.dp_optimizer.generator

  def spec(tensor):
    tensor = tf.convert_to_tensor(tensor)
    return tf.TensorSpec([None, *tensor.shape[1:]], tensor.dtype)

  @tf.function(input_signature=(tf.nest.map_structure(spec, x), tf.nest.map_structure(spec, y),
                                tf.TensorSpec.from_tensor(noise_state)))
  def step(x, y, noise_state):
    if generator is not None:
      generator.reset(noise_state)
    return model.distribute_strategy.run(model.train_step, args=((x, y),))

  return step


def fit(model, coordinator, batches: Iterable, noise_states: Iterable, steps: int,
        callbacks: Sequence[tf.keras.callbacks.Callback] = (), sync_every: Optional[int] = None):
  """Schedules `steps` DP steps of `model` (built in `coordinator.strategy`'s scope) on the
  workers, step i on the i-th of `batches` ((features, labels)) with the i-th of `noise_states`.
  Callbacks run on the coordinator: a step's `on_train_batch_end` follows its scheduling (the
  ledger is paid ahead), with the logs of the oldest step still in flight once more steps than
  workers are; every `sync_every` steps (checkpoints) and at the end all steps are waited for.
  Returns the last step's logs as `model.fit`'s history of one epoch ({name: [value]})."""
  callback_list = tf.keras.callbacks.CallbackList(list(callbacks), model=model)
  callback_list.set_params({"steps": steps, "epochs": 1, "verbose": 0})
  step = None
  window = num_workers(coordinator.strategy)
  in_flight, logs = collections.deque(), {}

  def wait(keep):
    nonlocal logs
    while len(in_flight) > keep:
      logs = {name: float(value) for name, value in in_flight.popleft().fetch().items()}

  model.stop_training = False
  callback_list.on_train_begin()
  callback_list.on_epoch_begin(0)
  for i, ((x, y), state) in enumerate(zip(batches, noise_states)):
    if i >= steps or model.stop_training:
      break
    callback_list.on_train_batch_begin(i)
    state = tf.constant(state)
    step = step or _step_function(model, x, y, state)
    in_flight.append(coordinator.schedule(step, args=(x, y, state)))
    wait(0 if sync_every and (i + 1) % sync_every == 0 else window)
    callback_list.on_train_batch_end(i, dict(logs))
  coordinator.join()
  wait(0)
  callback_list.on_epoch_end(0, dict(logs))
  callback_list.on_train_end(dict(logs))
  return {name: [value] for name, value in logs.items()}


_SERVERS = []  # the in-process cluster's servers, alive as long as the process


def in_process_cluster(num_workers: int, num_ps: int):
  """A cluster resolver for `num_workers` workers and `num_ps` parameter servers started as
  `tf.distribute.Server`s in this process on free localhost ports (TF's in-process cluster, for
  tests and `--local-workers`); this process is the chief. Once connected, the process stays in
  the cluster: use it in a process of its own."""
  from dprec.distribute import cluster  # pylint: disable=import-outside-toplevel
  if num_workers < 1 or num_ps < 1:
    raise ValueError(f"need at least one worker and one ps, got {num_workers}, {num_ps}")
  ports = cluster.free_ports(num_workers + num_ps)
  spec = tf.train.ClusterSpec({"worker": [f"localhost:{p}" for p in ports[:num_workers]],
                               "ps": [f"localhost:{p}" for p in ports[num_workers:]]})
  # In one process the servers share its threads: with fewer than num_workers + 1 inter-op
  # threads a worker can wait forever for a tensor (TF's in-process test clusters, b/172296720).
  configs = {"worker": tf.compat.v1.ConfigProto(inter_op_parallelism_threads=num_workers + 1),
             "ps": None}
  _SERVERS.extend(tf.distribute.Server(spec, job_name=job, task_index=index, protocol="grpc",
                                       config=configs[job])
                  for job in ("worker", "ps") for index in range(spec.num_tasks(job)))
  return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
