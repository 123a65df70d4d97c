"""A run's `model.fit`: its callbacks (step timer, each step's noise keyed from the run's secret
key, the ledger's charges, checkpoints, progress) and its batches, drawn with the key's entropy so
that a resumed run draws exactly what an uninterrupted one would."""
import sys


class RunTrainer:
  """`model.fit` for the run in `directory` (a `dprec.workflows.run_directory.RunDirectory`)
  with `key` (its `NoiseKey`)."""

  def __init__(self, directory, key):
    self.directory, self.key = directory, key

  def callbacks(self, generators, resume, charges=None, checkpoint_every=100, extra=(),
                progress=None, diagnostics=False):
    """(step timer, the callbacks of `model.fit`): the timer, each step's noise keyed from
    (purpose, step), `charges` (paying the ledger), a checkpoint every `checkpoint_every` steps
    with a run directory (by the chief; the other workers write theirs to a scratch directory
    and read the chief's on resume), `extra`, and a progress bar titled `progress` (None:
    none)."""
    from dprec.training import callbacks
    timer = callbacks.StepTimer()
    fit = [timer, callbacks.KeyedNoiseCallback(self.key, generators, resume.step)]
    fit += [charges] if charges is not None else []
    if resume.manager is not None:
      chief = self.directory.chief
      fit.append(resume.callback(checkpoint_every, None if chief else self.directory.scratch()))
    fit += list(extra)
    if progress:
      fit.append(callbacks.ProgressBar(desc=progress, initial=resume.step,
                                       diagnostics=diagnostics, timer=timer))
    return timer, fit

  def fit(self, model, features, labels, batch_size, poisson, steps, resume, callbacks,
          coordinator=None, batches=None, read=None, max_batch_size=None):
    """`model.fit` from `resume.step` to `steps` on batches of (`features`, `labels`) drawn with
    the run's secret entropy (Poisson at q = B/N, truncated to `max_batch_size` if given, else
    fixed-size shuffled): the very batches an uninterrupted run draws; or on `batches`, a
    `tf.data.Dataset` of the (features, labels) batches of steps `resume.step`.. drawn elsewhere
    (out of core: `dprec.workflows.out_of_core`).
    Under the `tf.distribute` strategy `model` was built in, every worker draws the same global
    batches and each replica trains on its shard. With the `coordinator` of a
    `ParameterServerStrategy`, this chief draws the batches and schedules step t on a worker
    with its batch (or, with `read`, `batches` are the steps' references and the worker reads its
    batch itself: `read(reference)`) and the noise state of (the DP step, t)
    (`dprec.distribute.parameter_server.fit`). Returns the history ({} when no step is left)."""
    import tensorflow as tf
    from dprec.training import poisson as sampling_lib
    if steps <= resume.step:
      if self.directory.chief:
        print(f"dprec: {self.directory.path}: this run finished its {steps} steps before: "
              "evaluating its model again (nothing charged)", file=sys.stderr)
      return {}
    sampling = sampling_lib.BatchSampling(batch_size, poisson, self.key.entropy("poisson"),
                                          max_batch_size)
    distributed = model.distribute_strategy is not tf.distribute.get_strategy()
    if batches is None and (coordinator is not None or not distributed):
      batches = sampling_lib.sampled_dataset(features, labels, sampling, steps, resume.step)
    if coordinator is not None:
      from dprec.distribute import parameter_server
      from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
      from dprec.training.callbacks import CheckpointCallback
      return parameter_server.fit(
          model, coordinator, batches,
          (self.key.tf_state(NOISE_PURPOSE, t) for t in range(resume.step, steps)),
          steps - resume.step, callbacks,
          sync_every=next((c.every for c in callbacks if isinstance(c, CheckpointCallback)),
                          None), read=read)
    if batches is None:  # every replica of the strategy draws its shard of the global batch
      batches = tf.keras.utils.experimental.DatasetCreator(sampling_lib.replica_dataset_fn(
          features, labels, sampling, steps, resume.step))
    return model.fit(batches, epochs=1, steps_per_epoch=steps - resume.step,
                     callbacks=callbacks, verbose=0).history
