"""The streaming Criteo job: TestStream with day-by-day watermarks and a late record (a dead
letter); files that arrive in a watched directory while it runs (the unbounded pipeline, and the
default per-period mode with late, changed, malformed and half-written files); running counts equal
the batch job's counts; ids never move once assigned; outputs read back and train a model."""
import gzip
import json
import os
import pickle
import shutil
import threading
import time

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_stream
from apache_beam.transforms import window

from dprec.data import criteo_tfrecord
from dprec.data.criteo import count_categories
from dprec.data.criteo import read_criteo_tsv
from dprec.data.synthetic import generate_criteo
from pipelines import beam_io
from pipelines import criteo
from pipelines import criteo_shards
from pipelines import criteo_stream


def _block(path, day, first_line, lines):
  return beam_io.LineBlock(path, day, first_line, ("\n".join(lines) + "\n").encode())


def _late_letters(out):
  """The dead letters of periods that closed too late, in path and line order (only written
  files: a `.tmp-` temporary of an atomic write may be renamed while the job runs)."""
  letters = []
  for name in sorted(os.listdir(os.path.join(out, "dead_letters"))):
    if not name.endswith(".jsonl"):
      continue
    with open(os.path.join(out, "dead_letters", name)) as stream:
      letters += [json.loads(line) for line in stream]
  return sorted(letters, key=lambda letter: (letter["path"], letter["line"]))


def _vocab_map(vocab, feature):
  return dict(zip(vocab.ids[feature].tolist(), vocab.counts[feature].tolist()))


def test_test_stream_periods_running_counts_stable_ids_and_late_record(tmp_path, criteo_line,
                                                                      in_process):
  x, y, z, late = "0000000a", "000000bb", "00000ccc", "0000dddd"
  days = {
      0: [criteo_line(1, {0: 1}, {"C1": x, "C2": y}), criteo_line(0, {}, {"C1": x}),
          criteo_line(0, {}, {"C1": z}), "not a criteo line"],
      1: [criteo_line(1, {}, {"C1": z, "C2": y}), criteo_line(0, {}, {"C1": y})],
      2: [criteo_line(0, {}, {"C1": y}), criteo_line(1, {}, {"C1": x})],
  }
  inputs = tmp_path / "in"
  inputs.mkdir()
  for day, lines in days.items():
    (inputs / f"day_{day}").write_text("\n".join(lines) + "\n")
  stamp = criteo_stream.day_timestamp
  late_line = criteo_line(1, {}, {"C1": late})
  stream = (test_stream.TestStream()
            .advance_watermark_to(stamp(0))
            .add_elements([window.TimestampedValue(
                _block(str(inputs / "day_0"), 0, 1, days[0][:2]), stamp(0) + 10)])
            .add_elements([window.TimestampedValue(
                _block(str(inputs / "day_0"), 0, 3, days[0][2:]), stamp(0) + 20)])
            .advance_watermark_to(stamp(1))
            .add_elements([window.TimestampedValue(
                _block(str(inputs / "day_1"), 1, 1, days[1]), stamp(1) + 5)])
            .advance_watermark_to(stamp(2))
            # Day 0 is closed: this record is late and must not reach any period.
            .add_elements([window.TimestampedValue(
                _block("late_day_0", 0, 1, [late_line]), stamp(0) + 30)])
            .add_elements([window.TimestampedValue(
                _block(str(inputs / "day_2"), 2, 1, days[2]), stamp(2) + 5)])
            .advance_watermark_to_infinity())
  out = str(tmp_path / "stream")
  job = criteo_stream.StreamJob(str(inputs), out, min_count=2)
  options = PipelineOptions(["--runner=DirectRunner", "--streaming"])
  with beam.Pipeline(options=options) as pipeline:
    _ = pipeline | stream | criteo_stream.StreamingCriteo(job)

  manifest = criteo_tfrecord.load_manifest(out)
  assert [e["day"] for e in manifest["days"]] == [0, 1, 2]
  assert [e["rows"] for e in manifest["days"]] == [3, 2, 2]
  assert [e["dead_letters"] for e in manifest["days"]] == [1, 0, 0]
  with open(os.path.join(out, "day_0", "dead_letters.jsonl")) as stream_file:
    assert json.loads(stream_file.readline())["line"] == 4
  snapshots = [criteo_tfrecord.load_vocabulary(out, day) for day in (0, 1, 2)]
  # min count 2 on running sums: x enters on day 0 (2), z on day 1 (1 + 1), y on day 2 (1 + 1).
  assert [snap.ids[0].tolist() for snap in snapshots] == [
      [int(x, 16)], [int(x, 16), int(z, 16)], [int(x, 16), int(z, 16), int(y, 16)]]
  assert snapshots[1].ids[1].tolist() == [int(y, 16)]  # C2: y seen on days 0 and 1.
  for earlier, later in zip(snapshots, snapshots[1:]):  # Ids never move once assigned.
    for feature in range(26):
      assert later.ids[feature][:len(earlier.ids[feature])].tolist() == \
          earlier.ids[feature].tolist()
  assert int(late, 16) not in snapshots[-1].ids[0] and "late" not in json.dumps(manifest)
  # The late record is not lost: a dead letter saying why.
  [late_letter] = _late_letters(out)
  assert (late_letter["path"], late_letter["line"]) == ("late_day_0", 1)
  assert late_letter["reason"].startswith("late: late_day_0 arrived after period day_")
  stats = beam_io.read_json(os.path.join(out, "stats.json"))
  assert (stats["rows_in"], stats["rows_out"], stats["dead_letters"]) == (9, 7, 2)
  assert stats["bad_rows_by_reason"]["late"] == 1

  # Running counts equal the batch job's counts over the same (on-time) days.
  batch_out = str(tmp_path / "batch")
  criteo.run(criteo.CriteoJob(inputs=(str(inputs),), output=batch_out, max_bad_fraction=0.5),
             in_process)
  batch = criteo_tfrecord.load_vocabulary(batch_out)
  for feature in range(26):
    batch_counts = _vocab_map(batch, feature)
    assert {k: v for k, v in batch_counts.items() if v >= 2} == _vocab_map(snapshots[-1], feature)
  # Each period is transformed with its own snapshot: day 1's z is index 2, y is OOV (0).
  day1 = next(iter(criteo_tfrecord.criteo_tfrecord_dataset(out, days=[1], batch_size=10)))
  assert day1["cat_features"].numpy()[:, 0].tolist() == [2, 0]


