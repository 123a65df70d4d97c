"""`train ctr --out-of-core`: the model trained from the shards is the one the same batches train
in memory; a run stopped mid-way resumes at the next unpaid step's shard and ends where an
uninterrupted run ends; the summary says out of core; another run's or an altered shard is
refused in one line naming the file; the key is in no file outside the run's secret; a batch cap
is charged as δ, and one the plan cannot afford is refused. At the user level (ULS and ELS) a run
plans, pays and summarises as the in-memory run does, its one-off releases read at most k rows of
a user, a stopped run resumes on its batches, and TSV days with a user column are read (a bad id
refused in one line naming file, line and field, nothing charged)."""
import json
import os
import shutil
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from dprec import cli
from dprec.data import criteo
from dprec.data import criteo_tfrecord
from dprec.data.ctr_data import load_data
from dprec.optimizers.dp_optimizer import NOISE_PURPOSE
from dprec.privacy import truncation
from dprec.training import batch_shards
from dprec.training import output_layer
from dprec.training import poisson
from dprec.workflows import ctr
from dprec.workflows import out_of_core
from dprec.workflows import run as run_lib

pytestmark = pytest.mark.commands

IN_PROCESS = ("direct_num_workers=1", "direct_running_mode=in_memory")
BEAM = [arg for option in IN_PROCESS for arg in ("--beam-option", option)]
STEPS, BATCH, EPSILON = 9, 48, 2.0
K, HEAVY_USER, HEAVY_ROWS = 3, 10**9, 200
USER_LEVEL = ("--privacy-unit", "user", "--max-rows-per-user", str(K))


@pytest.fixture(scope="module")
def data_dir(criteo_days):
  return criteo_days(1500, 3)


def _argv(data_dir, run_dir, *extra):
  return ["train", "ctr", "--data", data_dir, "--out-of-core", "--epsilon", str(EPSILON),
          "--batch-size", str(BATCH), "--steps", str(STEPS), "--hidden-units", "8",
          "--checkpoint-every", "3", "--charge-every", "2", "--no-progress", "--run-dir",
          str(run_dir), "--summary-json", os.path.join(run_dir, "summary.json"), *BEAM, *extra]


def _fail_at_step_7(monkeypatch, data_dir, run_dir, *argv):
  """Runs `train ctr` out of core with a fault at step 7 (after the checkpoint of step 6): the
  run fails; the fault stays injected until `monkeypatch.undo()`. Returns the unpatched reader."""
  read_shard = batch_shards.read_shard

  def fail_at_step_7(directory, entry):
    if entry["step"] == 7:
      raise RuntimeError("fault injected at step 7")
    return read_shard(directory, entry)

  monkeypatch.setattr(batch_shards, "read_shard", fail_at_step_7)
  assert cli.main(_argv(data_dir, run_dir, *argv)) != 0
  return read_shard


def _summary(run_dir):
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as stream:
    return json.load(stream)


def _final_weights(run_dir):
  """The final checkpoint's model weights and optimizer slots (not the Keras metric states)."""
  latest = open(os.path.join(run_dir, "checkpoints", "LATEST"), encoding="utf-8").read().strip()
  reader = tf.train.load_checkpoint(os.path.join(run_dir, "checkpoints", latest, "model"))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if name.startswith(("model/", "optimizer/")) and "metrics/" not in name
          and "_tracker/" not in name}


