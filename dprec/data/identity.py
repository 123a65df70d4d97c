"""Which data set a directory holds, so that a privacy ledger can tell whose charges are whose.

A preprocessing job draws a `dataset_id` when it starts (before it charges the ledger for its
DP releases), records it in those charges and writes it into its output's `manifest.json`. The
identity of a directory is `{"path": its absolute path, "id": its manifest's dataset_id}`; a
directory without one (raw TSV days, an output written before ids existed, a stream whose
first window has not closed) has `id` None and is known by its path alone
(`dprec.privacy.ledger.same_dataset`).
"""
import json
import os
import uuid
from typing import Optional

MANIFEST = "manifest.json"
DATASET_ID = "dataset_id"


def new_dataset_id() -> str:
  """A fresh id for a preprocessing output (random: two runs of one job are two data sets)."""
  return uuid.uuid4().hex


def public_vocab_privacy(mode: str) -> dict:
  """A manifest's `vocab_privacy` for a vocabulary built from exact counts of the input (the
  standing assumption of Ghazi et al., "Sparsity-Preserving Differentially Private Training of Large
  Embedding Models", arXiv:2311.08357: treated as public; a DP top-k vocabulary is the option)."""
  return {"dp": False, "private": False, "mode": mode,
          "note": "built from exact counts of the input: not differentially private; treated "
                  "as public, as Ghazi et al. 2023 (arXiv:2311.08357) do"}


def location(path: str) -> str:
  """`path` made absolute, unless it is a URL (gs://, s3://...) that already is."""
  return path if "://" in path else os.path.abspath(path)


def dataset_identity(directory: str, dataset_id: Optional[str] = None) -> dict:
  """{"path", "id"} of `directory`: `dataset_id` if given, else its manifest's (None if it has
  no readable manifest or no id in it)."""
  if dataset_id is None:
    dataset_id = manifest_field(directory, DATASET_ID)
  return {"path": location(directory), "id": dataset_id}


def manifest_field(directory: str, field: str):
  """`field` of `directory/manifest.json`, or None without one (the loaders report bad ones)."""
  try:
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as stream:
      manifest = json.load(stream)
  except (OSError, ValueError):
    return None
  return manifest.get(field) if isinstance(manifest, dict) else None