def test_a_state_that_names_the_statistics_where_they_were_defined_before_still_loads():
  """A running state (`stream_state.pkl`) written before the statistics moved to
  `pipelines.criteo_shards` names them `pipelines.criteo.ShardStats`: a rerun on the same output
  still reads it."""
  old = b"\x80\x02cpipelines.criteo\nShardStats\n)\x81."  # ShardStats.__new__, by its old name
  assert isinstance(pickle.loads(old), criteo_shards.ShardStats)


def test_two_day_periods(tmp_path, criteo_line):
  stamp = criteo_stream.day_timestamp
  stream = test_stream.TestStream().advance_watermark_to(stamp(0))
  for day in range(3):
    line = criteo_line(day % 2, {}, {"C1": f"{day + 1:08x}"})
    stream = stream.add_elements([window.TimestampedValue(
        _block(f"day_{day}", day, 1, [line, line]), stamp(day) + 1)]).advance_watermark_to(
            stamp(day + 1))
  out = str(tmp_path / "stream")
  job = criteo_stream.StreamJob(str(tmp_path), out, period_days=2)
  with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner", "--streaming"])) as p:
    _ = p | stream.advance_watermark_to_infinity() | criteo_stream.StreamingCriteo(job)
  manifest = criteo_tfrecord.load_manifest(out)
  assert [(e["day"], e["days"], e["rows"]) for e in manifest["days"]] == [
      (0, [0, 1], 4), (2, [2, 3], 2)]
  assert criteo_tfrecord.load_vocabulary(out, 0).ids[0].tolist() == [1, 2]
  assert criteo_tfrecord.load_vocabulary(out, 2).ids[0].tolist() == [1, 2, 3]