def test_shards_train_the_model_the_same_batches_train_in_memory(data_dir):
  options = ctr.CTRTrainOptions(data=data_dir, epsilon=EPSILON, batch_size=BATCH, steps=STEPS,
                                hidden_units=(8,), insecure_noise_seed=5, progress=False,
                                out_of_core=True, beam_options=IN_PROCESS)
  with out_of_core.workspace(None) as base, pytest.warns(UserWarning):
    data = out_of_core.prepare(data_dir, base, 1, out_of_core.beam_args(None, None, IN_PROCESS))
    with run_lib.Run(ctr.COMMAND, insecure_noise_seed=5) as run:
      plan = ctr.plan_privacy(options, data.train_rows)
      directory, manifest, _ = out_of_core.write_batches(
          data, base, run, BATCH, STEPS, out_of_core.beam_args(None, None, IN_PROCESS))
      streamed, _ = ctr.build_model(options, data, plan, run)
      resume = run.checkpoints.resume(streamed, options)
      _, callbacks = run.trainer.callbacks({NOISE_PURPOSE: streamed.dp_optimizer.generator},
                                           resume)
      out_of_core.fit(run, streamed, directory, manifest, STEPS, resume, callbacks)

      # In memory: the rows as `train ctr` loads them, batched by the draws the job made.
      memory = load_data(data.records)
      memory.train = {key: np.concatenate([memory.train[key], memory.eval[key]])
                      for key in memory.train}  # the records hold the training days only
      batches = [[] for _ in range(STEPS)]
      offset = 0
      for index, path in enumerate(criteo_tfrecord.day_files(data.records)):
        with open(path, "rb") as stream:
          rows = len(batch_shards.unframe(stream.read(), path))
        example, step = poisson.steps_joined(
            run.key.numpy_rng(batch_shards.SAMPLING_PURPOSE, index), rows,
            BATCH / data.train_rows, STEPS)
        for i, t in zip(example, step):
          batches[t].append(offset + i)
        offset += rows
      assert offset == data.train_rows == len(memory.train["label"])
      assert [len(b) for b in batches] == [e["rows"] for e in manifest["steps"]]
      in_memory, _ = ctr.build_model(options, memory, plan, run)
      features = {key: memory.train[key] for key in (ctr.ctr.CAT_FEATURES, ctr.ctr.INT_FEATURES)}
      dataset = tf.data.Dataset.from_generator(
          lambda: (({k: v[b] for k, v in features.items()}, memory.train["label"][b])
                   for b in map(np.asarray, batches)),
          output_signature=({k: tf.TensorSpec((None,) + v.shape[1:], tf.as_dtype(v.dtype))
                             for k, v in features.items()},
                            tf.TensorSpec([None], tf.as_dtype(memory.train["label"].dtype))))
      _, callbacks = run.trainer.callbacks({NOISE_PURPOSE: in_memory.dp_optimizer.generator},
                                         run.checkpoints.resume(in_memory, options))
      in_memory.fit(dataset, epochs=1, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0)
  for got, expected in zip(streamed.trainable_variables, in_memory.trainable_variables):
    np.testing.assert_array_equal(got.numpy(), expected.numpy(), err_msg=got.name)


@pytest.mark.slow  # four out-of-core runs: starts first, not at the end of a worker's share
def test_a_stopped_run_resumes_at_the_next_shard_and_ends_as_an_uninterrupted_one(
    data_dir, tmp_path, monkeypatch):
  plain, stopped = tmp_path / "plain", tmp_path / "stopped"
  assert cli.main(_argv(data_dir, plain)) == 0
  whole = _summary(plain)
  assert whole["out_of_core"] is True and whole["steps"] == STEPS
  assert whole["peak_batch_size"] >= BATCH and whole["batch_dir"].startswith(str(plain))
  assert whole["batch_job"]["rows_read"] == whole["train_rows"]
  key = (plain / "secret" / "noise_key").read_bytes()
  for root, _, names in os.walk(plain):
    for name in names:
      if os.path.join(root, name) != str(plain / "secret" / "noise_key"):
        data = open(os.path.join(root, name), "rb").read()
        assert key not in data and key.hex().encode() not in data, name

  read_shard = _fail_at_step_7(monkeypatch, data_dir, stopped, "--insecure-noise-seed", "1")
  assert not os.path.exists(stopped / "summary.json")
  monkeypatch.undo()
  shutil.rmtree(plain)  # the same run once more, with the same public seed, uninterrupted
  assert cli.main(_argv(data_dir, plain, "--insecure-noise-seed", "1")) == 0
  seen = []

  def record(directory, entry):
    seen.append(entry["step"])
    return read_shard(directory, entry)

  monkeypatch.setattr(batch_shards, "read_shard", record)
  assert cli.main(_argv(data_dir, stopped, "--insecure-noise-seed", "1")) == 0
  resumed = _summary(stopped)
  assert resumed["resumed_from_step"] == 6 and seen == [6, 7, 8]
  assert resumed["batch_job"] == "reused: this run's batches were on disk"
  expected, got = _final_weights(plain), _final_weights(stopped)
  assert expected.keys() == got.keys()
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
  assert resumed["epsilon"] == pytest.approx(_summary(plain)["epsilon"], rel=1e-12)


