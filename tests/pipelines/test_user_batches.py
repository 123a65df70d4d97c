"""The user-level batch job: with user-level sampling a user's number of steps joined is
Binomial(T, q) and no batch holds more than k rows of one user, a user's rows grouped as one unit
(the format of the in-memory sampler); with rows bounded per user, at most k rows of a user are
ever used and each joins Binomial(T, q) steps; the shards are a function of the key; the
manifest is this run's and plan's, and rows of other users than planned are refused."""
import collections
import os

import numpy as np
import pytest
import tensorflow as tf

from dprec.errors import DprecError
from dprec.privacy.noise_key import NoiseKey
from dprec.privacy_unit import UNIT_KEY
from dprec.privacy_unit import USER_KEY
from dprec.training import batch_shards
from pipelines import user_batches

# The jobs here draw from a public seed (the run is not private), as tests may.
pytestmark = pytest.mark.filterwarnings("ignore::dprec.privacy.noise_key.InsecureNoiseWarning")
STEPS, K, SEED = 40, 3, 11


@pytest.fixture(scope="module")
def records(preprocessed_rows):
  """3,000 preprocessed rows of Zipf-active users in several files; (files, N, {user: rows})."""
  files = preprocessed_rows(3000, 250_000, users=600)
  assert len(files) >= 2
  rows = collections.defaultdict(set)
  for path in files:
    for index, user in enumerate(_users(batch_shards.unframe(open(path, "rb").read(), path))):
      rows[int(user)].add((path, index))
  return files, 3000, rows


def _users(records):
  spec = {USER_KEY: tf.io.FixedLenFeature([1], tf.int64)}
  return tf.io.parse_example(tf.constant(records, tf.string), spec)[USER_KEY].numpy()[:, 0]


def _job(records, output, sampling, batch_size, **changes):
  files, rows, users = records
  fields = dict(files=files, output=str(output), run_id="run-u",
                key_fingerprint=batch_shards.key_fingerprint(_key()), num_rows=rows,
                num_users=len(users), batch_size=batch_size, steps=STEPS, max_rows_per_user=K,
                sampling=sampling, insecure_noise_seed=SEED, max_buckets=7,
                rows_per_user_bucket=700)
  if sampling == "rows":
    fields["bounded_rows"] = sum(min(len(r), K) for r in users.values())
  fields.update(changes)
  return user_batches.UserBatchJob(**fields)


def _key():
  return NoiseKey.insecure(SEED)


def _shards(job):
  """Each step's (records, user ids) read through the checked manifest."""
  manifest = batch_shards.read_manifest(job.output, job.run_id, _key(), job.plan())
  steps = []
  for entry in manifest["steps"]:
    shard = batch_shards.read_shard(job.output, entry)
    steps.append((shard, _users(shard) if shard else np.zeros(0, np.int64)))
  return manifest, steps


def _bounded(job, manifest):
  """The records of the rows the job bounded to at most k a user, and their user ids."""
  rows = [record for path in batch_shards.bounded_files(job.output, manifest)
          for record in batch_shards.unframe(open(path, "rb").read(), path)]
  return rows, _users(rows)


@pytest.fixture(scope="module")
def uls(records, tmp_path_factory, in_process):
  job = _job(records, tmp_path_factory.mktemp("uls") / "batches", "users", 30)
  return job, user_batches.run(job, in_process)


def test_user_sampling_joins_binomial_steps_with_at_most_k_rows_a_user(records, uls,
                                                                      assert_binomial_fit):
  job, summary = uls
  _, _, users = records
  manifest, steps = _shards(job)
  assert manifest["plan"]["sampling_rate"] == pytest.approx(30 / len(users))
  joined = collections.Counter()
  drawn = collections.defaultdict(set)
  for shard, ids in steps:
    assert np.all(np.diff(ids) >= 0), "a user's rows contiguous, users in increasing id"
    step_users, counts = np.unique(ids, return_counts=True)
    assert counts.max(initial=0) <= K
    joined.update(step_users.tolist())
    for record, user in zip(shard, ids):
      drawn[int(user)].add(record)
    # Each user brings min(their rows, k): the rows are drawn, never dropped to fewer.
    assert all(c == min(len(users[u]), K) for u, c in zip(step_users, counts))
  per_user = np.array([joined[u] for u in users])
  assert_binomial_fit(np.bincount(per_user, minlength=STEPS + 1), STEPS, job.sampling_rate)
  # The k rows are drawn afresh each step: a heavy user's rows over the run exceed k.
  heavy = max(users, key=lambda u: len(users[u]))
  assert len(drawn[heavy]) > K and summary["rows_written"] == sum(len(i) for _, i in steps)
  # The releases' rows: min(rows, k) distinct rows of every user.
  bounded, ids = _bounded(job, manifest)
  assert len(set(bounded)) == len(bounded) == sum(min(len(r), K) for r in users.values())
  assert all(c == min(len(users[u]), K) for u, c in zip(*np.unique(ids, return_counts=True)))