def test_unbounded_pipeline_on_files_arriving_in_a_watched_directory(tmp_path, in_process,
                                                                     train_tiny_model):
  """The one-pipeline form for streaming runners (Beam's Watch), here on the in-process runner,
  which writes the periods when the watch stops."""
  source = tmp_path / "generated"
  generate_criteo(str(source), rows=900, days=3, seed=3, vocab="scaled:0.02", progress=False)
  watched = tmp_path / "watched"
  watched.mkdir()
  arrived = []

  def deliver():  # Each day appears atomically (copy to a temporary name, then rename).
    for day in range(3):
      time.sleep(1.0)
      shutil.copy(source / f"day_{day}", watched / f"day_{day}.tmp")
      os.rename(watched / f"day_{day}.tmp", watched / f"day_{day}")
      arrived.append(time.monotonic())

  feeder = threading.Thread(target=deliver)
  start = time.monotonic()
  feeder.start()
  out = str(tmp_path / "out")
  job = criteo_stream.StreamJob(str(watched), out, poll_seconds=0.1, idle_timeout=3.0,
                                settle_seconds=0.2)
  counters = criteo_stream.run_unbounded(job, in_process)
  feeder.join()
  assert len(arrived) == 3 and arrived[0] - start > 0.9  # The job was running before day 0.
  summary = beam_io.read_json(os.path.join(out, "stats.json"))
  assert summary["rows_out"] == summary["rows_in"] == 900 and summary["periods"] == 3
  assert counters == {"rows_in": 900, "rows_out": 900}

  final = criteo_tfrecord.load_vocabulary(out)
  expected = count_categories(read_criteo_tsv([str(source / f"day_{d}") for d in range(3)]))
  for feature, (ids, counts) in enumerate(expected):
    assert _vocab_map(final, feature) == dict(zip(ids.tolist(), counts.tolist()))
  manifest = criteo_tfrecord.load_manifest(out)
  sizes = [criteo_tfrecord.vocab_sizes({"vocab_sizes": e["vocab_sizes"]})
           for e in manifest["days"]]
  assert np.all(np.diff(sizes, axis=0) >= 0)  # Vocabularies only grow.
  dataset = criteo_tfrecord.criteo_tfrecord_dataset(out, batch_size=64)
  losses = train_tiny_model(dataset, criteo_tfrecord.vocab_sizes(manifest))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def _deliver(directory, day, lines, name=None, settled=True):
  """Writes a day file under a temporary name and renames it into place; `settled` backdates it
  past any --settle-seconds (these tests wait for conditions, not for the clock)."""
  final = directory / (name or f"day_{day}")
  temporary = directory / f"{final.name}.tmp"
  temporary.write_text("".join(line + "\n" for line in lines))
  os.rename(temporary, final)
  if settled:
    _backdate(final)
  return final


def _backdate(path, seconds=600):
  past = time.time() - seconds
  os.utime(path, (past, past))


