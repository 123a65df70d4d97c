"""Sharded embedding tables under `tf.distribute.experimental.ParameterServerStrategy`.

Embedding tables are partitioned by rows across the parameter servers (`table_partitioner`:
each table a `ShardedVariable`); the other variables stay whole. A `ClusterCoordinator` (the
chief) schedules DP steps on the workers, asynchronously (`fit`): step t gets its batch (the
chief's Poisson batch t, drawn from the run's secret key as on one machine; out of core, only a
reference to step t's shard, which the worker reads and checks itself: the chief ships no data)
and the state of its noise generator, derived from the run's secret key and t
(`NoiseKey.tf_state("dp step", t)`, what `KeyedNoiseCallback` gives a one-machine step), so its
batch and draws are identical whichever worker runs it, however often. The worker gathers the
rows its batch touches, computes the clipped sums, the kept rows and the noise itself, and
returns the noisy update (`DPModel` splits an `IndexedSlices` gradient by shard) without
applying it; the chief applies each step's update once, in step order, with the optimizer's
sparse update, which reads and writes those rows and their slots on their parameter servers.
DP-SGD's update is every row.

Faults: TensorFlow's coordinator runs a scheduled function at least once (a worker lost mid-step
has its step re-run elsewhere). A worker that applied its own update could leave part of it
applied, and its re-run would apply the step again: a second release of the step's clipped sum
with the same noise. Here workers apply nothing, so a lost attempt released nothing and the
re-run's update is the step's only one; the chief applies it once. One update at a time also
means no lost updates (Hogwild's concurrent read-modify-write of a row).

Privacy under asynchrony: each scheduled step is one Poisson-subsampled Gaussian mechanism
(DP-AdaFEST: the composed pair) applied to fresh sampled data, with fresh noise (no step index
is scheduled twice). The weights it reads may lack up to (workers − 1) earlier steps' updates,
but they are outputs of earlier mechanisms, so the steps compose adaptively exactly as
sequential DP-SGD does (the accountant's T-fold composition assumes no order among them); stale
parameters cost utility, not privacy. The ledger is charged on the chief, ahead of scheduling
(`PrivacyBudgetCallback`), so every scheduled step is paid before its result exists.

Workers draw noise from a generator of their own (`worker_generator`: a per-worker variable),
reset at the start of each step; one generator on a parameter server, shared by concurrent
steps, would interleave their draws.
"""
import collections
import os
from typing import Callable, Iterable, Optional, Sequence

import tensorflow as tf
# Per-worker variables have no public class to extend (TF 2.21).
from tensorflow.python.distribute import ps_values

from dprec.distribute.cluster import MIN_ROWS_PER_SHARD


def table_partitioner(num_shards: int, min_rows: int = MIN_ROWS_PER_SHARD):
  """A `variable_partitioner` splitting by rows, into at most `num_shards` shards of at least
  `min_rows` rows each: embedding tables (10⁴–10⁹ rows) are sharded, dense kernels, biases and
  small states (a few hundred rows at most) stay whole, as the DP step's per-layer clipping
  expects."""
  if num_shards < 1 or min_rows < 1:
    raise ValueError(f"need num_shards >= 1 and min_rows >= 1, got {num_shards}, {min_rows}")

  def partition(shape, dtype):
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
  schedules the steps; the workers need no secret key, and out of core read access to the run's
  batch directory)."""
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                       task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc",
                       start=True).join()


def num_workers(strategy) -> int:
  """The workers of a `ParameterServerStrategy`'s cluster."""
  # Its public `cluster_resolver` is None (TF 2.21); the one it was built with is kept here.
  return strategy._cluster_resolver.cluster_spec().num_tasks("worker")


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


FAULT_INJECTION_ENV = "DPREC_TEST_WORKER_FAULT"  # "STEP:MARKER", read when the step is traced


def _fault_injection(index, update):
  """Fault tests only (`FAULT_INJECTION_ENV` = "STEP:MARKER" on the chief): the first time step
  STEP runs, its worker writes the file MARKER once its update is computed and then hangs until
  the test kills it, a deterministic stand-in for a worker lost mid-step. `update` unchanged."""
  spec = os.environ.get(FAULT_INJECTION_ENV)
  if not spec:
    return update
  step, marker = spec.split(":", 1)
  first_time = tf.logical_and(tf.equal(index, int(step)),
                              tf.equal(tf.size(tf.io.matching_files(marker)), 0))

  def hang():
    with tf.control_dependencies([tf.io.write_file(marker, "worker stopped here")]):
      return tf.while_loop(lambda i: i >= 0, lambda i: i + 1, [tf.constant(0, tf.int64)])[0]

  done = tf.cond(first_time, hang, lambda: tf.constant(0, tf.int64))
  with tf.control_dependencies(tf.nest.flatten(update) + [done]):
    return tf.nest.map_structure(tf.identity, update)


