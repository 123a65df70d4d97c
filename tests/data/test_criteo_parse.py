"""Criteo TSV parsing: golden malformed lines (file, line, field), gzip, and agreement with a
plain per-line reference parser."""
import gzip
import os

import numpy as np
import pytest

from dprec.data import criteo
from dprec.data import criteo_parse
from dprec.errors import DprecError, InputError

INTS = ["1", "", "-3", "0", "12", "99999", "7", "", "4", "5", "6", "", "8"]
CATS = ["0a1b2c3d", "", "FFFFFFFF", "00000000"] + ["deadbeef"] * 22
GOOD = "\t".join(["1"] + INTS + CATS)


def _replace(field_index, value):
  fields = GOOD.split("\t")
  fields[field_index] = value
  return "\t".join(fields)


# (malformed line, field, reason); the line is line 3 of the file.
MALFORMED = [
    ("", "line", "empty line"),
    (GOOD + "\tdeadbeef", "line", "expected 40 tab-separated fields, found 41"),
    (_replace(0, "2"), "label", "must be 0 or 1, got '2'"),
    (_replace(0, ""), "label", "must be 0 or 1, got ''"),
    (_replace(5, "1.5"), "I5", "not an integer of at most 18 digits: '1.5'"),
    (_replace(13, "12a"), "I13", "not an integer of at most 18 digits: '12a'"),
    (_replace(14 + 6, "0a1b2c3g"), "C7", "not an 8-hex-digit id: '0a1b2c3g'"),
    (_replace(14 + 25, "abc"), "C26", "not an 8-hex-digit id: 'abc'"),
    (_replace(14, "0a1b2c3d0"), "C1", "not an 8-hex-digit id: '0a1b2c3d0'"),
]


# A short line is malformed by default, read as missing trailing values with pad_short_lines.
PADDED = [("1 2 3", "label", "must be 0 or 1, got '1 2 3'")]  # one field, then a bad label
SHORT = [
    (GOOD.rsplit("\t", 1)[0], "line", "expected 40 tab-separated fields, found 39"),
    ("1 2 3", "line", "expected 40 tab-separated fields, found 1"),
]


def _write(path, lines, compress=False):
  data = ("\n".join(lines) + "\n").encode()
  with (gzip.open if compress else open)(path, "wb") as out:
    out.write(data)
  return str(path)


CASES = ([(line, field, reason, True) for line, field, reason in MALFORMED + PADDED] +
         [(line, field, reason, False) for line, field, reason in MALFORMED + SHORT])


@pytest.mark.parametrize("line, field, reason, pad_short_lines", CASES)
def test_strict_mode_names_file_line_and_field(tmp_path, line, field, reason, pad_short_lines):
  path = _write(tmp_path / "day_0", [GOOD, GOOD, line, GOOD])
  with pytest.raises(InputError) as error:
    list(criteo.read_criteo_tsv(path, chunk_rows=2, pad_short_lines=pad_short_lines))
  assert (error.value.path, error.value.line, error.value.field, error.value.reason) == (
      path, 3, field, reason)


@pytest.mark.parametrize("line, field, reason, pad_short_lines", CASES)
def test_permissive_mode_skips_and_reports(tmp_path, line, field, reason, pad_short_lines):
  path = _write(tmp_path / "day_0", [GOOD, GOOD, line, GOOD])
  chunk = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(
      path, strict=False, pad_short_lines=pad_short_lines)))
  assert chunk.line_numbers.tolist() == [1, 2, 4]
  assert chunk.bad_rows == [criteo_parse.BadRow(path, 3, f"field {field}: {reason}", line)]


# Bytes that are not UTF-8 (a binary line), line 3 of the file: the field holding the first one.
BINARY = [
    (b"\x00\x01\xff\xfe garbage \x80" + GOOD.encode()[1:], "label",
     "byte 0xff at character 3 of the line"),
    (GOOD.encode().replace(b"\t-3\t", b"\t-\xff3\t"), "I3", "byte 0xff at character 7"),
    (GOOD.encode()[:-3] + b"\xc3", "C26", "byte 0xc3 at character"),
]


