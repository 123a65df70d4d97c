"""The streaming Criteo job: TestStream with day-by-day watermarks and a late record; files that
arrive in a watched directory while it runs; running counts equal the batch job's counts; ids
never move once assigned; outputs read back and train a model."""
import json
import os
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
from pipelines import criteo_stream


def _block(path, day, first_line, lines):
  return beam_io.LineBlock(path, day, first_line, ("\n".join(lines) + "\n").encode())


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


def test_files_arriving_in_a_watched_directory(tmp_path, in_process, train_tiny_model):
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
  job = criteo_stream.StreamJob(str(watched), out, poll_seconds=0.1, idle_timeout=3.0)
  summary = criteo_stream.run(job, in_process)
  feeder.join()
  assert len(arrived) == 3 and arrived[0] - start > 0.9  # The job was running before day 0.
  assert summary["rows_out"] == summary["rows_in"] == 900 and summary["periods"] == 3
  assert summary["beam_counters"] == {"rows_in": 900, "rows_out": 900}

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
