"""Golden tests of the Criteo batch job on hand-written lines (vocabulary, indices, log transform,
OOV, dead letters and their reasons, rows in = rows out + dead letters) and its outputs' reader."""
import dataclasses
import gzip
import json
import math
import os

import numpy as np
import pytest

from dprec.data import criteo_tfrecord
from dprec.data import identity
from dprec.data.criteo import CATEGORICAL_FEATURES
from dprec.errors import DprecError
from pipelines import beam_io
from pipelines import criteo
from pipelines import criteo_vocabulary

A, B, C, D, E = "0000000a", "000000bb", "00000ccc", "0000dddd", "000eeeee"


def _golden_inputs(tmp_path, criteo_line):
  """day_0 (plain, 5 good + 5 bad lines) and day_1.gz (2 good lines, then a corrupt member)."""
  good0 = [
      criteo_line(1, {0: 3, 1: 0}, {"C1": A, "C2": B}),
      criteo_line(0, {0: -5, 1: 10, 12: 7}, {"C1": A, "C2": C}),
      criteo_line(1, {1: 2}, {"C1": D, "C2": B, "C26": E}),
      criteo_line(0, {}, {"C1": A}),
      criteo_line(0, {0: 1000000}, {"C2": "000000BB"}),  # Upper-case hex is the same id.
  ]
  bad0 = [
      criteo_line(1, {}, {"C1": A}) + "\tdeadbeef",  # 41 fields
      criteo_line(1, {}, {"C3": "0000zzzz"}),  # non-hex id
      criteo_line(1, {1: "abc"}),  # non-integer
      criteo_line(2, {}),  # label not 0/1
      "",  # empty line
  ]
  day0 = [good0[0], bad0[0], good0[1], bad0[1], good0[2], bad0[2], bad0[3], good0[3], bad0[4],
          good0[4]]
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "day_0").write_text("\n".join(day0) + "\n")
  good1 = [criteo_line(1, {2: 1}, {"C1": E, "C2": B}), criteo_line(0, {}, {"C1": A})]
  payload = gzip.compress(("\n".join(good1) + "\n").encode())
  # A second gzip member that is cut short: the reader keeps what it could decode.
  broken = gzip.compress(("\n".join([criteo_line(0, {}, {"C1": A})] * 2000) + "\n").encode())
  (tmp_path / "in" / "day_1.gz").write_bytes(payload + broken[:len(broken) // 3])


def test_golden_batch_job_on_two_worker_processes(tmp_path, criteo_line, train_tiny_model):
  _golden_inputs(tmp_path, criteo_line)
  out = str(tmp_path / "out")
  job = criteo.CriteoJob(inputs=(str(tmp_path / "in"),), output=out,
                         vocab=criteo_vocabulary.VocabConfig(min_count=2), max_bad_fraction=1.0,
                         split_bytes=300)
  summary = criteo.run(job, ["--direct_num_workers=2", "--direct_running_mode=multi_processing"])

  # Dead letters: file, line number, reason, raw line; counted by kind.
  letters = []
  for name in os.listdir(os.path.join(out, "dead_letters")):
    with open(os.path.join(out, "dead_letters", name)) as stream:
      letters += [json.loads(line) for line in stream]
  found = sorted((os.path.basename(l["path"]), l["line"], beam_io.reason_kind(l["reason"]))
                 for l in letters)
  gz_letter = [l for l in letters if l["path"].endswith("day_1.gz")]
  assert len(gz_letter) == 1 and "bad gzip member" in gz_letter[0]["reason"]
  gz_line = gz_letter[0]["line"]
  assert gz_line > 2  # The first member's lines and part of the second's were kept.
  assert found == sorted([("day_0", 2, "line"), ("day_0", 4, "C3"), ("day_0", 6, "I2"),
                          ("day_0", 7, "label"), ("day_0", 9, "line"),
                          ("day_1.gz", gz_line, "gzip")])
  assert [l["raw"] for l in letters if l["line"] == 2 and l["path"].endswith("day_0")] == [
      criteo_line(1, {}, {"C1": A}) + "\tdeadbeef"]
  rows_in_gz = gz_line  # Lines 1..gz_line-1 parsed, plus the dead letter at gz_line.
  assert summary["rows_in"] == 10 + rows_in_gz
  assert summary["rows_in"] == summary["rows_out"] + summary["dead_letters"]
  assert summary["dead_letters"] == 6
  assert summary["bad_rows_by_reason"] == {"line": 2, "C3": 1, "I2": 1, "label": 1, "gzip": 1}
  # Beam metrics counted the same rows across the two worker processes.
  assert summary["beam_counters"] == {
      "rows_in": summary["rows_in"], "rows_out": summary["rows_out"],
      **{f"dead_letters.{k}": v for k, v in summary["bad_rows_by_reason"].items()}}

  # Vocabulary at min count 2 (counts over all good rows, including the second gzip member's A's).
  extra_a = rows_in_gz - 1 - 2
  manifest = criteo_tfrecord.load_manifest(out)
  vocab = criteo_tfrecord.load_vocabulary(out)
  assert [int(i) for i in vocab.ids[0]] == [int(A, 16)]  # C1: A (3 + 1 + extra); D, E once.
  assert [int(c) for c in vocab.counts[0]] == [4 + extra_a]
  assert [int(i) for i in vocab.ids[1]] == [int(B, 16)]  # C2: B x4; C once.
  assert all(len(ids) == 0 for ids in vocab.ids[2:])  # C26's E appears once.
  assert manifest["vocab_sizes"] == summary["vocab_sizes"] == dict(
      zip(CATEGORICAL_FEATURES, [2, 2] + [1] * 24))
  assert [d["day"] for d in manifest["days"]] == [0, 1]
  assert sum(d["rows"] for d in manifest["days"]) == summary["rows_out"]
  assert len(manifest["days"][0]["files"]) > 1  # Several splits → several shards.
  assert manifest["dataset_id"] == summary["dataset_id"] and len(summary["dataset_id"]) == 32
  assert not manifest["vocab_privacy"]["dp"]  # min count over exact counts: says it is not DP
  # C1 is missing on one good row; D and E are OOV, every other C1 is A.
  assert summary["coverage"]["C1"] == pytest.approx((summary["rows_out"] - 3) /
                                                    (summary["rows_out"] - 1))

  # The TFRecords hold the transform of every good row, in file order within each shard.
  rows = {}
  for batch in criteo_tfrecord.criteo_tfrecord_dataset(out, days=[0], batch_size=64):
    for label, ints, cats in zip(batch["label"].numpy(), batch["int_features"].numpy(),
                                 batch["cat_features"].numpy()):
      rows[tuple(cats[:2]) + tuple(round(float(v), 4) for v in ints[:2])] = (label, ints, cats)
  assert len(rows) == 5
  label, ints, cats = rows[(1, 1, round(math.log(4), 4), 0.0)]  # Line 1: A, B, I1 = 3, I2 = 0.
  assert label == 1 and ints[1] == 0 and list(cats[2:]) == [0] * 24
  label, ints, cats = rows[(1, 0, 0.0, round(math.log(11), 4))]  # Line 3: A, C (OOV); I1 = -5.
  assert label == 0 and ints[1] == pytest.approx(math.log(11)) and ints[12] == pytest.approx(
      math.log(8))
  label, ints, cats = rows[(0, 1, 0.0, round(math.log(3), 4))]  # Line 5: D (OOV), B, I2 = 2.
  assert ints[1] == pytest.approx(math.log(3)) and cats[25] == 0
  assert (0, 1, round(math.log(1000001), 4), 0.0) in rows  # Upper-case BB is B.
  assert (1, 0, 0.0, 0.0) in rows  # Line 8: A only, all integers missing.
  day1 = next(iter(criteo_tfrecord.criteo_tfrecord_dataset(out, days=[1], batch_size=10000)))
  assert len(day1["label"]) == rows_in_gz - 1

  # A model trains on what the reader yields.
  dataset = criteo_tfrecord.criteo_tfrecord_dataset(out, batch_size=8)
  losses = train_tiny_model(dataset, criteo_tfrecord.vocab_sizes(manifest))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_too_many_bad_rows_fail_without_manifest(tmp_path, criteo_line, in_process):
  (tmp_path / "day_0").write_text("\n".join([criteo_line(0, {}, {"C1": A})] * 3 + ["oops"]))
  job = criteo.CriteoJob(inputs=(str(tmp_path / "day_0"),), output=str(tmp_path / "out"),
                         max_bad_fraction=0.2)
  with pytest.raises(DprecError, match=r"1 of 4 rows are malformed \(25.00% > "):
    criteo.run(job, in_process)
  assert not os.path.exists(tmp_path / "out" / "manifest.json")
  with open(tmp_path / "out" / "stats.json") as stream:
    assert json.load(stream)["dead_letters"] == 1
  tolerant = criteo.CriteoJob(job.inputs, job.output, max_bad_fraction=0.25, overwrite=True)
  assert criteo.run(tolerant, in_process)["rows_out"] == 3
  assert os.path.exists(tmp_path / "out" / "manifest.json")


def test_lines_with_stripped_trailing_tabs_are_padded_only_when_asked(tmp_path, criteo_line,
                                                                      in_process):
  """Copies with trailing empty fields stripped: malformed by default; with `pad_short_lines`
  (`--pad-short-lines`) read as missing values and counted in stats.json (`padded_rows`), a
  data set of its own (other rows)."""
  lines = [criteo_line(1, {}, {"C1": A}), criteo_line(0, {}, {"C1": A}).rstrip("\t"),
           criteo_line(0, {0: 3}, {"C1": A, "C26": A})]
  assert lines[1].count("\t") == 14  # label, 13 integer fields, C1: the tail is gone
  (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
  job = criteo.CriteoJob(inputs=(str(tmp_path / "day_0"),), output=str(tmp_path / "out"))
  with pytest.raises(DprecError, match="1 of 3 rows are malformed"):
    criteo.run(job, in_process)
  padded = dataclasses.replace(job, output=str(tmp_path / "padded"), pad_short_lines=True)
  summary = criteo.run(padded, in_process)
  assert (summary["rows_out"], summary["padded_rows"], summary["dead_letters"]) == (3, 1, 0)
  assert summary["dataset_id"] != criteo.input_dataset_id(job, job.inputs)


def test_an_interrupted_copy_is_a_dead_letter_not_a_padded_row(tmp_path, criteo_line,
                                                               in_process):
  """A day file that ends inside a line at a tab (a copy cut short): the line is a `cut` dead
  letter naming file and line, even with padding on, and fails the job at the default 1%."""
  lines = [criteo_line(1, {0: i}, {"C1": A, "C26": B}) for i in range(50)]
  cut = "\t".join(lines[-1].split("\t")[:21]) + "\t"  # 22 fields, no newline
  (tmp_path / "day_0").write_text("\n".join(lines[:-1] + [cut]))
  job = criteo.CriteoJob(inputs=(str(tmp_path / "day_0"),), output=str(tmp_path / "out"),
                         pad_short_lines=True)
  with pytest.raises(DprecError, match="1 of 50 rows are malformed"):
    criteo.run(job, in_process)
  with open(tmp_path / "out" / "dead_letters" / "part-00000.jsonl") as stream:
    letter = json.loads(stream.read())
  assert (letter["line"], letter["reason"].split(":")[0]) == (50, "cut")
  assert "22 of 40 fields, no newline" in letter["reason"]
  with open(tmp_path / "out" / "stats.json") as stream:
    stats = json.load(stream)
  assert stats["padded_rows"] == 0 and stats["bad_rows_by_reason"] == {"cut": 1}


def test_the_same_input_is_the_same_data_set_and_an_output_is_not_overwritten(
    tmp_path, criteo_line, in_process):
  """dataset_id is the input's fingerprint: the same files preprocessed again (or read as TSV
  days by training) are the same data set; an output directory holding files is refused in one
  line unless `overwrite`."""
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "day_0").write_text(criteo_line(1, {}, {"C1": A}) + "\n")
  (tmp_path / "in" / "day_1").write_text(criteo_line(0, {}, {"C1": B}) + "\n")
  job = criteo.CriteoJob(inputs=(str(tmp_path / "in"),), output=str(tmp_path / "p1"))
  first = criteo.run(job, in_process)["dataset_id"]
  with pytest.raises(DprecError, match=r"p1: already holds data set \w+… of this same input; "
                                       r"pass --overwrite to replace it, or another --output$"):
    criteo.run(job, in_process)
  assert criteo.run(dataclasses.replace(job, overwrite=True), in_process)["dataset_id"] == first
  again = criteo.run(dataclasses.replace(job, output=str(tmp_path / "p2")), in_process)
  assert again["dataset_id"] == first == identity.dataset_identity(str(tmp_path / "in"))["id"]
  (tmp_path / "in" / "day_1").write_text(criteo_line(1, {}, {"C1": B}) + "\n")  # other rows
  other = dataclasses.replace(job, overwrite=True)
  assert criteo.run(other, in_process)["dataset_id"] != first


def test_top_k_keeps_the_most_frequent_buckets(tmp_path, criteo_line, in_process):
  ids = [f"{i:08x}" for i in range(1, 6)]
  lines = [criteo_line(0, {}, {"C1": ids[i], "C2": ids[0]}) for i in range(5) for _ in range(i + 1)]
  (tmp_path / "day_0").write_text("\n".join(lines))
  job = criteo.CriteoJob(inputs=(str(tmp_path / "day_0"),), output=str(tmp_path / "out"),
                         vocab=criteo_vocabulary.VocabConfig(mode="top_k", top_k=2))
  summary = criteo.run(job, in_process)
  vocab = criteo_tfrecord.load_vocabulary(str(tmp_path / "out"))
  assert [int(i) for i in vocab.ids[0]] == [5, 4] and [int(c) for c in vocab.counts[0]] == [5, 4]
  assert summary["vocab_sizes"]["C1"] == 3 and summary["vocab_sizes"]["C2"] == 2
  assert summary["coverage"]["C1"] == pytest.approx(9 / 15)


def test_bad_options_are_clear_errors():
  with pytest.raises(DprecError, match="needs --top-k"):
    criteo_vocabulary.VocabConfig(mode="top_k")
  with pytest.raises(DprecError, match="positive --top-k-epsilon"):
    criteo_vocabulary.VocabConfig(mode="dp_top_k", top_k=3)
  with pytest.raises(DprecError, match="26 comma-separated"):
    criteo_vocabulary.parse_top_k("1,x")
  assert criteo_vocabulary.parse_top_k("table3")[2] == 82741
  assert criteo_vocabulary.parse_top_k("7") == 7


def test_the_user_column_is_kept_and_a_bad_id_is_a_dead_letter(tmp_path, criteo_line,
                                                               in_process):
  """`--user-column`: each row's 41st field is written as `user_id` (the manifest says so, the
  reader returns it); a line whose id is missing or not an integer is a dead letter naming its
  file, line and the field `user_id`, as other bad fields are; the data set is the rows'."""
  ids = [7, 0, 123456789012, 7]
  lines = [criteo_line(i % 2, {0: i}, {"C1": A}) + f"\t{user}" for i, user in enumerate(ids)]
  lines[2:2] = [criteo_line(0, {}, {"C1": A}) + "\tbob", criteo_line(0, {}, {"C1": A}) + "\t",
                criteo_line(0, {}, {"C1": A}) + "\t-3", criteo_line(0, {}, {"C1": A})]
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "day_0").write_text("\n".join(lines) + "\n")
  job = criteo.CriteoJob(inputs=(str(tmp_path / "in"),), output=str(tmp_path / "out"),
                         max_bad_fraction=1.0, user_column=True)
  summary = criteo.run(job, in_process)
  assert (summary["rows_out"], summary["dead_letters"]) == (4, 4)
  with open(tmp_path / "out" / "dead_letters" / "part-00000.jsonl") as stream:
    letters = [json.loads(line) for line in stream]
  assert [(os.path.basename(l["path"]), l["line"], beam_io.reason_kind(l["reason"]))
          for l in letters] == [("day_0", 3, "user_id"), ("day_0", 4, "user_id"),
                                ("day_0", 5, "user_id"), ("day_0", 6, "line")]
  assert "'bob'" in letters[0]["reason"]
  assert criteo_tfrecord.load_manifest(str(tmp_path / "out"))[
      criteo_tfrecord.USER_COLUMN_KEY] is True
  rows = next(iter(criteo_tfrecord.criteo_tfrecord_dataset(str(tmp_path / "out"))))
  assert list(rows["user_id"].numpy()) == ids and list(rows["label"].numpy()) == [0, 1, 0, 1]
  assert summary["dataset_id"] == criteo.input_dataset_id(job, beam_io.match_inputs(job.inputs))
