"""The one place the library reaches its Apache Beam jobs (the top-level `pipelines` package).

The jobs use the library (`dprec.data`, `dprec.training`, `dprec.privacy`); the library never
imports a job. What launches one (`train ctr --out-of-core`, `make_private(...).write_batches`)
names it here by a string and passes the fields of its job description:

    summary = beam_jobs.launch("poisson_batches", beam_args, files=..., output=..., ...)

`JOBS` maps each name to its module and the dataclass describing a run of it; the module's
`run(job, beam_args)` runs it and returns its summary. The `dprec preprocess` command's parsers
are the jobs' own (`COMMAND_LINE`), registered through `register`. Modules are imported when a
job is launched: Beam takes seconds to import, and a command that runs no job never loads it.
"""
import dataclasses
import importlib
from typing import Sequence

from dprec.errors import DprecError


@dataclasses.dataclass(frozen=True)
class Job:
  """A Beam job: its module (with `run(job, beam_args) -> dict`) and its description's class."""
  module: str
  description: str


JOBS = {
    # Criteo TSV days → vocabulary and TFRecord rows (`dprec preprocess criteo`).
    "criteo": Job("pipelines.criteo", "CriteoJob"),
    # A run's row-level Poisson batches, one shard per step.
    "poisson_batches": Job("pipelines.poisson_batches", "BatchJob"),
    # A run's user-level batches: users sampled (ULS), or rows bounded per user, then sampled.
    "user_batches": Job("pipelines.user_batches", "UserBatchJob"),
}
COMMAND_LINE = "pipelines.cli"  # the `dprec preprocess` sub-command and its jobs' parsers


def launch(name: str, beam_args: Sequence[str] = (), **fields) -> dict:
  """Runs job `name` described by `fields` (its description's fields) with `beam_args` (Beam's
  pipeline options); returns the job's summary."""
  if name not in JOBS:
    raise DprecError(f"no Beam job {name!r}: the jobs are {', '.join(sorted(JOBS))}")
  module = importlib.import_module(JOBS[name].module)
  return module.run(getattr(module, JOBS[name].description)(**fields), list(beam_args))


def register(subparsers) -> None:
  """Adds `dprec preprocess` (the jobs' own parsers) to the `dprec` command."""
  importlib.import_module(COMMAND_LINE).register(subparsers)