@pytest.mark.parametrize("line, field, reason", BINARY)
def test_a_binary_line_is_located_by_file_line_and_field(tmp_path, line, field, reason):
  path = tmp_path / "day_0"
  path.write_bytes(b"\n".join([GOOD.encode(), GOOD.encode(), line, GOOD.encode()]) + b"\n")
  with pytest.raises(InputError) as error:
    list(criteo.read_criteo_tsv(str(path), chunk_rows=8))
  assert (error.value.path, error.value.line, error.value.field) == (str(path), 3, field)
  assert error.value.reason.startswith("not UTF-8 text") and reason in error.value.reason
  chunk = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(str(path),
                                                                           strict=False)))
  assert chunk.line_numbers.tolist() == [1, 2, 4]
  assert [row.line_no for row in chunk.bad_rows] == [3]
  assert chunk.bad_rows[0].reason.startswith(f"field {field}:")


def test_lines_without_trailing_fields_read_as_missing_values_in_line_order(tmp_path):
  """Copies with stripped trailing tabs (`pad_short_lines`): fewer than 40 fields are missing
  trailing values (as pandas.read_csv with 40 names reads them), flagged `padded`; order and line
  numbers kept."""
  no_cats = "\t".join(["0"] + INTS)  # 14 fields: every categorical missing
  no_last = GOOD.rsplit("\t", 1)[0]  # 39 fields: C26 missing
  path = _write(tmp_path / "day_0", [GOOD, no_cats, GOOD, no_last, GOOD + "\tx", "1"])
  chunk = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(
      path, strict=False, pad_short_lines=True)))
  assert chunk.line_numbers.tolist() == [1, 2, 3, 4, 6]
  assert chunk.padded.tolist() == [False, True, False, True, True]
  assert chunk.label.tolist() == [1, 0, 1, 1, 1]
  assert (chunk.cat_values[1] == -1).all() and (chunk.cat_values[4] == -1).all()
  assert chunk.cat_values[3, -1] == -1
  np.testing.assert_array_equal(chunk.cat_values[3, :-1], chunk.cat_values[0, :-1])
  assert chunk.int_missing[4].all() and not chunk.int_missing[1].all()
  assert [row.line_no for row in chunk.bad_rows] == [5]  # 41 fields: still malformed
  strict = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(path, strict=False)))
  assert strict.line_numbers.tolist() == [1, 3] and not strict.padded.any()


@pytest.mark.parametrize("pad_short_lines", [False, True])
def test_a_file_cut_inside_its_last_line_is_never_padded(tmp_path, pad_short_lines):
  """An interrupted copy ends inside a line, at a tab: that line is malformed (`cut`), named by
  file, line and field count, even where short lines are padded; a complete last line without
  a newline is read."""
  path = tmp_path / "day_0"
  path.write_text("\n".join([GOOD, GOOD, "\t".join(GOOD.split("\t")[:20]) + "\t"]))  # cut
  with pytest.raises(InputError) as error:
    list(criteo.read_criteo_tsv(str(path), chunk_rows=2, pad_short_lines=pad_short_lines))
  assert (error.value.path, error.value.line, error.value.field) == (str(path), 3, "line")
  assert error.value.reason.startswith("cut: the file ends inside this line (21 of 40 fields")
  chunk = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(
      str(path), strict=False, pad_short_lines=pad_short_lines)))
  assert len(chunk) == 2 and not chunk.padded.any()
  assert [(r.line_no, r.reason.split(":")[0]) for r in chunk.bad_rows] == [(3, "cut")]
  path.write_text("\n".join([GOOD, GOOD]))  # no final newline, every field there
  assert len(criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(str(path))))) == 2


def test_first_bad_line_wins_and_all_are_reported(tmp_path):
  lines = [GOOD, _replace(0, "2"), GOOD, MALFORMED[1][0], MALFORMED[0][0], GOOD]
  with pytest.raises(InputError) as error:
    criteo_parse.parse_lines(lines, "f.tsv", first_line_no=100)
  assert (error.value.line, error.value.field) == (101, "label")
  chunk = criteo_parse.parse_lines(lines, "f.tsv", first_line_no=100, strict=False)
  assert [(r.line_no, r.reason.split(":")[0]) for r in chunk.bad_rows] == [
      (101, "field label"), (103, "field line"), (104, "field line")]
  assert chunk.line_numbers.tolist() == [100, 102, 105]