def test_a_user_batch_parses_to_the_in_memory_samplers_units(uls):
  job, _ = uls
  _, steps = _shards(job)
  shard, ids = max(steps, key=lambda step: len(set(step[1].tolist())))
  features, labels = batch_shards.parse_user_rows(tf.constant(shard, tf.string))
  expected = np.unique(ids, return_inverse=True)[1]
  np.testing.assert_array_equal(features[UNIT_KEY].numpy(), expected)
  assert features[UNIT_KEY].dtype == tf.int32 and len(labels) == len(shard)
  empty, _ = batch_shards.parse_user_rows(tf.zeros([0], tf.string))
  assert empty[UNIT_KEY].shape == (0,)


def test_rows_bounded_per_user_then_sampled_as_rows(records, tmp_path, in_process,
                                                    assert_binomial_fit):
  _, _, users = records
  job = _job(records, tmp_path / "els", "rows", 60)
  user_batches.run(job, in_process)
  manifest, steps = _shards(job)
  used = collections.defaultdict(collections.Counter)
  for shard, ids in steps:
    assert len(set(shard)) == len(shard), "a row joins a step once"
    for record, user in zip(shard, ids):
      used[int(user)][record] += 1
  assert all(len(used[u]) <= K for u in used), "at most k rows of a user are ever used"
  # The releases read the kept rows: N_k of them, every row trained on among them.
  bounded, _ = _bounded(job, manifest)
  assert len(set(bounded)) == len(bounded) == job.bounded_rows
  assert {record for u in used for record in used[u]} <= set(bounded)
  assert max(c for u in used for c in used[u].values()) <= STEPS
  per_row = np.array([c for u in used for c in used[u].values()])
  kept = job.bounded_rows
  # Kept rows no step drew are the zero cell.
  histogram = np.bincount(per_row, minlength=STEPS + 1)
  histogram[0] = kept - len(per_row)
  assert_binomial_fit(histogram, STEPS, job.sampling_rate)


def test_same_key_same_shards_and_another_runs_batches_are_refused(records, uls, tmp_path,
                                                                    in_process):
  job, _ = uls
  again = _job(records, tmp_path / "again", "users", 30)
  os.makedirs(again.output)
  with open(os.path.join(again.output, batch_shards.shard_name(0)), "wb") as stream:
    stream.write(b"half a shard of an interrupted job")
  user_batches.run(again, in_process)
  assert ([e["sha256"] for e in _shards(again)[0]["steps"]]
          == [e["sha256"] for e in _shards(job)[0]["steps"]])
  assert not os.path.exists(os.path.join(again.output, user_batches.SPILL_DIR))
  with pytest.raises(DprecError, match="batches of run run-u, not of this run other"):
    batch_shards.read_manifest(job.output, "other", _key(), job.plan())
  with pytest.raises(DprecError, match="batches drawn for the plan"):
    batch_shards.read_manifest(job.output, "run-u", _key(),
                               _job(records, job.output, "rows", 30).plan())


def test_rows_of_other_users_than_planned_write_no_manifest(records, tmp_path, in_process):
  job = _job(records, tmp_path / "wrong", "users", 30, num_users=len(records[2]) + 1)
  with pytest.raises(Exception, match="planned for 3000 rows of"):
    user_batches.run(job, in_process)
  assert not os.path.exists(os.path.join(job.output, batch_shards.MANIFEST))
