"""Same bytes everywhere: the batch Criteo job (bad lines, DP top-k under an insecure seed) and the
sequences job write identical outputs on the embedded runner and on a 2-process Dask cluster, one
already running (`--dask_client_address`) or one the command starts (`--dask-workers 2`)."""
import gzip
import json
import os

import pytest

from dprec import cli
from dprec.data import synthetic
from dprec.errors import DprecError
from pipelines import beam_io
from pipelines import criteo
from pipelines import criteo_shards
from pipelines import criteo_stream
from pipelines import criteo_vocabulary

# pip install -e .[test] installs apache-beam[dask]
distributed = pytest.importorskip("distributed")

DASK = ["--runner", "DaskRunner"]


@pytest.fixture(scope="module")
def dask_address():
  """A local cluster of 2 single-threaded worker processes, as a user would start one."""
  with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                dashboard_address=":0") as cluster:
    yield cluster.scheduler_address


def _criteo_inputs(directory, criteo_line):
  """2,000 synthetic rows in day_0 and day_1, malformed lines among them, and a day_2.gz."""
  synthetic.generate_criteo(str(directory), 2000, days=2, seed=3, progress=False)
  day0 = (directory / "day_0").read_text().splitlines()
  bad = [criteo_line(1, {}, {"C3": "0000zzzz"}), criteo_line(2), criteo_line(1, {1: "x"}), ""]
  for offset, line in enumerate(bad):
    day0.insert(150 + 211 * offset, line)
  (directory / "day_0").write_text("\n".join(day0) + "\n")
  (directory / "day_2.gz").write_bytes(gzip.compress(
      ("\n".join([criteo_line(0, {0: 4}, {"C1": "0000000a"})] * 30) + "\nbad\n").encode()))


def _files(directory):
  return sorted(os.path.relpath(os.path.join(root, name), directory)
                for root, _, names in os.walk(directory) for name in names)


def _normalised_json(path, replacements):
  text = open(path, encoding="utf-8").read()
  for old, new in replacements.items():
    text = text.replace(old, new)
  return json.loads(text)


def assert_same_outputs(left, right, left_run, right_run):
  """Every file byte for byte, except the JSON files, which must be equal once each run's own
  output path, ledger path and dataset id (`*_run`: {text: placeholder}) are replaced."""
  assert _files(left) == _files(right)
  for name in _files(left):
    left_path, right_path = os.path.join(left, name), os.path.join(right, name)
    if name.endswith(".json"):
      assert _normalised_json(left_path, left_run) == _normalised_json(right_path, right_run), name
    else:
      with open(left_path, "rb") as a, open(right_path, "rb") as b:
        assert a.read() == b.read(), name


def test_criteo_batch_job_writes_the_same_bytes_on_dask(tmp_path, criteo_line, in_process,
                                                        dask_address):
  _criteo_inputs(tmp_path / "in", criteo_line)
  outputs, runs = {}, {}
  for runner, beam_args in (("embedded", in_process),
                            ("dask", DASK + ["--dask_client_address", dask_address])):
    out, ledger = str(tmp_path / runner), str(tmp_path / f"ledger_{runner}.json")
    job = criteo.CriteoJob(
        inputs=(str(tmp_path / "in"),), output=out, split_bytes=64 << 10, max_bad_fraction=0.1,
        vocab=criteo_vocabulary.VocabConfig(mode="dp_top_k", top_k=1, epsilon=2.0,
                                            insecure_noise_seed=7),
        ledger=ledger, epsilon_budget=10.0)
    outputs[runner] = criteo.run(job, beam_args)
    runs[runner] = {out: "OUT", ledger: "LEDGER", outputs[runner]["dataset_id"]: "ID"}
  embedded, dask = outputs["embedded"], outputs["dask"]
  assert embedded["dead_letters"] == 5 and embedded["rows_in"] == 2000 + 4 + 31
  assert len(os.listdir(tmp_path / "dask" / "day_0")) > 2  # several splits to spread
  assert len(os.listdir(tmp_path / "dask" / criteo_shards.DEAD_LETTERS)) >= 3  # one file a split
  # Counts come from the job's outputs; only the embedded runner also reports Beam metrics.
  assert "beam_counters" not in dask and embedded["beam_counters"]["rows_in"] == dask["rows_in"]
  assert_same_outputs(tmp_path / "embedded", tmp_path / "dask", runs["embedded"], runs["dask"])


def test_sequences_command_writes_the_same_bytes_on_a_dask_cluster_it_starts(
    tmp_path, capsys, in_process):
  lines = [f"{user} {(user * 7 + step * step) % 97 + 1}" for user in range(1, 401)
           for step in range(3 + user % 9)]
  lines[100:100] = ["not a pair of ids at all", "5"]
  (tmp_path / "actions.txt").write_text("\n".join(lines) + "\n")
  common = ["preprocess", "sequences", "--input", str(tmp_path / "actions.txt"), "--format",
            "sasrec", "--min-count", "2"]
  summaries = {}
  for runner, beam_args in (("embedded", in_process), ("dask", DASK + ["--dask-workers", "2"])):
    assert cli.main(common + ["--output", str(tmp_path / runner)] + beam_args) == 0
    summaries[runner] = json.loads(capsys.readouterr().out)
  assert summaries["dask"]["dead_letters"] == 2 and "beam_counters" not in summaries["dask"]
  runs = {runner: {str(tmp_path / runner): "OUT", json.load(open(
      tmp_path / runner / "manifest.json"))["dataset_id"]: "ID"} for runner in summaries}
  assert_same_outputs(tmp_path / "embedded", tmp_path / "dask", runs["embedded"], runs["dask"])


def test_runner_names_and_the_streaming_job_on_a_batch_only_runner(tmp_path):
  options = beam_io.pipeline_options(DASK)
  assert beam_io.runner_name(options) == "DaskRunner"
  assert options.get_all_options()["runner"] == beam_io.DASK_RUNNER
  assert options.get_all_options()["partition_size"] == 1  # one split per Dask partition
  assert options.get_all_options()["dask_workers"] == beam_io.EMBEDDED_WORKERS
  given = beam_io.pipeline_options(DASK + ["--dask_npartitions=4", "--dask-workers=3"])
  assert (given.get_all_options()["npartitions"], given.get_all_options()["partition_size"],
          given.get_all_options()["dask_workers"]) == (4, None, 3)
  (tmp_path / "in").mkdir()
  job = criteo_stream.StreamJob(input_dir=str(tmp_path / "in"), output=str(tmp_path / "out"),
                                idle_timeout=1)
  with pytest.raises(DprecError, match="bounded pipelines only.*DataflowRunner"):
    criteo_stream.run(job, DASK)