def _wait_for(condition, what, job_thread, timeout=60):
  deadline = time.monotonic() + timeout
  while not condition():
    assert job_thread.is_alive(), f"the streaming job ended before {what}"
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def test_default_mode_late_changed_malformed_and_half_written_files(tmp_path, criteo_line,
                                                                   in_process):
  """The default (per-period) mode while watching: a late day and a file changed after it was
  read become dead letters with their reason, so do a malformed line and the unreadable rest of a
  truncated gzip file, and a file written in place is taken only once it has settled (here:
  never before its writer finished)."""
  def rows(first, count):
    return [criteo_line(i % 2, {0: i}, {"C1": f"{i:08x}"}) for i in range(first, first + count)]

  watched, out = tmp_path / "watched", str(tmp_path / "out")
  watched.mkdir()
  job = criteo_stream.StreamJob(str(watched), out, poll_seconds=0.05, settle_seconds=30,
                                stop_after_day=4, idle_timeout=60)
  result = {}
  job_thread = threading.Thread(target=lambda: result.update(criteo_stream.run(job, in_process)))
  job_thread.start()

  def written():
    path = os.path.join(out, "manifest.json")
    return [e["day"] for e in criteo_tfrecord.load_manifest(out)["days"]] if os.path.exists(
        path) else []

  def letters_with(prefix):
    if not os.path.isdir(os.path.join(out, "dead_letters")):
      return []
    return [l for l in _late_letters(out) if l["reason"].startswith(prefix)]

  try:
    _deliver(watched, 0, rows(100, 3))
    _deliver(watched, 2, rows(200, 2) + ["2\tnot a criteo line"])  # closes period 0 (and 1)
    _wait_for(lambda: written() == [0], "period 0", job_thread)
    with open(watched / "day_0", "a") as stream:  # changed after it was read
      stream.write(rows(103, 1)[0] + "\n")
    _backdate(watched / "day_0")
    _wait_for(lambda: letters_with("changed"), "the changed day_0", job_thread)
    _deliver(watched, 3, rows(300, 2))  # closes period 2
    broken = gzip.compress("".join(line + "\n" for line in rows(310, 200)).encode())
    cut = watched / "day_3.gz.tmp"
    cut.write_bytes(broken[:len(broken) // 2])  # a malformed (truncated) file of day 3
    os.rename(cut, watched / "day_3.gz")
    _backdate(watched / "day_3.gz")
    _wait_for(lambda: written() == [0, 2], "period 2", job_thread)
    _deliver(watched, 1, rows(150, 2))  # late: period 2 is written
    _wait_for(lambda: letters_with("late"), "the late day_1", job_thread)
    half = watched / "day_4"
    half.write_text("\n".join(rows(400, 2)) + "\n" + rows(402, 1)[0][:9])  # in place, cut
    time.sleep(0.5)  # ten polls: the unsettled file is not taken, so day 3 stays open
    assert written() == [0, 2] and job_thread.is_alive()
    with open(half, "a") as stream:
      stream.write(rows(402, 1)[0][9:] + "\n")
    _backdate(half)
  finally:
    job_thread.join(timeout=120)
  assert not job_thread.is_alive()

  manifest = criteo_tfrecord.load_manifest(out)
  assert [(e["day"], e["dead_letters"]) for e in manifest["days"]] == [(0, 0), (2, 1), (3, 1),
                                                                      (4, 0)]
  assert [e["rows"] for e in manifest["days"] if e["day"] != 3] == [3, 2, 3]  # day 4 whole
  with open(os.path.join(out, "day_2", "dead_letters.jsonl")) as stream:
    [malformed] = [json.loads(line) for line in stream]
  assert (malformed["path"], malformed["line"]) == (str(watched / "day_2"), 3)
  assert malformed["raw"] == "2\tnot a criteo line" and malformed["reason"]
  with open(os.path.join(out, "day_3", "dead_letters.jsonl")) as stream:
    [truncated] = [json.loads(line) for line in stream]
  day3_rows = manifest["days"][2]["rows"]
  assert 2 < day3_rows < 2 + 200 and truncated["line"] == day3_rows - 2 + 1
  assert truncated["path"] == str(watched / "day_3.gz") and truncated["reason"].startswith("gzip")
  changed, late = letters_with("changed"), letters_with("late")
  assert [(l["path"], l["line"]) for l in changed] == [(str(watched / "day_0"), n)
                                                       for n in range(1, 5)]
  assert "day_0 changed after it was read into period day_0" in changed[0]["reason"]
  assert [(l["path"], l["line"]) for l in late] == [(str(watched / "day_1"), 1),
                                                    (str(watched / "day_1"), 2)]
  assert "day_1 arrived after period day_2 was written" in late[0]["reason"]
  assert result["rows_in"] == 3 + 3 + 4 + day3_rows + 1 + 2 + 3
  assert result["rows_in"] == result["rows_out"] + result["dead_letters"]
  assert result["bad_rows_by_reason"]["late"] == 2 and result["bad_rows_by_reason"]["changed"] == 4
  final = criteo_tfrecord.load_vocabulary(out)
  assert 150 not in final.ids[0] and 103 not in final.ids[0]  # no late or changed row counted
  assert result["beam_counters"]["rows_in"] == result["rows_in"]

  # A rerun on the same output takes no file twice and stops at once (day 4 is there).
  again = criteo_stream.run(job, in_process)
  assert again["rows_in"] == result["rows_in"] and again["beam_counters"] == {}


def test_a_cut_last_line_and_a_file_that_changes_while_it_is_read_are_dead_letters(
    tmp_path, criteo_line):
  path = tmp_path / "day_5"
  whole = criteo_line(1, {0: 7}, {"C1": "0000abcd"})
  path.write_text(criteo_line(1) + "\n" + criteo_line(0) + "\n" + whole[:-6])  # still written
  [listed] = criteo_stream.FileSystems.match([str(path)])[0].metadata_list
  items = [value.value for value in criteo_stream.read_day_file(listed)]
  assert [type(item).__name__ for item in items] == ["LineBlock", "DeadLetter"]
  assert items[0].data.count(b"\n") == 2 and items[0].data.endswith(b"\n")
  assert (items[1].line, items[1].raw) == (3, whole[:-6]) and items[1].reason.startswith("cut:")
  with open(path, "a") as stream:  # the writer goes on after the listing
    stream.write(whole[-6:] + "\n")
  stamped = list(criteo_stream.read_day_file(listed))
  items = [value.value for value in stamped]
  assert [type(item).__name__ for item in items] == ["LineBlock", "DeadLetter", "DeadLetter"]
  assert items[2].line == 4 and items[2].reason.startswith("changed: the file changed while it")
  assert all(value.timestamp == criteo_stream.day_timestamp(5) for value in stamped)
