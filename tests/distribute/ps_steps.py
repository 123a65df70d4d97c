"""One DP step of the small two-table model of `dist_steps.py` with its tables sharded by rows
over 2 parameter servers (`ParameterServerStrategy`, 2 workers, all `tf.distribute.Server`s in
this process), scheduled by the coordinator; and the same step on one device. Run as a script
(`python ps_steps.py OUT.npz`: the cluster changes the process for good) it saves, per
configuration, the one-device and the parameter-server tables, dense weights and LazyAdam slots
before and after the step, and the one-device step's kept rows."""
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import tensorflow as tf

import dist_steps
from dprec.distribute import parameter_server
from dprec.optimizers import LazyAdam, SparseSGD
from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
from dprec.privacy.noise_key import NoiseKey
from dprec.training import poisson

VOCABS = (64, 48)  # 2 shards of ≥ 16 rows each; rows ≥ 40 (30) no example touches
MIN_ROWS = 16
# (algorithm, optimizer, stacked tables): SGD for comparing weights, LazyAdam for its slots
# (m, v); the stacked model's two tables are one variable, sharded like one table.
CONFIGS = {"dp_sgd": ("dp_sgd", SparseSGD, False), "dp_adafest": ("dp_adafest", SparseSGD, False),
           "dp_adafest_adam": ("dp_adafest", LazyAdam, False),
           "dp_adafest_stacked": ("dp_adafest", LazyAdam, True)}
LEARNING_RATE = 0.05


def table_shards(model):
  """Per table, its variables: the shards of a sharded table, else the table."""
  return [list(getattr(t.embeddings, "variables", [t.embeddings])) for t in model.dp_tables]


def state(model):
  """{name: array}: tables (shards concatenated), LazyAdam's m and v of each, dense weights."""
  optimizer, out = model.optimizer, {}
  for f, shards in enumerate(table_shards(model)):
    out[f"table{f}"] = np.concatenate([s.numpy() for s in shards])
    for slot in ("m", "v") if isinstance(optimizer, LazyAdam) else ():
      slots = optimizer._momentums if slot == "m" else optimizer._velocities
      out[f"table{f}_{slot}"] = np.concatenate([
          slots[optimizer._index_dict[optimizer._var_key(s)]].numpy() for s in shards])
  dense = [w for w in model.trainable_weights if "embeddings" not in w.name]
  out.update({f"dense{i}": w.numpy() for i, w in enumerate(dense)})
  return out


def build(name):
  """The model of configuration `name`, its optimizer's slots built (call it in the strategy's
  scope)."""
  algorithm, optimizer, stacked = CONFIGS[name]
  model = dist_steps.build_model(dist_steps.CONFIGS[algorithm], lr=LEARNING_RATE, vocabs=VOCABS,
                                 optimizer=optimizer, stack_tables=stacked)
  model.optimizer.build(model.trainable_variables)
  return model


def first_batch():
  features, labels = dist_steps.data()
  sampling = poisson.BatchSampling(dist_steps.BATCH, entropy=7)
  return next(iter(poisson.sampled_dataset(features, labels, sampling, 1)))


def one_device(name):
  """(state before, after one step, the kept rows of each table) on one device."""
  model = build(name)
  x, y = first_batch()
  kept = [g.indices.numpy() if isinstance(g, tf.IndexedSlices) else np.arange(v.shape[0])
          for g, v in model.dp_gradients(x, y)[-len(model.dp_tables):]]
  model = build(name)  # a fresh generator: the step draws what dp_gradients drew
  before = state(model)
  model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, shuffle=False)
  return before, state(model), kept


def parameter_server_step(name, strategy, coordinator):
  """(state before, after) one step scheduled on the cluster, from the one-device weights."""
  start = build(name)
  with strategy.scope():
    model = build(name)
  for shards, table in zip(table_shards(model), start.dp_tables):
    assert len(shards) == 2, "each table is sharded over the 2 parameter servers"
    for shard, rows in zip(shards, np.split(table.embeddings.numpy(),
                                            np.cumsum([s.shape[0] for s in shards])[:-1])):
      shard.assign(rows)
  dense = [w for w in model.trainable_weights if "embeddings" not in w.name]
  for target, source in zip(dense, [w for w in start.trainable_weights
                                    if "embeddings" not in w.name]):
    target.assign(source.numpy())
  before = state(model)
  noise_state = NoiseKey.insecure(dist_steps.NOISE_SEED).tf_state(NOISE_PURPOSE)
  parameter_server.fit(model, coordinator, [first_batch()], [noise_state], steps=1)
  return before, state(model)


def concurrent_steps(strategy, coordinator, steps=8):
  """(tables before, after `steps` DP-AdaFEST steps on the 2 workers, the sum of the updates
  the chief applied, the optimizer's step count): SGD, so with no update lost the tables move
  by exactly −lr × the applied updates' sum."""
  with strategy.scope():
    model = build("dp_adafest")
  before = state(model)
  applied = [np.zeros_like(before[f"table{f}"]) for f in range(len(VOCABS))]
  apply = parameter_server._ScheduledStep.apply

  def recording_apply(step, update):
    offsets = {id(v): (f, sum(s.shape[0] for s in shards[:i]))
               for f, shards in enumerate(table_shards(model)) for i, v in enumerate(shards)}
    for gradient, variable, sparse in zip(update, step.variables, step.sparse):
      if sparse and id(variable) in offsets:
        f, offset = offsets[id(variable)]
        np.add.at(applied[f], np.asarray(gradient[0]) + offset, np.asarray(gradient[1]))
    apply(step, update)

  parameter_server._ScheduledStep.apply = recording_apply
  try:
    features, labels = dist_steps.data()
    sampling = poisson.BatchSampling(dist_steps.BATCH, entropy=11)
    key = NoiseKey.insecure(dist_steps.NOISE_SEED)
    parameter_server.fit(model, coordinator,
                         list(poisson.sampled_dataset(features, labels, sampling, steps)),
                         [key.tf_state(NOISE_PURPOSE, t) for t in range(steps)], steps)
  finally:
    parameter_server._ScheduledStep.apply = apply
  after = state(model)
  return ({f"concurrent/before/table{f}": before[f"table{f}"] for f in range(len(VOCABS))}
          | {f"concurrent/after/table{f}": after[f"table{f}"] for f in range(len(VOCABS))}
          | {f"concurrent/applied/table{f}": a for f, a in enumerate(applied)}
          | {"concurrent/iterations": model.optimizer.iterations.numpy(),
             "concurrent/learning_rate": LEARNING_RATE})


def main(out):
  strategy, coordinator = parameter_server.make_strategy(
      parameter_server.in_process_cluster(2, 2), min_rows=MIN_ROWS)
  saved = {}
  for name in CONFIGS:
    single_before, single_after, kept = one_device(name)
    ps_before, ps_after = parameter_server_step(name, strategy, coordinator)
    for tag, values in (("single_before", single_before), ("single_after", single_after),
                        ("ps_before", ps_before), ("ps_after", ps_after)):
      saved.update({f"{name}/{tag}/{k}": v for k, v in values.items()})
    saved.update({f"{name}/kept{f}": rows for f, rows in enumerate(kept)})
  saved.update(concurrent_steps(strategy, coordinator))
  np.savez(out, **saved)


if __name__ == "__main__":
  main(*sys.argv[1:])