def test_parsed_values(tmp_path):
  chunk = criteo_parse.parse_lines([GOOD, _replace(0, "0")], "f.tsv")
  assert chunk.label.tolist() == [1, 0]
  expected_ints = [int(v) if v else 0 for v in INTS]
  np.testing.assert_array_equal(chunk.int_values, [expected_ints] * 2)
  np.testing.assert_array_equal(chunk.int_missing, [[v == "" for v in INTS]] * 2)
  expected_cats = [int(v, 16) if v else -1 for v in CATS]
  np.testing.assert_array_equal(chunk.cat_values, [expected_cats] * 2)


def _reference_parse(line):
  """The obvious per-line parser, to check the vectorised one against."""
  fields = line.split("\t")
  return (int(fields[0]), [int(v) if v else 0 for v in fields[1:14]],
          [int(v, 16) if v else -1 for v in fields[14:]])


def test_vectorised_parser_matches_reference_on_random_lines():
  rng = np.random.default_rng(7)
  lines = []
  for _ in range(300):
    ints = ["" if rng.random() < 0.2 else str(rng.integers(-5, 10**int(rng.integers(1, 12))))
            for _ in range(13)]
    cats = ["" if rng.random() < 0.2 else "%08x" % rng.integers(0, 2**32) for _ in range(26)]
    lines.append("\t".join([str(rng.integers(0, 2))] + ints + cats))
  chunk = criteo_parse.parse_lines(lines, "random.tsv")
  reference = [_reference_parse(line) for line in lines]
  assert chunk.label.tolist() == [r[0] for r in reference]
  assert chunk.int_values.tolist() == [r[1] for r in reference]
  assert chunk.cat_values.tolist() == [r[2] for r in reference]


def test_chunks_keep_line_numbers_and_gzip_matches_plain(tmp_path):
  lines = [_replace(5, str(i)) for i in range(10)]
  plain = _write(tmp_path / "day_0", lines)
  packed = _write(tmp_path / "day_1.gz", lines, compress=True)
  for path in (plain, packed):
    chunks = list(criteo.read_criteo_tsv(path, chunk_rows=3))
    assert [len(c) for c in chunks] == [3, 3, 3, 1]
    joined = criteo_parse.ParsedChunk.concatenate(chunks)
    assert joined.line_numbers.tolist() == list(range(1, 11))
    assert joined.int_values[:, 4].tolist() == list(range(10))
  bad = _write(tmp_path / "day_2.gz", lines[:7] + [_replace(5, "1.5")] + lines[8:], compress=True)
  with pytest.raises(InputError) as error:
    list(criteo.read_criteo_tsv(bad, chunk_rows=3))
  assert (error.value.path, error.value.line, error.value.field) == (bad, 8, "I5")


def test_missing_final_newline(tmp_path):
  path = tmp_path / "day_0"
  path.write_text(GOOD + "\n" + GOOD)
  assert len(criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(str(path))))) == 2


