"""What a command's `--data` holds, so that a command given the data of another one refuses it
before anything runs, naming the command (and the preprocessing job) that takes it."""
import os
import re
from typing import Optional

from dprec.data import identity
from dprec.data.criteo_tfrecord import FORMAT as CRITEO_FORMAT
from dprec.data.sequences import FORMAT as SEQUENCES_FORMAT
from dprec.errors import DprecError

CRITEO_OUTPUT = "criteo output"  # `dprec preprocess criteo` (or its --streaming job)
SEQUENCES_OUTPUT = "sequences output"  # `dprec preprocess sequences`
CRITEO_DAYS = "criteo days"  # a directory of Criteo TSV day_N files
CRITEO_FILE = "criteo file"  # one of them
INTERACTIONS = "interactions"  # a file of interaction lines, `dprec preprocess sequences`' input
CRITEO_TABS = 39  # a Criteo line: label, 13 integer and 26 categorical fields (user_id after)
_DAY_FILE = re.compile(r"day_\d+(\.gz)?$")
SEQREC = "train seqrec"
CLICK_LOGS = ("train ctr", "stream")  # the commands reading Criteo click logs


def kind(path) -> Optional[str]:
  """Which of the kinds above `path` is (None: another, or none: the loaders say what is
  wrong)."""
  if os.path.isdir(path):
    found = {CRITEO_FORMAT: CRITEO_OUTPUT, SEQUENCES_FORMAT: SEQUENCES_OUTPUT}.get(
        identity.manifest_field(path, "format"))
    if found is None and any(_DAY_FILE.match(name) for name in os.listdir(path)):
      found = CRITEO_DAYS
    return found
  line = _first_line(path)
  if line is None:
    return None
  return CRITEO_FILE if line.count("\t") >= CRITEO_TABS else INTERACTIONS


def _first_line(path) -> Optional[str]:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return next((line for line in f if line.strip()), None)
  except OSError:
    return None


def sequences_format(path) -> str:
  """`dprec preprocess sequences --format` of the interaction lines in `path`, from its first:
  movielens ('::' or four tab-separated fields), csv, else sasrec ('user item')."""
  line = _first_line(path) or ""
  if "::" in line or line.count("\t") == 3:
    return "movielens"
  return "csv" if "," in line else "sasrec"


def refuse_other_commands_data(path, command):
  """Raises `DprecError` if `command` (`train ctr`, `stream` or `train seqrec`) was given the
  data another command or a preprocessing job takes, naming that one."""
  found = kind(path)
  prepare = found == INTERACTIONS and (
      f"`dprec preprocess sequences --input {path} --format {sequences_format(path)} --output "
      "DIR`")
  if command in CLICK_LOGS:
    reads = (f"`dprec {command}` reads Criteo click logs"
             + (" (a `dprec preprocess criteo --streaming` output)" if command == "stream"
                else " (a directory of day_N files or a `dprec preprocess criteo` output)"))
    refusal = {
        SEQUENCES_OUTPUT: f"a `dprec preprocess sequences` output, which `dprec {SEQREC} "
                          f"--data {path} --epsilon E` trains on",
        INTERACTIONS: f"interaction lines, which {prepare} prepares for `dprec {SEQREC} --data "
                      "DIR`",
        CRITEO_FILE: "a Criteo day file: give --data its directory, holding day_0, day_1, ...",
    }.get(found)
    if command == "stream" and found == CRITEO_DAYS:
      refusal = (f"Criteo day files: `dprec preprocess criteo --streaming --input {path} "
                 "--output OUT` writes the periods `dprec stream --data OUT` trains on")
    if refusal:
      raise DprecError(f"{path}: {refusal}; {reads}")
  elif command == SEQREC:
    refusal = {
        CRITEO_OUTPUT: f"Criteo click logs, which `dprec train ctr --data {path}` trains on",
        CRITEO_DAYS: f"Criteo click logs, which `dprec train ctr --data {path}` trains on",
        CRITEO_FILE: "a Criteo day file, whose directory `dprec train ctr --data` trains on",
        INTERACTIONS: f"interaction lines, not yet preprocessed: run {prepare}, then `dprec "
                      f"{SEQREC} --data DIR`",
    }.get(found)
    if refusal:
      raise DprecError(f"{path}: {refusal}; `dprec {SEQREC}` reads a `dprec preprocess "
                       "sequences` output")
