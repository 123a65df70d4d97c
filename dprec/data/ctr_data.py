"""The training days and the held-out last day of a pCTR run, from either input format.

`load_data` reads a directory of Criteo TSV `day_N` files (vocabularies built from the training
days unless a saved, public one is given) or the output directory of `dprec preprocess criteo`
(its `manifest.json`, TFRecords and vocabulary); both yield `dprec.data.criteo.transform` dicts.
"""
import dataclasses
import os
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from dprec.errors import DprecError
from dprec.errors import InputError

# What to do about a malformed line of TSV days read in memory (every line must parse there).
TSV_FIX = ("fix or remove that line, or run `dprec preprocess criteo` on the days (it sets "
           "malformed lines aside as dead letters, within --max-bad-fraction) and train on its "
           "--output")
# What to do about a training line without a user id at the user level.
USER_FIX = ("--privacy-unit user reads each row's user id, a non-negative integer, from a 41st "
            "tab-separated field (`dprec synth criteo --users N` writes it): add it to every "
            "training line, or train at --privacy-unit row")


@dataclasses.dataclass
class CTRData:
  """Training and held-out arrays (`dprec.data.criteo.transform` dicts) and table sizes;
  `validation`, when set (`hold_out_validation`), is evaluated beside `eval` for model
  selection."""
  train: Dict[str, np.ndarray]
  eval: Dict[str, np.ndarray]
  vocab_sizes: Tuple[int, ...]
  source: str
  validation: Optional[Dict[str, np.ndarray]] = None


def hold_out_validation(data: CTRData, rows: int) -> CTRData:
  """`data` with its last `rows` training rows (the end of the last training day) moved to
  `validation`: hyperparameters chosen on it never see the held-out day. The vocabularies stay
  those of all training days (public, as in `load_data`)."""
  n = len(data.train["label"])
  if not 0 < rows < n:
    raise DprecError(f"validation rows must be in (0, {n}) training rows, got {rows}")
  return dataclasses.replace(data, train={k: v[:n - rows] for k, v in data.train.items()},
                             validation={k: v[n - rows:] for k, v in data.train.items()})


def load_data(directory: str, vocab_dir: Optional[str] = None, min_count: int = 1,
              user_ids: bool = False) -> CTRData:
  """Reads `directory`: a Beam output (manifest.json) or Criteo TSV day files; last day = eval.

  `user_ids`: the training rows must carry their user's id (`criteo.USER_COLUMN`, kept in
  `train`; refused in one line naming the file, line and field where one is missing or not an
  integer). Otherwise a user column is read where the files have one and dropped. The held-out
  day's user ids are always dropped: nothing computed from them is released."""
  if not os.path.exists(directory):
    raise DprecError(f"{directory}: --data does not exist")
  if not os.path.isdir(directory):
    raise DprecError(f"{directory}: --data must be a directory, not a file")
  if os.path.exists(os.path.join(directory, "manifest.json")):
    from dprec.data import criteo_tfrecord
    manifest = criteo_tfrecord.load_manifest(directory)
    days = [entry["day"] for entry in manifest["days"]]
    if len(days) < 2:
      raise DprecError(f"{directory}/manifest.json: need at least 2 days (the last is held out)")

    def read(selected):
      batches = list(criteo_tfrecord.criteo_tfrecord_dataset(directory, selected, 65536)
                     .as_numpy_iterator())
      return {key: np.concatenate([np.asarray(b[key]) for b in batches]) for key in batches[0]}
    train, held_out = read(days[:-1]), read(days[-1:])
    if user_ids and criteo_tfrecord.USER_COLUMN not in train:
      raise DprecError(f"{directory}/manifest.json: its records carry no "
                       f"{criteo_tfrecord.USER_COLUMN}; {USER_FIX}")
    return CTRData(_users_kept(train, user_ids), _users_kept(held_out, False),
                   tuple(criteo_tfrecord.vocab_sizes(manifest)), "beam-manifest")
  from dprec.data import criteo
  files = criteo.criteo_day_files(directory)
  if len(files) < 2:
    raise DprecError(f"{directory}: need at least 2 day_N files (the last is held out)")
  vocab = criteo.CriteoVocabulary.load(vocab_dir) if vocab_dir else None
  if user_ids:
    require_user_column(files[:-1])
  with_users = user_ids or criteo.has_user_column(files[0])
  try:
    vocab = vocab or criteo.CriteoVocabulary.build(files[:-1], min_count=min_count,
                                                   user_column=with_users)
    train = criteo.load_criteo(files[:-1], vocab, user_column=with_users)
    held_out = criteo.load_criteo(files[-1:], vocab,
                                  user_column=criteo.has_user_column(files[-1]))
  except InputError as error:
    if error.reason.startswith("cut:"):  # the rest of the file is missing: it names the fix
      raise
    raise with_fix(error, user_ids, files[:-1]) from None
  if not len(train["label"]) or not len(held_out["label"]):
    raise DprecError(f"{directory}: the training days and the held-out day must not be empty")
  return CTRData(_users_kept(train, user_ids), _users_kept(held_out, False), vocab.sizes,
                 "criteo-tsv")


def require_user_column(paths: Sequence[str]) -> None:
  """Refuses, naming its first line, a training file without the user id column."""
  from dprec.data import criteo
  for path in paths:
    if not criteo.has_user_column(path):
      raise InputError(path, 1, criteo.USER_COLUMN, f"missing (the line has no 41st field); "
                       f"{USER_FIX}")


def with_fix(error: InputError, user_ids: bool, train_files: Sequence[str]) -> InputError:
  """`error` (a malformed line of TSV days) with what to do about it: `USER_FIX` for a training
  line whose user id is missing or bad at the user level (`user_ids`), else `TSV_FIX`."""
  from dprec.data.criteo import USER_COLUMN
  fix = USER_FIX if user_ids and error.path in train_files and (
      error.field in ("line", USER_COLUMN)) else TSV_FIX
  return InputError(error.path, error.line, error.field, f"{error.reason}; {fix}")


def _users_kept(rows: Dict[str, np.ndarray], keep: bool) -> Dict[str, np.ndarray]:
  """`rows` with their user ids only if `keep`."""
  from dprec.data.criteo import USER_COLUMN
  return rows if keep else {k: v for k, v in rows.items() if k != USER_COLUMN}
