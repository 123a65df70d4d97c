"""One run of a workflow (`train ctr`, `train seqrec`, `stream`, `demo`, `make_private`), for
every way in: `Run` opens its parts, each with one job, and the workflows call them.

  directory    `run_directory.RunDirectory`: the run directory (or a temporary one), its id and
               lock; it holds run.json, secret/noise_key, ledger.json (unless `ledger` names
               another, possibly shared, file), checkpoints/ and the workflow's other outputs
               (`stream`: journal, metrics, TensorBoard, plot)
  key          the run's secret `NoiseKey` (`run_key`): every randomness the privacy proof relies
               on (the DP step's generator, Poisson sampling, DP top-k, DP counts)
  budget       `run_budget.RunBudget`: the privacy ledger of the run's data set and the charges
               the run pays into it, each once, before anything they cover is released
  checkpoints  `resume.RunCheckpoints`: the run's checkpoints and exact resume
  trainer      `run_trainer.RunTrainer`: `model.fit` on batches drawn with the key, and its
               callbacks
  summary      `run_summary.RunSummary`: the summary's privacy fields
Without a run directory nothing is stored: the key lives in memory, the id is new, nothing is
checkpointed and the ledger, unless given, is a temporary file.
"""
import dataclasses
from typing import Optional

from dprec.data import identity
from dprec.errors import DprecError
from dprec.workflows import resume as resume_lib
from dprec.workflows import run_budget
from dprec.workflows import run_directory
from dprec.workflows import run_summary
from dprec.workflows import run_trainer

CHECKPOINT_EVERY = 100  # steps between checkpoints at most, unless `checkpoint_every` says


@dataclasses.dataclass(kw_only=True)
class RunOptions:
  """The options of every way in that concern the run rather than the model: where its files go,
  its randomness (`seed`: public initialisation only) and how it reports."""
  run_dir: Optional[str] = None
  ledger: Optional[str] = None
  accountant: str = "pld"
  checkpoint_every: Optional[int] = None  # None: `checkpoint_interval`
  seed: int = 0
  insecure_noise_seed: Optional[int] = None
  secure_noise: bool = False  # exact noise, no floating-point artefact (`privacy.secure_noise`)
  diagnostics: bool = False
  progress: bool = True
  summary_json: Optional[str] = None

  # Options a resumed run may change (where files go, how it reports); a workflow adds its own.
  NOT_FINGERPRINTED = ("data", "run_dir", "ledger", "checkpoint_every", "keep_checkpoints",
                       "diagnostics", "progress", "summary_json")

  def validate(self):
    if self.checkpoint_every is not None and self.checkpoint_every < 1:
      raise DprecError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")

  def checkpoint_interval(self, steps=None) -> int:
    """Steps between checkpoints: `checkpoint_every` if set, else a quarter of the run's `steps`
    (None: unknown) and at most `CHECKPOINT_EVERY`, so that a short run killed early resumes past
    step 0."""
    if self.checkpoint_every is not None:
      return self.checkpoint_every
    return CHECKPOINT_EVERY if steps is None else max(1, min(CHECKPOINT_EVERY, steps // 4))

  def run_fingerprint(self, **extra) -> dict:
    """The options a resumed run must share with the run it continues (`fingerprint`)."""
    return resume_lib.fingerprint(self, self.NOT_FINGERPRINTED, **extra)


@dataclasses.dataclass(kw_only=True)
class FitOptions(RunOptions):
  """`RunOptions` of a `model.fit` run (`train ctr`, `train seqrec`): its batches, its ledger
  charges and how many checkpoints it keeps."""
  fixed_batches: bool = False
  charge_every: int = 100
  keep_checkpoints: Optional[int] = 2  # None or 0: keep all

  def validate(self):
    super().validate()
    if self.keep_checkpoints is not None and self.keep_checkpoints < 0:
      raise DprecError(f"--keep-checkpoints must be >= 0, got {self.keep_checkpoints}")
    if self.charge_every < 1:
      raise DprecError(f"--charge-every must be >= 1, got {self.charge_every}")


class Run:
  """A run of `command` (see the module docstring): in `run_dir` (None: a temporary directory),
  charging `ledger` (None: the run directory's, else a temporary one) for the data set in `data`
  (None: in-memory data, which no charge can be matched to), its key from the OS CSPRNG unless
  `insecure_noise_seed`; `chief`: this process creates the run and charges (a multi-worker run's
  other workers only read it). Use as a context manager (removes the temporary files)."""

  def __init__(self, command: str, run_dir: Optional[str] = None, ledger: Optional[str] = None,
               insecure_noise_seed: Optional[int] = None, secure_noise: bool = False,
               data: Optional[str] = None, chief: bool = True):
    if not chief and run_dir is None and insecure_noise_seed is None:
      raise DprecError("the workers of a multi-worker run share the chief's secret noise key "
                       "through its run directory: give --run-dir (a directory every worker "
                       "can read, e.g. on a shared file system)")
    self.run_dir = run_dir
    dataset = identity.dataset_identity(data) if data is not None else None
    self.directory = run_directory.RunDirectory(command, run_dir, chief)
    try:
      self.run_id, self.key = self.directory.open(insecure_noise_seed)
    except BaseException:
      self.close()
      raise
    self.budget = run_budget.RunBudget(self.directory, ledger, self.run_id, self.key, dataset)
    self.checkpoints = resume_lib.RunCheckpoints(run_dir, self.budget)
    self.trainer = run_trainer.RunTrainer(self.directory, self.key)
    self.summary = run_summary.RunSummary(self.run_id, self.key, secure_noise, self.budget,
                                          data, dataset)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    """Releases the run directory and removes the temporary ones."""
    self.directory.close()
