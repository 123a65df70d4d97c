"""The opt-in public users of `train seqrec --public-users F`.

A public rule picks them, independent of their data: user index u (1..U, `SequenceData.users`)
is public when the first 8 bytes of SHA-256("dprec public users:<salt>:<u>"), read as an
integer over 2^64, are below F. Anyone can recompute the set from U, F and the salt; it reveals
nothing about any user's items. Their rows are public data (the operator declares that these
users opted in): they are used as they are, charged nothing, and the DP guarantee covers the
other users only.
"""
import dataclasses
import hashlib

import numpy as np

from dprec.data.sequences import SequenceData
from dprec.errors import DprecError

RULE = "sha256('dprec public users:<salt>:<user index>')[:8] / 2^64 < fraction"


def is_public(users, fraction, salt=0):
  """bool [U]: which user indices the rule makes public."""
  if not 0 <= fraction < 1:
    raise DprecError(f"--public-users must be in [0, 1), got {fraction}")
  scale = float(2 ** 64)
  return np.array([int.from_bytes(hashlib.sha256(f"dprec public users:{salt}:{int(u)}".encode())
                                  .digest()[:8], "big") / scale < fraction for u in users], bool)


def _subset(data: SequenceData, keep):
  rows = np.flatnonzero(keep)
  return dataclasses.replace(data, users=data.users[rows], train=[data.train[r] for r in rows],
                             valid_items=data.valid_items[rows], test_items=data.test_items[rows])


def split(data: SequenceData, fraction, salt=0):
  """(private users' data, public users' data or None when no user is public)."""
  public = is_public(data.users, fraction, salt)
  if not public.any():
    return data, None
  if public.all():
    raise DprecError(f"--public-users {fraction} leaves no private user")
  return _subset(data, ~public), _subset(data, public)


def summary(fraction, salt, public_data, private_data):
  """The summary's description of the public users (public)."""
  return {"fraction": fraction, "salt": salt, "rule": RULE,
          "users": 0 if public_data is None else public_data.num_users,
          "private_users": private_data.num_users,
          "use": "their rows enter the item statistics exactly (no noise, charged nothing); "
                 "epsilon covers the private users only, and only they are evaluated"}
