"""Checkpoints and exact resume of a `model.fit` run (`train ctr`, `train seqrec`).

A run directory's `checkpoints/` holds atomic `ckpt-<n>` commits (`dprec.training.checkpoint`) of
`checkpoint_objects` (the model, its optimizer slots and step; no generator state: a step's noise
and batch are re-derived from the run's key and the step) and a JSON state with the step and the
run's `fingerprint` (the options a resumed run must share with the run it continues). `Resume`
restores the newest that reads (an older one if the newest is damaged, with a warning) into a
freshly built model, refusing other settings, and commits new ones; `RunCheckpoints` are a run's,
with the check that its ledger paid for the steps they trained.
"""
import dataclasses
import json
import os

from dprec.errors import DprecError
from dprec.training import checkpoint as checkpoint_lib

CHECKPOINTS_DIR = "checkpoints"


class RunCheckpoints:
  """The checkpoints of a run (in its directory `run_dir`; None: none are kept) and the steps
  its `budget` (`dprec.workflows.run_budget.RunBudget`) has paid for them."""

  def __init__(self, run_dir, budget):
    self.run_dir, self.budget = run_dir, budget
    self.directory = run_dir and os.path.join(run_dir, CHECKPOINTS_DIR)

  def resume(self, model, options, keep=2, **facts):
    """A `Resume` of `model` in the run's checkpoints (where it stands), for a run of `options`
    (a `dprec.workflows.run.RunOptions`) on data with these `facts`."""
    return Resume(self.directory, checkpoint_objects(model), options.run_fingerprint(**facts),
                  keep, fingerprint_defaults(options, options.NOT_FINGERPRINTED))

  def check_ledger_covers(self, label):
    """Raises `DprecError` if the ledger holds fewer steps of this run under `label` than its
    newest checkpoint has trained (steps are paid before they are taken): the run's ledger was
    deleted or replaced after it trained, and going on would release a model the ledger does
    not account for. Call it before the run charges anything (the chief: it alone charges)."""
    budget = self.budget
    if not budget.chief:
      return
    trained = checkpointed_step(self.directory) if self.run_dir else 0
    paid = budget.steps_paid(label)
    if paid < trained:
      other = sorted(other for other in {c.get("label") for c in budget.ledger.charges} - {label}
                     if budget.steps_paid(other) >= trained)
      if other:
        raise DprecError(
            f"{self.run_dir}: this run trained as '{other[0]}', and this command asks for "
            f"'{label}': an argument changed (not the ledger). Rerun with the run's arguments "
            "to resume it, or use a new --run-dir to train from scratch")
      raise DprecError(
          f"{budget.ledger.path}: this ledger holds {paid} steps of run {budget.run_id} under "
          f"'{label}', but the run's checkpoints in {self.run_dir} have trained {trained}: the "
          "run's ledger was deleted or replaced after it trained. Put the run's ledger back at "
          "that path (or give it with --ledger) and rerun; to train from scratch instead, use "
          "a new --run-dir")


class Resume:
  """Where a `model.fit` run stands: a fresh start, or the newest checkpoint in `directory`
  (None: no checkpoints) restored into `objects` (model, optimizer slots and step), refused if it
  was written with other settings than `fingerprint` (the options a resumed run must share)."""

  def __init__(self, directory, objects, fingerprint, keep=2, defaults=None):
    self.objects, self.fingerprint, self.defaults = objects, fingerprint, defaults or {}
    self.manager, self.step, self.loss = None, 0, None
    if directory is None:
      return
    self.manager = checkpoint_lib.CheckpointManager(directory, keep=keep or None)
    self.manager.restore_newest(self._restore)

  def _restore(self, path):
    state = self.manager.read_state(path)
    # A checkpoint written before an option existed ran as its default does (`defaults`).
    then = {**self.defaults, **state["fingerprint"]}
    changed = {k: (then.get(k), v) for k, v in self.fingerprint.items() if then.get(k) != v}
    if changed:
      raise DprecError(
          f"{os.path.dirname(self.manager.directory)}: its checkpoints belong to a run with "
          "other settings ("
          + ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
          + "); resume with the same settings or use another --run-dir")
    self.objects.read(os.path.join(path, checkpoint_lib.MODEL_PREFIX)).assert_consumed()
    self.step, self.loss = state["step"], state["loss"]

  def callback(self, every, scratch=None):
    """Commits a checkpoint every `every` steps of `model.fit` and at its end; into the
    directory `scratch` instead (kept newest only) for a worker that is not the chief, which
    must write along with it (saving reads variables through collectives) but not over it."""
    from dprec.training import callbacks
    state = {"fingerprint": self.fingerprint, "loss": self.loss}
    manager = self.manager if scratch is None else checkpoint_lib.CheckpointManager(scratch, 1)
    return callbacks.CheckpointCallback(manager, self.objects, every, state,
                                        start_step=self.step)


def checkpoint_objects(model):
  """What a run's checkpoint holds: the model, its optimizer slots and step (no generator state:
  the noise is re-derived from the run's secret key and the step)."""
  import tensorflow as tf
  return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def fingerprint(options, ignored, **extra) -> dict:
  """The fields of the `options` dataclass a resumed run must share with the run it continues
  (all but `ignored`: where files go, how it reports), with `extra` facts of its data; as JSON
  holds it (tuples as lists), so that it compares equal to a checkpoint's."""
  return json.loads(json.dumps(dict(
      {k: v for k, v in dataclasses.asdict(options).items() if k not in ignored}, **extra)))


def fingerprint_defaults(options, ignored) -> dict:
  """The defaults of the fingerprinted fields of the `options` dataclass, as JSON holds them: what
  a run written before a field existed ran with (an option is added with the old behaviour as its
  default), so that `Resume` accepts it when the option is still at its default."""
  return json.loads(json.dumps({
      f.name: f.default for f in dataclasses.fields(options)
      if f.name not in ignored and f.default is not dataclasses.MISSING}))


def checkpointed_step(directory) -> int:
  """The step of the newest checkpoint in `directory` (0: none, or its state is unreadable,
  which `Resume` then reports)."""
  if not os.path.isdir(directory):
    return 0
  latest = checkpoint_lib.CheckpointManager(directory).latest()
  try:
    return checkpoint_lib.CheckpointManager.read_state(latest)["step"] if latest else 0
  except (OSError, ValueError, KeyError, TypeError):
    return 0


def options_from_checkpoint(options_class, path, missing=None, **overrides):
  """The `options_class` options of the run that wrote checkpoint directory `path`
  (`checkpoints/ckpt-<n>`), e.g. to evaluate it: `overrides` set what the fingerprint omits,
  `missing` what an older fingerprint lacks (where the options' default has changed since)."""
  saved = checkpoint_lib.CheckpointManager.read_state(path)["fingerprint"]
  fields = {f.name for f in dataclasses.fields(options_class)}
  return options_class(**{**(missing or {}), **{k: v for k, v in saved.items() if k in fields},
                          **overrides})
