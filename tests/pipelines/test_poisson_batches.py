"""The Poisson batch job and its reader: each row joins each step with probability q,
independently (Binomial(T, q) steps a row, Binomial(N, q) rows a step); the shards are a function
of the key (same key, same shards; another key, others); the key is in no output, option, log or
pickled transform; the reader streams steps in order and refuses what is not this run's; a cap
B_max keeps each step's first B_max rows."""
import base64
import errno
import hashlib
import json
import os
import pathlib
import pickle

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from dprec.errors import DprecError
from dprec.privacy.noise_key import NoiseKey
from dprec.training import batch_shards
from dprec.training import poisson
from pipelines import poisson_batches

BATCH, STEPS = 40, 24


def test_steps_joined_counts_are_binomial_per_row_and_per_step(assert_binomial_fit):
  rows, q, steps = 20000, 0.03, 60
  example, step = poisson.steps_joined(np.random.default_rng(0), rows, q, steps)
  assert np.all((step >= 0) & (step < steps))
  pairs = example * steps + step
  assert np.all(np.diff(pairs) > 0), "sorted by row, then step; no step twice"
  # A row's number of steps ~ Binomial(T, q): chi-square goodness of fit over the counts.
  per_row = np.bincount(np.bincount(example, minlength=rows), minlength=steps + 1)
  assert_binomial_fit(per_row, steps, q)
  # A step's batch size ~ Binomial(N, q), here over many steps of a smaller N.
  _, step = poisson.steps_joined(np.random.default_rng(1), 400, 0.05, 3000)
  sizes = np.bincount(step, minlength=3000)
  assert_binomial_fit(np.bincount(sizes), 400, 0.05)
  # Steps are joined independently: a row in step t is in step t + 1 with probability q.
  first = np.zeros((rows, steps), bool)
  example, step = poisson.steps_joined(np.random.default_rng(2), rows, q, steps)
  first[example, step] = True
  second = first[:, 1:][first[:, :-1]]
  assert stats.binomtest(int(second.sum()), len(second), q).pvalue > 1e-3


def test_steps_joined_skips_the_wrong_rates():
  with pytest.raises(ValueError, match="sampling_rate"):
    poisson.steps_joined(np.random.default_rng(0), 10, 0.0, 5)
  example, step = poisson.steps_joined(np.random.default_rng(0), 3, 1.0, 4)
  assert list(example) == [0] * 4 + [1] * 4 + [2] * 4 and list(step) == [0, 1, 2, 3] * 3


@pytest.fixture(scope="module")
def records(preprocessed_rows):
  """1,000 preprocessed rows in several TFRecord files; (files, N)."""
  files = preprocessed_rows(1000, 60_000)
  assert len(files) >= 3
  return files, 1000


def _secret_key(directory):
  key = NoiseKey.fresh()
  path = os.path.join(directory, "secret", "noise_key")
  os.makedirs(os.path.dirname(path), mode=0o700)
  with open(path, "wb") as stream:
    stream.write(key.key_bytes())
  return key, path


def _job(records, output, key, key_path, run_id="run-a", **changes):
  files, rows = records
  fields = dict(files=files, output=str(output), run_id=run_id,
                key_fingerprint=batch_shards.key_fingerprint(key), num_examples=rows,
                batch_size=BATCH, steps=STEPS, key_path=key_path, max_buckets=5)
  fields.update(changes)
  return poisson_batches.BatchJob(**fields)


def _plan(rows):
  return batch_shards.plan_fields(rows, BATCH, STEPS)


def _digests(directory):
  with open(os.path.join(directory, batch_shards.MANIFEST), encoding="utf-8") as stream:
    return [entry["sha256"] for entry in json.load(stream)["steps"]]


@pytest.fixture(scope="module")
def written(records, tmp_path_factory, in_process):
  """A secret key, its file, and the job's output with it."""
  base = tmp_path_factory.mktemp("run")
  key, key_path = _secret_key(str(base))
  summary = poisson_batches.run(_job(records, base / "batches", key, key_path), in_process)
  return key, key_path, str(base / "batches"), summary


def test_shards_hold_each_rows_drawn_steps_in_order(records, written):
  key, _, directory, summary = written
  files, rows = records
  manifest = batch_shards.read_manifest(directory, "run-a", key, _plan(rows))
  # The same draws, made here from the key: step t holds exactly the rows that drew t.
  expected = {t: [] for t in range(STEPS)}
  for file_index, path in enumerate(files):
    with open(path, "rb") as stream:
      file_records = batch_shards.unframe(stream.read(), path)
    example, step = poisson.steps_joined(
        key.numpy_rng(batch_shards.SAMPLING_PURPOSE, file_index), len(file_records),
        BATCH / rows, STEPS)
    for i, t in zip(example, step):
      expected[t].append(file_records[i])
  for entry in manifest["steps"]:
    assert batch_shards.read_shard(directory, entry) == expected[entry["step"]]
  sizes = [entry["rows"] for entry in manifest["steps"]]
  assert summary["peak_batch_size"] == max(sizes) and summary["rows_written"] == sum(sizes)
  batches = list(batch_shards.batch_dataset(directory, manifest, start=5).as_numpy_iterator())
  assert [len(labels) for _, labels in batches] == sizes[5:]


