"""What a training command says when Ctrl-C stops its run: what the run directory keeps, what the
ledger was charged, and the command that resumes it (`dprec.cli` prints it as its one line)."""
import os

from dprec.workflows import resume as resume_lib
from dprec.workflows import run_budget


def message(args, command) -> str:
  """The line `dprec` prints when Ctrl-C stops the run of parsed `args` (`command`: its command
  line): what its run directory keeps, what its ledger was charged, and how to resume."""
  run_dir = args.run_dir
  ledger = args.ledger or (run_dir and os.path.join(run_dir, run_budget.LEDGER_FILE))
  charged = ""
  if ledger and os.path.exists(ledger):
    from dprec.privacy import PrivacyLedger
    charged = (f"; the ledger {ledger} holds ε = {PrivacyLedger.read(ledger).epsilon_spent():.4g} "
               "spent, steps paid ahead included")
  if run_dir is None:
    return (f"interrupted: nothing kept to resume from (no --run-dir){charged}; a rerun starts "
            "over and pays again: give --run-dir DIR to make a run resumable")
  step = resume_lib.checkpointed_step(os.path.join(run_dir, resume_lib.CHECKPOINTS_DIR))
  kept = (f"its checkpoint at step {step}" if step else
          "no checkpoint (training had not started)")
  return (f"interrupted: {run_dir} keeps {kept}{charged}; the same command resumes it (no step "
          f"paid twice): {command}")
