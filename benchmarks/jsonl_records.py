"""The JSONL files benchmarks append their runs to, one JSON object a line (so that a long grid
resumes where it stopped)."""
import json
import os


def read(path):
  """The records of `path`, in order; [] before the first is written. Blank lines are skipped."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as stream:
    return [json.loads(line) for line in stream if line.strip()]