def test_corrupt_gzip_is_a_clear_error(tmp_path):
  lines = [GOOD] * 2000
  good = _write(tmp_path / "day_0.gz", lines, compress=True)
  data = open(good, "rb").read()
  truncated = tmp_path / "truncated.gz"
  truncated.write_bytes(data[:len(data) // 2])
  flipped = bytearray(data)
  flipped[len(data) // 2] ^= 0xFF
  corrupt = tmp_path / "corrupt.gz"
  corrupt.write_bytes(bytes(flipped))
  trailing = tmp_path / "trailing.gz"
  trailing.write_bytes(data + b"not gzip")
  for path in (truncated, trailing):
    with pytest.raises(DprecError, match=f"{path}: corrupt gzip data"):
      list(criteo.read_criteo_tsv(str(path), chunk_rows=500))
  # A damaged deflate block may decode to garbage lines before the CRC check fails: either way
  # the file is refused, also in permissive mode.
  for strict in (True, False):
    with pytest.raises(DprecError, match=str(corrupt)):
      list(criteo.read_criteo_tsv(str(corrupt), strict=strict, chunk_rows=500))
  fake = tmp_path / "fake.gz"
  fake.write_text(GOOD + "\n")
  with pytest.raises(DprecError, match="not gzip data"):
    list(criteo.read_criteo_tsv(str(fake)))
  with pytest.raises(DprecError, match="no such file"):
    list(criteo.read_criteo_tsv(str(tmp_path / "absent")))
  with pytest.raises(DprecError, match="a directory"):
    list(criteo.read_criteo_tsv(str(tmp_path)))


def test_day_files_are_ordered_numerically(tmp_path):
  for name in ("day_10", "day_2.gz", "day_0", "notes.txt"):
    (tmp_path / name).write_text("")
  assert [os.path.basename(p) for p in criteo.criteo_day_files(str(tmp_path))] == [
      "day_0", "day_2.gz", "day_10"]
  (tmp_path / "empty").mkdir()
  with pytest.raises(DprecError, match="no day_N files"):
    criteo.criteo_day_files(str(tmp_path / "empty"))
  with pytest.raises(DprecError, match="absent: does not exist"):
    criteo.criteo_day_files(str(tmp_path / "absent"))
  with pytest.raises(DprecError, match="not a directory"):
    criteo.criteo_day_files(str(tmp_path / "notes.txt"))


def test_format_hex_round_trips():
  ids = np.array([0, 1, 0xDEADBEEF, 2**32 - 1])
  text = criteo_parse.format_hex(ids).view("S8").ravel()
  assert text.tolist() == [b"00000000", b"00000001", b"deadbeef", b"ffffffff"]
  ok, parsed = criteo_parse.parse_hex_ids([t.decode() for t in text] + [""])
  assert ok.all() and parsed.tolist() == ids.tolist() + [-1]


def test_a_trailing_user_id_column_is_parsed_and_checked():
  chunk = criteo_parse.parse_lines([GOOD + "\t7", GOOD + "\t0"], "f", user_column=True)
  np.testing.assert_array_equal(chunk.user_id, [7, 0])
  assert criteo_parse.parse_lines([GOOD], "f").user_id is None  # the Criteo format: no column
  permissive = criteo_parse.parse_lines([GOOD + "\t7", GOOD, GOOD + "\t-2", GOOD + "\tx"], "f",
                                  strict=False, user_column=True)
  np.testing.assert_array_equal(permissive.user_id, [7])
  assert [(r.line_no, r.reason.split(":")[0]) for r in permissive.bad_rows] == [
      (2, "field line"), (3, "field user_id"), (4, "field user_id")]
  with pytest.raises(InputError, match="f:2: field user_id"):
    criteo_parse.parse_lines([GOOD + "\t7", GOOD + "\t"], "f", user_column=True)
  joined = criteo_parse.ParsedChunk.concatenate([permissive, permissive])
  np.testing.assert_array_equal(joined.user_id, [7, 7])
  np.testing.assert_array_equal(criteo.transform(joined, _vocabulary())["user_id"], [7, 7])


def _vocabulary():
  return criteo.CriteoVocabulary(tuple(np.zeros(0, np.int64) for _ in range(26)),
                                 tuple(np.zeros(0, np.int64) for _ in range(26)))


def test_training_on_tsv_days_names_the_bad_line_and_the_fix(tmp_path):
  """`train ctr` on TSV days (`load_data`): a malformed line is one line naming file, line and
  field, and the fix (correct it, or preprocess, which sets it aside); a cut file names its own."""
  from dprec.data.ctr_data import load_data
  _write(tmp_path / "day_1", [GOOD, GOOD])
  day_0 = _write(tmp_path / "day_0", [GOOD, _replace(5, "1.5"), GOOD])
  with pytest.raises(InputError) as error:
    load_data(str(tmp_path))
  message = str(error.value)
  assert message.startswith(f"{day_0}:2: field I5: not an integer") and "\n" not in message
  assert "fix or remove that line, or run `dprec preprocess criteo` on the days" in message
  (tmp_path / "day_0").write_text(GOOD + "\n" + GOOD[:40])
  with pytest.raises(InputError, match=r"day_0:2: field line: cut: .*copy it again$"):
    load_data(str(tmp_path))
