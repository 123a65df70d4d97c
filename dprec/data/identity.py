"""Which data set a directory holds, so that a privacy ledger can tell whose charges are whose.

A data set's `dataset_id` is derived from its rows' source, never drawn: `fingerprint_id` hashes
the input files (names, sizes, every byte read) with the options that change which rows exist, so
the same input preprocessed again, or read as TSV days by `dprec train ctr`, is the same data set
and its ledger keeps counting (a fresh id would be a fresh budget on rows already charged). A
preprocessing job records it in its charges and in its output's `manifest.json`. The identity of
a directory is `{"path": its absolute path, "id": its manifest's dataset_id, or the fingerprint of
its day_N files}`; a directory with neither (an output written before ids existed, a stream whose
first window has not closed) has `id` None and is known by its path alone
(`dprec.privacy.ledger.same_dataset`).
"""
import hashlib
import json
import os
import re
import uuid
from typing import Callable, Optional, Sequence

MANIFEST = "manifest.json"
DATASET_ID = "dataset_id"


_READ_BYTES = 8 << 20
_DAY_FILE = re.compile(r"^day_(\d+)(\.gz)?$")


def new_dataset_id() -> str:
  """A fresh id, for an output whose input has no fixed content (a watched directory that grows:
  the streaming job draws one when it starts and keeps it in its manifest)."""
  return uuid.uuid4().hex


def fingerprint_id(paths: Sequence[str], row_options: Optional[dict] = None,
                   open_file: Optional[Callable] = None) -> str:
  """The `dataset_id` of the rows read from `paths`: SHA-256 of each file's name (not its
  directory: a copy elsewhere holds the same rows), size and bytes (as stored: a gzip file's
  compressed bytes), in order, and of `row_options` (the options that change which rows exist,
  e.g. padding short lines), first 32 hex digits. `open_file(path)`: a binary stream (default:
  the local file)."""
  digest = hashlib.sha256(b"dprec-dataset-v1\n")
  digest.update(json.dumps(row_options or {}, sort_keys=True).encode() + b"\n")
  for path in paths:
    content, size = hashlib.sha256(), 0
    with (open_file or _open_binary)(path) as stream:
      for piece in iter(lambda: stream.read(_READ_BYTES), b""):
        content.update(piece)
        size += len(piece)
    name = path.rstrip("/").rsplit("/", 1)[-1]
    digest.update(f"{name}\t{size}\t{content.hexdigest()}\n".encode())
  return digest.hexdigest()[:32]


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
  """{"path", "id"} of `directory`: `dataset_id` if given, else its manifest's, else the
  `fingerprint_id` of its Criteo `day_N` files (the id `dprec preprocess criteo` gives the same
  files), else None."""
  if dataset_id is None:
    dataset_id = manifest_field(directory, DATASET_ID) or _day_files_id(directory)
  return {"path": location(directory), "id": dataset_id}


def _day_files_id(directory: str) -> Optional[str]:
  """`fingerprint_id` of a directory's `day_N` files in day order; None without any."""
  try:
    names = os.listdir(directory) if not os.path.exists(os.path.join(directory, MANIFEST)) else []
  except OSError:
    return None
  days = sorted((int(m.group(1)), name) for name in names for m in [_DAY_FILE.match(name)] if m)
  return fingerprint_id([os.path.join(directory, name) for _, name in days]) if days else None


def _open_binary(path: str):
  return open(path, "rb")


def manifest_field(directory: str, field: str):
  """`field` of `directory/manifest.json`, or None without one (the loaders report bad ones)."""
  try:
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as stream:
      manifest = json.load(stream)
  except (OSError, ValueError):
    return None
  return manifest.get(field) if isinstance(manifest, dict) else None