class _ScheduledStep:
  """One DP step split between a worker and the chief. `run` (traced once for every batch size:
  its signature leaves the first dimension of `inputs` open) is scheduled on a worker: it reads
  the step's (x, y) batch from `inputs` with `read` (None: `inputs` is the batch), resets the
  step's generator to `noise_state` (a non-private model has none) and computes the noisy update
  without applying it. `apply` runs on the chief with the fetched update: the optimizer's
  row-sparse update on the parameter servers, once per step, in step order."""

  def __init__(self, model, inputs, noise_state, read: Optional[Callable] = None):
    self.model, self.read, self.variables, self.sparse = model, read, None, None

    def spec(tensor):
      tensor = tf.convert_to_tensor(tensor)
      return tf.TensorSpec([None, *tensor.shape[1:]] if tensor.shape.rank else [], tensor.dtype)

    self.run = tf.function(self._run, input_signature=(
        tf.nest.map_structure(spec, inputs),
        tf.TensorSpec.from_tensor(tf.convert_to_tensor(noise_state)),
        tf.TensorSpec([], tf.int64)))
    self._apply_function = None

  def _run(self, inputs, noise_state, index):
    model = self.model
    x, y = inputs if self.read is None else self.read(inputs)
    generator = getattr(model, "dp_optimizer", None) and model.dp_optimizer.generator
    if generator is not None:
      generator.reset(noise_state)

    def replica_step(data):
      with model.deferring_updates() as pairs:
        logs = model.train_step(data)
      self.variables = [variable for _, variable in pairs]
      self.sparse = [isinstance(gradient, tf.IndexedSlices) for gradient, _ in pairs]
      return logs, [(g.indices, g.values) if isinstance(g, tf.IndexedSlices) else g
                    for g, _ in pairs]

    logs, update = model.distribute_strategy.run(replica_step, args=((x, y),))
    return logs, _fault_injection(index, update)

  def apply(self, update):
    """Applies `update` (what `run` returned beside its logs) with the model's optimizer."""
    if self._apply_function is None:  # traced once: the kept rows' count varies, not the rest
      def spec(gradient, sparse):
        if not sparse:
          return tf.TensorSpec(gradient.shape, gradient.dtype)
        indices, values = gradient
        return (tf.TensorSpec([None], indices.dtype),
                tf.TensorSpec([None, *values.shape[1:]], values.dtype))

      self._apply_function = tf.function(self._apply, input_signature=(
          [spec(g, sparse) for g, sparse in zip(update, self.sparse)],))
    self._apply_function(update)

  def _apply(self, update):
    gradients = [tf.IndexedSlices(g[1], g[0], tf.constant(v.shape.as_list(), tf.int64))
                 if sparse else g for g, v, sparse in zip(update, self.variables, self.sparse)]
    # One replica per worker: the update is already the step's whole (noisy) gradient.
    self.model.optimizer.apply_gradients(zip(gradients, self.variables),
                                         experimental_aggregate_gradients=False)


def fit(model, coordinator, batches: Iterable, noise_states: Iterable, steps: int,
        callbacks: Sequence[tf.keras.callbacks.Callback] = (), sync_every: Optional[int] = None,
        read: Optional[Callable] = None):
  """Schedules `steps` DP steps of `model` (built in `coordinator.strategy`'s scope; call this
  outside it) on the workers, step i on the i-th of `batches` ((features, labels), or what
  `read` makes them of on the worker, e.g. `batch_shards.read_step` of a shard's reference) with
  the i-th of `noise_states`, and applies each step's update from this chief, in step order, once:
  step i is scheduled when at most (workers − 1) earlier steps are still in flight, so it reads
  the weights every step up to i − workers left. Callbacks run here: a step's
  `on_train_batch_begin` precedes its scheduling (the ledger is paid ahead), its
  `on_train_batch_end` gets the logs of the last step applied; every `sync_every` steps
  (checkpoints) and at the end every step is applied. Returns the last step's logs as
  `model.fit`'s history of one epoch ({name: [value]})."""
  if tf.distribute.has_strategy():
    raise ValueError("call parameter_server.fit outside the strategy's scope: the chief applies "
                     "each step's update itself")
  if getattr(getattr(model, "dp_optimizer", None), "clip", None) is not None:
    raise ValueError("quantile clipping is not available under ParameterServerStrategy: its "
                     "clip update is made inside the worker's step, which a re-run repeats")
  callback_list = tf.keras.callbacks.CallbackList(list(callbacks), model=model)
  callback_list.set_params({"steps": steps, "epochs": 1, "verbose": 0})
  step = None
  window = num_workers(coordinator.strategy)
  in_flight, logs = collections.deque(), {}

  def apply_until(keep):
    nonlocal logs
    while len(in_flight) > keep:
      step_logs, update = in_flight.popleft().fetch()
      step.apply(update)
      logs = {name: float(value) for name, value in step_logs.items()}

  model.stop_training = False
  callback_list.on_train_begin()
  callback_list.on_epoch_begin(0)
  for i, (inputs, state) in enumerate(zip(batches, noise_states)):
    if i >= steps or model.stop_training:
      break
    apply_until(window - 1)
    callback_list.on_train_batch_begin(i)
    state = tf.constant(state)
    step = step or _ScheduledStep(model, inputs, state, read)
    in_flight.append(coordinator.schedule(
        step.run, args=(inputs, state, tf.constant(i, tf.int64))))
    if sync_every and (i + 1) % sync_every == 0:
      apply_until(0)
    callback_list.on_train_batch_end(i, dict(logs))
  apply_until(0)
  callback_list.on_epoch_end(0, dict(logs))
  callback_list.on_train_end(dict(logs))
  return {name: [value] for name, value in logs.items()}


_SERVERS = []  # the in-process cluster's servers, alive as long as the process


def in_process_cluster(num_workers: int, num_ps: int):
  """A cluster resolver for `num_workers` workers and `num_ps` parameter servers started as
  `tf.distribute.Server`s in this process on free localhost ports (TF's in-process cluster, for
  tests and `--local-workers`); this process is the chief. Once connected, the process stays in
  the cluster: use it in a process of its own."""
  from dprec.distribute import cluster
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