def test_another_runs_or_an_altered_shard_is_refused_in_one_line(data_dir, tmp_path, capsys):
  first, second = tmp_path / "first", tmp_path / "second"
  assert cli.main(_argv(data_dir, first, "--steps", "4")) == 0
  os.makedirs(second / out_of_core.DIRECTORY)
  shutil.copytree(first / out_of_core.DIRECTORY / out_of_core.BATCHES,
                  second / out_of_core.DIRECTORY / out_of_core.BATCHES)
  capsys.readouterr()
  assert cli.main(_argv(data_dir, second, "--steps", "4")) == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert "batches.json: batches of run" in error and "not of this run" in error

  shutil.rmtree(first / "checkpoints")  # train again from step 0, on an altered shard 2
  shard = first / out_of_core.DIRECTORY / out_of_core.BATCHES / batch_shards.shard_name(2)
  shard.write_bytes(shard.read_bytes()[::-1])
  assert cli.main(_argv(data_dir, first, "--steps", "4")) != 0
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert f"{batch_shards.shard_name(2)}: its SHA-256 differs" in error


def test_dp_fest_counts_rows_in_one_pass_as_in_memory(data_dir, tmp_path):
  with out_of_core.workspace(None) as base:
    data = out_of_core.prepare(data_dir, base, 1, out_of_core.beam_args(None, None, IN_PROCESS))
    memory = load_data(data.records)
    ids = np.concatenate([memory.train["cat_features"], memory.eval["cat_features"]])
    for table, (got, size) in enumerate(zip(data.id_counts(), data.vocab_sizes)):
      np.testing.assert_array_equal(got, np.bincount(ids[:, table], minlength=size))
  assert cli.main(_argv(data_dir, tmp_path / "run", "--algorithm", "dp_adafest_plus",
                        "--top-k", "200", "--steps", "3")) == 0
  assert _summary(tmp_path / "run")["selection_epsilon"] > 0


def test_runs_above_the_row_limit_train_out_of_core_by_default(data_dir, tmp_path):
  rows = out_of_core.estimated_train_rows(data_dir)
  assert 1000 * 0.8 < rows < 1000 * 1.25  # 2 training days of 500 rows, from their bytes
  argv = [arg for arg in _argv(data_dir, tmp_path / "run", "--steps", "2")
          if arg != "--out-of-core"]
  assert cli.main(argv + ["--out-of-core-above", "500"]) == 0
  assert _summary(tmp_path / "run")["out_of_core"] is True
  argv = [arg for arg in _argv(data_dir, tmp_path / "memory", "--steps", "2")
          if arg not in ["--out-of-core", *BEAM]]
  assert cli.main(argv) == 0
  assert "out_of_core" not in _summary(tmp_path / "memory")