def test_a_cap_keeps_the_first_rows_of_each_steps_batch(records, written, tmp_path, in_process):
  key, key_path, directory, _ = written
  files, rows = records
  full = batch_shards.read_manifest(directory, "run-a", key, _plan(rows))
  cap = int(np.median([entry["rows"] for entry in full["steps"]]))
  poisson_batches.run(_job(records, tmp_path / "capped", key, key_path, max_batch_size=cap),
                      in_process)
  capped = batch_shards.read_manifest(str(tmp_path / "capped"), "run-a", key,
                                      batch_shards.plan_fields(rows, BATCH, STEPS, cap))
  assert capped["peak_batch_size"] == cap < full["peak_batch_size"]
  for whole, cut in zip(full["steps"], capped["steps"]):
    assert (batch_shards.read_shard(str(tmp_path / "capped"), cut)
            == batch_shards.read_shard(directory, whole)[:cap])


def test_same_key_same_shards_other_key_other_shards(records, written, tmp_path, in_process):
  key, key_path, directory, _ = written
  poisson_batches.run(_job(records, tmp_path / "again", key, key_path), in_process)
  assert _digests(tmp_path / "again") == _digests(directory)
  other, other_path = _secret_key(str(tmp_path / "other"))
  poisson_batches.run(_job(records, tmp_path / "other_batches", other, other_path), in_process)
  different = np.not_equal(_digests(tmp_path / "other_batches"), _digests(directory))
  assert different.mean() > 0.9


def test_the_key_is_in_no_output_option_log_or_transform(records, tmp_path, capfd, caplog,
                                                         in_process):
  key, key_path = _secret_key(str(tmp_path / "run"))
  job = _job(records, tmp_path / "run" / "batches", key, key_path)
  poisson_batches.run(job, in_process)
  raw = key.key_bytes()
  forms = [raw, raw.hex().encode(), raw.hex().upper().encode(), base64.b64encode(raw),
           str(int.from_bytes(raw, "little")).encode(), str(int.from_bytes(raw, "big")).encode()]
  for root, _, names in os.walk(tmp_path / "run" / "batches"):
    for name in names:
      with open(os.path.join(root, name), "rb") as stream:
        data = stream.read()
      assert not any(form in data for form in forms), name
  captured = capfd.readouterr()
  logs = (captured.out + captured.err + caplog.text).encode()
  assert not any(form in logs for form in forms)
  for transform in (poisson_batches.DrawSteps(job), poisson_batches.WriteSteps(job),
                    poisson_batches.Finish(job)):
    assert not any(form in pickle.dumps(transform) for form in forms)
  assert not any(form in repr(job).encode() for form in forms)


