"""One run of a workflow (`train ctr`, `train seqrec`, `stream`, `demo`, `make_private`): its
directory, its id, its secret noise key, its charges in the privacy ledger, its checkpoints and
its summary, in one place for every way in.

A run directory (`dprec.workflows.run_directory`) holds:
  run.json          the run id, the command, and whether the noise is secret (shareable)
  run.json.lock     held while a process (a multi-worker run's chief) uses the directory
  secret/noise_key  the run's secret noise key (`dprec.workflows.run_key`)
  ledger.json       the privacy ledger (unless `ledger` names another, possibly shared, file)
  checkpoints/      `ckpt-<n>` directories (`dprec.workflows.resume`): model, optimizer slots
                    and the data position, committed atomically; no generator state: a step's
                    noise and batch are re-derived from the key and the step, so a resumed run
                    draws exactly what an uninterrupted one would
  ...               the workflow's other outputs (`stream`: journal, metrics, TensorBoard, plot)
Without a run directory nothing is stored: the key lives in memory, the id is new, nothing is
checkpointed and the ledger, unless given, is a temporary file.

The ledger is the budget of the run's data set (`data`, identified by `dprec.data.identity`);
the run pays its charges into it through `budget` (`dprec.workflows.run_budget.RunBudget`),
each once, before anything they cover is released.

Every randomness the privacy proof relies on comes from the run's `key` (a `NoiseKey`): the DP
step's generator, Poisson sampling (`key.entropy("poisson")`), DP top-k and DP counts
(`key.numpy_rng`). `insecure_noise_seed` derives the key from a public seed instead:
reproducible, not private; the summary (`privacy_fields`) and every ledger charge say so.
"""
import dataclasses
import os
import sys
from typing import Optional

from dprec import atomic_io
from dprec.data import identity
from dprec.errors import DprecError
from dprec.workflows import resume as resume_lib
from dprec.workflows import run_budget
from dprec.workflows import run_directory
from dprec.workflows import run_trainer

SUMMARY_FILE = "summary.json"  # in the run directory, unless --summary-json says otherwise
STDOUT = "-"  # --summary-json -: the JSON summary on stdout
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
  """See the module docstring. Use as a context manager (removes a temporary ledger)."""

  def __init__(self, command: str, run_dir: Optional[str] = None, ledger: Optional[str] = None,
               insecure_noise_seed: Optional[int] = None, secure_noise: bool = False,
               data: Optional[str] = None, chief: bool = True):
    self.command, self.run_dir, self.secure_noise = command, run_dir, secure_noise
    self.chief = chief
    if not chief and run_dir is None and insecure_noise_seed is None:
      raise DprecError("the workers of a multi-worker run share the chief's secret noise key "
                       "through its run directory: give --run-dir (a directory every worker "
                       "can read, e.g. on a shared file system)")
    # The data set trained on (None: in-memory data, which no charge can be matched to).
    self.data = data
    self.dataset = identity.dataset_identity(data) if data is not None else None
    self.directory = run_directory.RunDirectory(command, run_dir, chief)
    try:
      self.run_id, self.key = self.directory.open(insecure_noise_seed)
    except BaseException:
      self.close()
      raise
    self.budget = run_budget.RunBudget(self.directory, ledger, self.run_id, self.key,
                                       self.dataset)
    self.checkpoints = resume_lib.RunCheckpoints(run_dir, self.budget)
    self.trainer = run_trainer.RunTrainer(self.directory, self.key)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    """Releases the run directory and removes the temporary ones."""
    self.directory.close()

  # ---- the summary -------------------------------------------------------------------------

  def privacy_fields(self, dp: bool, epsilon_covers: dict, notes=()) -> dict:
    """The summary's privacy fields: `ledger` (the path of the ledger charged; None: none, or a
    temporary one), `private` (a DP algorithm with secret randomness),
    `privacy_note` (why not, and other caveats), `epsilon_covers` (which outputs ε covers),
    `secure_noise` (the DP step's noise sampled exactly); with the run's ledger, `epsilon_parts`
    (preprocessing selection and training, adding up to its ε) and, with its data directory,
    `dataset` (which data set, and whether its vocabulary is DP): both public."""
    reasons = ([] if dp else ["non-private training: no differential privacy"])
    reasons += [] if self.key.private else [self.key.note]
    public = list(epsilon_covers.get("public", [])) + [
        "epsilon_parts (accounting), ledger (its path) and dataset (the data set's path, id "
        "and vocab_privacy)"]
    fields = {"run_id": self.run_id, "epsilon_covers": dict(epsilon_covers, public=public),
              "secure_noise": self.secure_noise, "ledger": self.budget.ledger_file}
    public_seeded = []
    if self.budget.ledger is not None:
      fields["epsilon_parts"] = self.budget.ledger.parts()
      preprocessing = fields["epsilon_parts"]["preprocessing_selection"]["charges"]
      public_seeded = [f"preprocessing release '{c['label']}' drew its randomness from a public "
                       "seed: it is NOT differentially private"
                       for c in preprocessing if not c["private"]]
    if self.dataset is not None:
      fields["dataset"] = dict(self.dataset, vocab_privacy=identity.manifest_field(
          self.data, "vocab_privacy"))
    return dict(fields, private=dp and self.key.private and not public_seeded,
                privacy_note="; ".join(reasons + public_seeded + list(notes)) or None)

  def privacy_summary(self, plan, epsilon_covers, dp=None, notes=()) -> dict:
    """ε spent (None without a ledger), δ, the accountant, Poisson or not, and
    `privacy_fields` (with the plan's notes)."""
    ledger = self.budget.ledger
    return {"epsilon": ledger.epsilon_spent() if ledger is not None else None,
            "delta": plan.delta, "accountant": plan.accountant if ledger is not None else None,
            "poisson": bool(ledger is not None and plan.poisson),
            **self.privacy_fields(plan.private if dp is None else dp, epsilon_covers,
                                  plan.notes + list(notes))}


def summary_path(options: RunOptions) -> Optional[str]:
  """Where the JSON summary goes: `--summary-json` (`STDOUT`: printed by `report`), else
  RUN_DIR/summary.json with a run directory, else nowhere."""
  if options.summary_json:
    return options.summary_json
  return os.path.join(options.run_dir, SUMMARY_FILE) if options.run_dir else None


def write_summary(summary, path):
  """Writes the JSON summary (strict JSON: `atomic_io.strict`) to `path` atomically (None or
  `STDOUT`: no file)."""
  if path and path != STDOUT:
    atomic_io.write_json(path, summary, sort_keys=True)


def report(summary: dict, options: RunOptions, result: str) -> int:
  """Ends a command: its one-line `result` (the metric with its baseline, ε with its unit and δ:
  `dprec.workflows.result`) on stdout, followed by where the JSON summary is; with
  `--summary-json -` the JSON on stdout and the line on stderr. Returns 0 (the exit status)."""
  path = summary_path(options)
  if path == STDOUT:
    print(atomic_io.dumps(summary, indent=2, sort_keys=True))
    print(result, file=sys.stderr)
  else:
    print(f"{result}; summary: {path}" if path else
          f"{result} (JSON summary: --summary-json PATH, or - for stdout)")
  return 0