# The chief of a parameter-server run, unable to read a shard: the workers must read them.
CHIEF_READS_NO_SHARD = """import sys
from dprec.training import batch_shards
def chief_read(*args, **kwargs):
  raise AssertionError("the chief read a shard")
batch_shards.read_shard = batch_shards.batch_dataset = chief_read
from dprec import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.multiprocess
def test_parameter_servers_train_from_the_shards_as_one_device_does(data_dir, tmp_path):
  """Each worker reads its step's shard, the chief none (it cannot here); with one worker the
  run is the one-device run (same key, same batches and noise); a shard altered after the
  chief's up-front check is refused by the worker, in one line naming the file."""
  seed = ("--insecure-noise-seed", "2", "--steps", "4")
  assert cli.main(_argv(data_dir, tmp_path / "one", *seed)) == 0
  # In a process of its own: a process that joined a cluster stays in it (later tests' devices).
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
      "PYTHONPATH")])))
  ps_argv = ("--strategy", "parameter_server", "--local-workers", "1", "--local-ps", "1")
  command = [sys.executable, "-c", CHIEF_READS_NO_SHARD, *_argv(
      data_dir, tmp_path / "ps", *seed, *ps_argv)]
  subprocess.run(command, check=True, timeout=900, env=env)
  one, ps = _summary(tmp_path / "one"), _summary(tmp_path / "ps")
  assert ps["strategy"] == "parameter_server" and ps["out_of_core"] is True
  assert ps["steps"] == one["steps"] == 4
  assert ps["auc"] == pytest.approx(one["auc"], abs=1e-4)
  assert ps["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)

  shutil.rmtree(tmp_path / "ps" / "checkpoints")  # train again from step 0, on an altered shard 2
  shard = tmp_path / "ps" / out_of_core.DIRECTORY / out_of_core.BATCHES / batch_shards.shard_name(2)
  shard.write_bytes(shard.read_bytes()[::-1])  # the same size: the chief's up-front check passes
  refused = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
  assert refused.returncode == 2
  assert refused.stderr.strip().splitlines()[-1] == (
      f"dprec: error: {shard}: its rows differ from the manifest (a shard of another run, "
      "truncated or corrupted)")


@pytest.mark.parametrize("extra, message", [
    (("--fixed-batches",), "drop --fixed-batches"),
    (("--strategy", "mirrored"), "one device or with --strategy parameter_server"),
])
def test_what_out_of_core_does_not_do_is_refused(data_dir, tmp_path, capsys, extra, message):
  assert cli.main(_argv(data_dir, tmp_path / "run", *extra)) == 2
  assert message in capsys.readouterr().err


def test_a_batch_cap_is_charged_as_delta_and_one_the_plan_cannot_afford_refused(data_dir, tmp_path,
                                                                               cli_error):
  # In memory (the job's truncation: tests/pipelines/test_poisson_batches.py; the same plan and
  # charge out of core: tests/workflows/test_make_private_batches.py).
  rows = sum(sum(1 for _ in open(path, encoding="utf-8"))
             for path in criteo.criteo_day_files(data_dir)[:-1])
  cap = truncation.smallest_max_batch_size(rows, BATCH / rows, STEPS, EPSILON,
                                           truncation.MAX_DELTA_SHARE / rows)

  def argv(run_dir, max_batch_size):
    return [arg for arg in _argv(data_dir, run_dir) if arg != "--out-of-core"] + [
        "--max-batch-size", str(max_batch_size)]

  assert cli.main(argv(tmp_path / "capped", cap)) == 0
  summary = _summary(tmp_path / "capped")
  assert summary["train_rows"] == rows and summary["max_batch_size"] == cap
  assert summary["truncation_delta"] == pytest.approx(
      truncation.truncation_delta(rows, BATCH / rows, STEPS, cap, EPSILON))
  assert "truncated to" in summary["privacy_note"]
  with open(tmp_path / "capped" / "ledger.json", encoding="utf-8") as stream:
    charges = json.load(stream)["charges"]
  assert [c["delta"] for c in charges if c["label"] == truncation.LABEL] == [
      summary["truncation_delta"]]

  error = cli_error(argv(tmp_path / "low", cap - 1))
  assert f"--max-batch-size {cap - 1}:" in error and f"a cap of at least {cap}" in error


@pytest.fixture(scope="module")
def heavy_days(user_days, tmp_path_factory):
  """`user_days` with one more training user, of `HEAVY_ROWS` clicked rows: a release reading
  all rows moves its label sum by `HEAVY_ROWS`, one reading at most k rows a user by at most k."""
  directory = tmp_path_factory.mktemp("heavy_user")
  for name in os.listdir(user_days):
    shutil.copy(os.path.join(user_days, name), directory / name)
  fields = (directory / "day_0").read_text(encoding="utf-8").splitlines()[0].split("\t")
  with open(directory / "day_0", "a", encoding="utf-8") as stream:
    stream.write(("\t".join(["1"] + fields[1:-1] + [str(HEAVY_USER)]) + "\n") * HEAVY_ROWS)
  return str(directory)


def _bounded_users(run_dir):
  """The user ids of the rows the run's user batch job bounded to at most k a user."""
  directory = run_dir / out_of_core.DIRECTORY / out_of_core.BATCHES
  manifest = json.loads((directory / batch_shards.MANIFEST).read_text(encoding="utf-8"))
  spec = {"user_id": tf.io.FixedLenFeature([1], tf.int64)}
  return np.concatenate([
      tf.io.parse_example(tf.constant(batch_shards.unframe(open(path, "rb").read(), path)),
                          spec)["user_id"].numpy()[:, 0]
      for path in batch_shards.bounded_files(str(directory), manifest)])


# ELS at a small ε: its σ is then large enough (per row, for k rows) that the mixture of
# Gaussians' PLD stays cheap (dp_accounting computes it point by point on its grid).
@pytest.mark.parametrize("sampling, batch, epsilon", [("users", 16, EPSILON), ("rows", 16, 0.05)])
def test_user_level_out_of_core_plans_pays_and_summarises_as_in_memory(
    heavy_days, tmp_path, monkeypatch, user_level_epsilon, sampling, batch, epsilon):
  """ULS and ELS out of core: the in-memory run's summary fields and plan for the same U, N_k,
  B, T and k, ε equal to dp_accounting's; the DP base rate and DP Platt scaling read the N_k
  rows bounded to at most k a user (the heavy user moves their label sums by at most k)."""
  if sampling == "rows" and not hasattr(dp_accounting.dp_event, "MixtureOfGaussiansDpEvent"):
    pytest.skip("dp-accounting < 0.4.4: no mixture of Gaussians PLD")
  argv = [*USER_LEVEL, "--user-sampling", sampling, "--batch-size", str(batch), "--steps", "4",
          "--epsilon", str(epsilon)]
  memory = tmp_path / "memory"
  assert cli.main([a for a in _argv(heavy_days, memory, *argv) if a != "--out-of-core"]) == 0
  released = {}
  base_rate_of_sum, recalibrate = ctr.base_rate_of_sum, output_layer.recalibrate

  def record_base_rate(total, n, *args):
    released["base_rate"] = total, n
    return base_rate_of_sum(total, n, *args)

  def record_calibration(layer, loss, scores, labels, *args, **kwargs):
    released["calibration"] = np.asarray(labels)
    return recalibrate(layer, loss, scores, labels, *args, **kwargs)

  monkeypatch.setattr(ctr, "base_rate_of_sum", record_base_rate)
  monkeypatch.setattr(output_layer, "recalibrate", record_calibration)
  assert cli.main(_argv(heavy_days, tmp_path / "disk", *argv)) == 0
  summary, in_memory = _summary(tmp_path / "disk"), _summary(memory)

  train = load_data(heavy_days, user_ids=True).train
  counts = np.unique(train["user_id"], return_counts=True)[1]
  bounded = int(np.minimum(counts, K).sum())
  assert summary["out_of_core"] is True and set(in_memory) <= set(summary)
  assert summary["privacy_unit"] == "user" and summary["user_sampling"] == sampling
  assert summary["users"] == len(counts) and summary["max_rows_per_user"] == K
  assert summary["bounded_rows"] == bounded
  for field in ("privacy_unit", "user_sampling", "max_rows_per_user", "users", "bounded_rows",
                "train_rows", "delta", "sampling_rate", "noise_multiplier", "sigma1", "sigma2",
                "base_rate_noise_multiplier", "calibration_noise_multiplier", "epsilon",
                "epsilon_covers", "steps"):
    assert summary[field] == in_memory[field], field
  options = ctr.CTRTrainOptions(data=heavy_days, epsilon=epsilon, batch_size=batch, steps=4,
                                privacy_unit="user", max_rows_per_user=K, user_sampling=sampling)
  plan = ctr.plan_privacy(options, len(counts) if sampling == "users" else bounded,
                          num_users=len(counts))
  assert summary["noise_multiplier"] == plan.noise_multiplier
  assert summary["delta"] == pytest.approx(1 / len(counts))
  assert summary["epsilon"] == pytest.approx(user_level_epsilon(summary, 4, K), rel=1e-3)
  assert 0.95 * epsilon < summary["epsilon"] <= epsilon * (1 + 1e-6)
  charges = json.loads((tmp_path / "disk" / "ledger.json").read_text(encoding="utf-8"))
  assert all(charge["unit"] == "user" for charge in charges["charges"])

  others = int(train["label"][train["user_id"] != HEAVY_USER].sum())
  total, rows = released["base_rate"]
  assert rows == bounded < len(train["label"]) and total <= others + K
  assert len(released["calibration"]) == bounded and released["calibration"].sum() <= others + K
  users = _bounded_users(tmp_path / "disk")
  assert len(users) == bounded and np.unique(users, return_counts=True)[1].max() == K


@pytest.mark.slow  # four out-of-core runs
def test_a_stopped_user_level_run_resumes_on_its_batches_and_another_runs_are_refused(
    user_days, tmp_path, monkeypatch, capsys):
  argv = (*USER_LEVEL, "--batch-size", "16", "--insecure-noise-seed", "1")
  plain, stopped, other = tmp_path / "plain", tmp_path / "stopped", tmp_path / "other"
  assert cli.main(_argv(user_days, plain, *argv)) == 0
  read_shard = _fail_at_step_7(monkeypatch, user_days, stopped, *argv)
  seen = []

  def record(directory, entry):
    seen.append(entry["step"])
    return read_shard(directory, entry)

  monkeypatch.setattr(batch_shards, "read_shard", record)
  assert cli.main(_argv(user_days, stopped, *argv)) == 0
  resumed = _summary(stopped)
  assert resumed["resumed_from_step"] == 6 and seen == [6, 7, 8]
  assert resumed["batch_job"] == "reused: this run's batches were on disk"
  assert resumed["epsilon"] == pytest.approx(_summary(plain)["epsilon"], rel=1e-12)
  expected, got = _final_weights(plain), _final_weights(stopped)
  assert expected.keys() == got.keys()
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)

  os.makedirs(other / out_of_core.DIRECTORY)
  shutil.copytree(plain / out_of_core.DIRECTORY / out_of_core.BATCHES,
                  other / out_of_core.DIRECTORY / out_of_core.BATCHES)
  capsys.readouterr()
  assert cli.main(_argv(user_days, other, *argv)) == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert "batches.json: batches of run" in error and "not of this run" in error
  assert not os.path.exists(other / "ledger.json") or not json.loads(
      (other / "ledger.json").read_text(encoding="utf-8"))["charges"]