def test_reader_refuses_what_is_not_this_runs_finished_batches(records, written, tmp_path):
  key, _, directory, _ = written
  rows = records[1]
  copy = tmp_path / "copy"
  os.makedirs(copy)
  for name in os.listdir(directory):
    with open(os.path.join(directory, name), "rb") as source, open(copy / name, "wb") as target:
      target.write(source.read())
  manifest = batch_shards.read_manifest(str(copy), "run-a", key, _plan(rows))
  with pytest.raises(DprecError, match=r"batches.json: batches of run run-a, not of this run b"):
    batch_shards.read_manifest(str(copy), "b", key, _plan(rows))
  with pytest.raises(DprecError, match="batches.json: batches drawn with another key"):
    batch_shards.read_manifest(str(copy), "run-a", NoiseKey.fresh(), _plan(rows))
  with pytest.raises(DprecError, match="batches.json: batches drawn for the plan"):
    batch_shards.read_manifest(str(copy), "run-a", key, batch_shards.plan_fields(rows, 40, 99))
  entry = next(e for e in manifest["steps"] if e["rows"] > 1)
  shard = copy / entry["file"]
  data = shard.read_bytes()
  shard.write_bytes(data[:-7])  # truncated
  with pytest.raises(DprecError, match=f"{entry['file']}: .* bytes, the manifest says"):
    batch_shards.read_shard(str(copy), entry)
  shard.write_bytes(data[::-1])  # same size, other content (another run's shard of that size)
  with pytest.raises(DprecError, match=f"{entry['file']}: its SHA-256 differs"):
    batch_shards.read_shard(str(copy), entry)
  with pytest.raises(Exception) as raised:  # read in training: tf.data wraps the refusal
    list(batch_shards.batch_dataset(str(copy), manifest).as_numpy_iterator())
  assert "SHA-256 differs" in str(batch_shards.refusal(raised.value))
  assert batch_shards.refusal(ValueError("other")) is None
  os.remove(shard)
  with pytest.raises(DprecError, match=f"{entry['file']}: missing"):
    batch_shards.check_shards(str(copy), manifest)
  batch_shards.check_shards(str(copy), manifest, start=entry["step"] + 1)
  shard.write_bytes(data[:-7])
  with pytest.raises(DprecError, match=f"{entry['file']}: .* bytes, the manifest says"):
    batch_shards.check_shards(str(copy), manifest)
  os.remove(copy / batch_shards.MANIFEST)  # a job that did not finish
  with pytest.raises(DprecError, match="batches.json: no manifest: the batch job did not finish"):
    batch_shards.read_manifest(str(copy), "run-a", key, _plan(rows))
  assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_a_worker_reads_its_steps_shard_and_refuses_another_in_one_line(records, written,
                                                                        tmp_path):
  """`read_step` (what a parameter-server worker runs, in its graph) gives the step's batch
  `read_shard` gives; a shard of another step, altered, truncated or missing is refused in one
  line naming the file (through TF's error, as from a worker)."""
  key, _, directory, _ = written
  manifest = batch_shards.read_manifest(directory, "run-a", key, _plan(records[1]))
  read_step = tf.function(batch_shards.read_step)
  for entry in manifest["steps"]:
    got = read_step(batch_shards.step_reference(directory, entry))
    expected = batch_shards.parse_rows(tf.constant(batch_shards.read_shard(directory, entry),
                                                   tf.string))
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
      np.testing.assert_array_equal(a, b)
  first, second = [entry for entry in manifest["steps"] if entry["rows"] > 1][:2]
  shard = tmp_path / first["file"]
  data = (pathlib.Path(directory) / first["file"]).read_bytes()
  other = (pathlib.Path(directory) / second["file"]).read_bytes()
  for content, problem in [(other, "its rows differ"), (data[::-1], "its rows differ"),
                           (data[:-7], "its rows differ"), (None, "missing")]:
    if content is None:
      os.remove(shard)
    else:
      shard.write_bytes(content)
    with pytest.raises(tf.errors.OpError) as raised:
      read_step(batch_shards.step_reference(str(tmp_path), first))
    refused = str(batch_shards.refusal(raised.value))
    assert refused.startswith(f"{shard}: {problem}") and "\n" not in refused, refused
  odd = tmp_path / "a run [1]*?"  # glob characters in a run directory are plain characters
  odd.mkdir()
  (odd / first["file"]).write_bytes(data)
  read_step(batch_shards.step_reference(str(odd), first))


def test_a_rerun_replaces_an_unfinished_jobs_leftovers(records, written, tmp_path, in_process):
  key, key_path, directory, _ = written
  output = tmp_path / "batches"
  os.makedirs(output / poisson_batches.SPILL_DIR / "bucket-00000")
  (output / poisson_batches.SPILL_DIR / "bucket-00000" / "file-000000.npz").write_bytes(b"x")
  (output / batch_shards.shard_name(0)).write_bytes(b"half a shard")
  poisson_batches.run(_job(records, output, key, key_path), in_process)
  assert _digests(output) == _digests(directory)
  assert not os.path.exists(output / poisson_batches.SPILL_DIR)


def test_a_full_disk_mid_job_leaves_no_manifest_and_a_rerun_completes(records, written, tmp_path,
                                                                      monkeypatch, in_process):
  key, key_path, directory, _ = written
  write_shard = batch_shards.write_shard

  def disk_full_at_step_3(output, step, rows):
    if step == 3:
      raise OSError(errno.ENOSPC, "No space left on device")
    return write_shard(output, step, rows)

  monkeypatch.setattr(batch_shards, "write_shard", disk_full_at_step_3)
  with pytest.raises(Exception, match="No space left on device"):
    poisson_batches.run(_job(records, tmp_path / "full", key, key_path), in_process)
  with pytest.raises(DprecError, match="no manifest: the batch job did not finish"):
    batch_shards.read_manifest(str(tmp_path / "full"), "run-a", key, _plan(records[1]))
  monkeypatch.undo()
  poisson_batches.run(_job(records, tmp_path / "full", key, key_path), in_process)
  assert _digests(tmp_path / "full") == _digests(directory)


def test_same_shards_on_two_dask_workers(records, written, tmp_path):
  pytest.importorskip("distributed")
  key, key_path, directory, _ = written
  poisson_batches.run(_job(records, tmp_path / "dask", key, key_path),
                      ["--runner", "DaskRunner", "--dask-workers", "2"])
  assert _digests(tmp_path / "dask") == _digests(directory)