def test_tsv_days_with_user_ids_out_of_core_and_a_bad_id_refused_in_one_line(
    user_days, criteo_days, tmp_path, capsys):
  beam = out_of_core.beam_args(None, None, IN_PROCESS)
  with out_of_core.workspace(None) as base:  # row level: the column is read, then dropped
    data = out_of_core.prepare(user_days, base, 1, beam)
    assert data.train_rows == len(load_data(user_days).train["label"])
    assert sum(len(labels) for _, labels in data.eval_dataset(256).as_numpy_iterator()) == len(
        load_data(user_days).eval["label"])
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in ("day_0", "day_1"):
    lines = open(os.path.join(user_days, name), encoding="utf-8").read().splitlines()
    if name == "day_0":
      lines[2] = lines[2].rsplit("\t", 1)[0] + "\tabc"
    (bad / name).write_text("\n".join(lines[:200]) + "\n", encoding="utf-8")

  def refusal(argv):  # the error's one line, after the preprocessing job's progress lines
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]

  err = refusal(_argv(str(bad), tmp_path / "run", *USER_LEVEL))
  assert f"{bad}/day_0:3: field user_id: not a non-negative integer" in err and "41st" in err
  plain = criteo_days(600, 2)
  err = refusal(_argv(plain, tmp_path / "plain", *USER_LEVEL))
  assert f"{plain}/day_0:1: field user_id: missing" in err
  assert not any(os.path.exists(tmp_path / run / "ledger.json") for run in ("run", "plain"))
