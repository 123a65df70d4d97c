"""Criteo click-log TSV lines: the columns, vectorised parsing and validation.

A line is `label`, 13 integer columns and 26 categorical columns of 8-hex-digit ids, tab separated,
with empty fields for missing values (the Criteo Kaggle / 1TB release format; Ghazi et al.,
"Sparsity-Preserving Differentially Private Training of Large Embedding Models", arXiv:2311.08357).
Parsing runs on whole chunks with pyarrow's C++ CSV reader and numpy, never line by line, so Beam
batches of millions of rows parse at the speed of `pandas.read_csv`. Every malformed line is either
an `InputError(path, line, field, reason)` (strict) or returned as a `BadRow` (permissive).

A line with fewer than 40 fields is malformed: it is what an interrupted copy leaves as its last
line, and the rest of such a file is missing. A file's last line without a newline that is short
is reported as `cut` (the file ends inside it). Copies whose lines have their trailing empty fields
stripped (a line whose last categorical columns are missing loses its trailing tabs) are read with
`pad_short_lines=True`: such a line is read as missing trailing values (as `pandas.read_csv` with
40 names does) and flagged in `ParsedChunk.padded`; a cut last line stays malformed. A line with
more than 40 fields is always malformed.

A file may carry one more, trailing column `user_id` (a non-negative decimal integer, required on
every line; `user_column=True`, e.g. `dprec synth criteo --users N`): the key by which `dprec
stream --privacy-unit user` and `dprec train ctr --privacy-unit user` sample, bound and account a
user's rows. Such a line has 41 fields.
"""
import dataclasses
import io
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from dprec.errors import DprecError, InputError

INTEGER_FEATURES = [f"I{i}" for i in range(1, 14)]
CATEGORICAL_FEATURES = [f"C{i}" for i in range(1, 27)]
COLUMNS = ["label"] + INTEGER_FEATURES + CATEGORICAL_FEATURES
USER_COLUMN = "user_id"  # the optional trailing column (module docstring)

_INTEGER_PATTERN = r"^-?[0-9]{1,18}$"
_USER_PATTERN = r"^[0-9]{1,18}$"

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
# Byte value → hex digit value, 255 for a byte that is not a hex digit.
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _offset, _chars in ((0, b"0123456789"), (10, b"abcdef"), (10, b"ABCDEF")):
  _HEX_LUT[np.frombuffer(_chars, dtype=np.uint8)] = np.arange(len(_chars)) + _offset


class BadRow(NamedTuple):
  """A malformed line skipped in permissive mode (`reason` starts with the field's name)."""
  path: str
  line_no: int
  reason: str
  raw: str


@dataclasses.dataclass
class ParsedChunk:
  """Raw columns of consecutive lines of one file; missing fields are flagged, not dropped."""
  path: str
  line_numbers: np.ndarray  # int64[n], 1-based line of each good row in its file
  label: np.ndarray  # int32[n], 0 or 1
  int_values: np.ndarray  # int64[n, 13], 0 where missing
  int_missing: np.ndarray  # bool[n, 13]
  cat_values: np.ndarray  # int64[n, 26], the hex id as an integer, -1 where missing
  padded: np.ndarray  # bool[n], a short line read with `pad_short_lines` (trailing values missing)
  bad_rows: List[BadRow]
  user_id: Optional[np.ndarray] = None  # int64[n], the `USER_COLUMN` (None: no such column)

  def __len__(self):
    return len(self.label)

  @classmethod
  def empty(cls, path: str, user_column: bool = False) -> "ParsedChunk":
    """A chunk of no rows (with an empty `user_id` column if `user_column`)."""
    return cls(path, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros((0, 13), np.int64),
               np.zeros((0, 13), bool), np.zeros((0, 26), np.int64), np.zeros(0, bool), [],
               np.zeros(0, np.int64) if user_column else None)

  @classmethod
  def concatenate(cls, chunks: Sequence["ParsedChunk"]) -> "ParsedChunk":
    """Joins chunks (of one or several files) in order; `path` is the first chunk's."""
    if not chunks:
      return cls.empty("")
    joined = {field.name: np.concatenate([getattr(c, field.name) for c in chunks])
              for field in dataclasses.fields(cls)
              if field.name not in ("path", "bad_rows", "user_id")}
    users = [c.user_id for c in chunks]
    if any(u is None for u in users) and any(u is not None for u in users):
      raise DprecError("cannot join chunks with and without a user_id column")
    joined["user_id"] = None if users[0] is None else np.concatenate(users)
    return cls(path=chunks[0].path, bad_rows=[r for c in chunks for r in c.bad_rows], **joined)


def format_hex(values: np.ndarray) -> np.ndarray:
  """uint8[n, 8]: the lower-case 8-hex-digit text of each id in [0, 2^32) (for writers)."""
  nibbles = (np.asarray(values, np.int64)[:, None] >> (4 * np.arange(7, -1, -1))) & 15
  return _HEX_DIGITS[nibbles]


def parse_hex_ids(strings: Union[pa.Array, Sequence[str]]) -> Tuple[np.ndarray, np.ndarray]:
  """Validates and decodes 8-hex-digit ids: (ok bool[n], int64[n] ids, -1 where empty).

  Works on the string array's buffers: valid values are all 8 bytes long, so the present ones lie
  back to back in the data buffer and decode as one [k, 8] byte matrix.
  """
  array = strings if isinstance(strings, pa.Array) else pa.array(strings, type=pa.string())
  offsets = np.frombuffer(array.buffers()[1], dtype=np.int32, count=len(array) + 1,
                          offset=array.offset * 4)
  buffer = array.buffers()[2]
  data = np.zeros(0, np.uint8) if buffer is None else np.frombuffer(buffer, np.uint8)
  data = _HEX_LUT[data[offsets[0]:offsets[-1]]]
  lengths = np.diff(offsets)
  present = lengths == 8
  ok = present | (lengths == 0)
  bad_bytes = np.flatnonzero(data > 15)
  if len(bad_bytes):
    ok[np.searchsorted(offsets, bad_bytes + offsets[0], side="right") - 1] = False
  values = np.full(len(array), -1, dtype=np.int64)
  if ok.all():
    digits = data.reshape(-1, 8)
    packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
    values[present] = packed.view(">u4").ravel()
  return ok, values


def parse_lines(lines: Iterable[Union[str, bytes]], path: str, first_line_no: int = 1,
                strict: bool = True, pad_short_lines: bool = False,
                user_column: bool = False) -> ParsedChunk:
  """Parses consecutive lines (without their newlines) that start at `first_line_no` of `path`."""
  lines = [line.encode() if isinstance(line, str) else line for line in lines]
  return parse_bytes(b"\n".join(lines) + b"\n" if lines else b"", path, first_line_no, strict,
                     pad_short_lines, user_column)


def parse_bytes(data: bytes, path: str, first_line_no: int = 1, strict: bool = True,
                pad_short_lines: bool = False, user_column: bool = False) -> ParsedChunk:
  """Parses a block of whole lines; the first one is line `first_line_no` of `path` (a block that
  does not end with a newline ends its file).

  Strict mode raises `InputError` for the first malformed line; permissive mode returns malformed
  lines in `bad_rows` and the rest parsed. Lines with fewer than 40 fields are malformed, or with
  `pad_short_lines` padded with missing values, except a cut last line (module docstring).
  `user_column`: every line ends with a 41st field, `USER_COLUMN` (a line without it is
  malformed).
  """
  names = COLUMNS + [USER_COLUMN] * user_column
  data, cut = _without_cut_line(data, path, first_line_no, len(names))
  if not data:
    _raise_if_strict(strict, cut)
    return dataclasses.replace(ParsedChunk.empty(path, user_column), bad_rows=cut)
  if not _is_utf8(data):  # pyarrow fails on such a line without saying where it is
    data = _without_binary(data, path, first_line_no, strict)
  table, skipped = _read_table(data, True, names)
  if skipped:  # Row numbers of ragged lines are only known to the single-threaded reader.
    table, skipped = _read_table(data, False, names)
  line_numbers = np.arange(table.num_rows + len(skipped), dtype=np.int64) + first_line_no
  if skipped:
    keep = np.ones(len(line_numbers), dtype=bool)
    keep[[number - 1 for number, _, _ in skipped]] = False
    line_numbers = line_numbers[keep]
  padded = np.zeros(table.num_rows, bool)
  short = [row for row in skipped if row[2] < len(COLUMNS)] if pad_short_lines else []
  texts = {number + first_line_no - 1: text for number, text, _ in short}  # as read, unpadded
  if short:
    table, line_numbers, padded = _with_padded_lines(table, line_numbers, short, first_line_no,
                                                     names)
    skipped = [row for row in skipped if row[2] >= len(COLUMNS)]
  bad = [(number + first_line_no - 1, "line",
          f"expected {len(names)} tab-separated fields, found {count}", text)
         for number, text, count in skipped]

  columns = [table.column(name).combine_chunks() for name in COLUMNS]
  users = table.column(USER_COLUMN).combine_chunks() if user_column else None
  label_ok = np.asarray(pc.or_(pc.equal(columns[0], "0"), pc.equal(columns[0], "1")))
  int_missing = np.stack([np.asarray(pc.equal(c, "")) for c in columns[1:14]], axis=1)
  int_ok = np.stack([np.asarray(pc.match_substring_regex(c, _INTEGER_PATTERN)) for c in
                     columns[1:14]], axis=1) | int_missing
  cat_ok, cat_values = (np.stack(a, axis=1) for a in zip(*map(parse_hex_ids, columns[14:])))
  user_ok = (np.asarray(pc.match_substring_regex(users, _USER_PATTERN)) if user_column
             else np.ones(len(label_ok), bool))
  row_ok = label_ok & int_ok.all(axis=1) & cat_ok.all(axis=1) & user_ok
  bad_table_rows = np.flatnonzero(~row_ok)
  for row in bad_table_rows[:1] if strict else bad_table_rows:  # strict: only the first matters
    fields = [c[row].as_py() for c in columns] + ([users[row].as_py()] if user_column else [])
    raw = "\t".join(fields) if any(fields) else ""  # pyarrow reads an empty line as 40 ''.
    raw = texts.get(int(line_numbers[row]), raw)
    bad.append((int(line_numbers[row]),) + _field_reason(fields, label_ok[row], int_ok[row],
                                                         cat_ok[row], user_ok[row]) + (raw,))
  if bad:
    bad.sort()
    if strict:
      line_no, field, reason, _ = bad[0]
      raise InputError(path, line_no, field, reason)
    good = pa.array(row_ok)
    columns = [c.filter(good) for c in columns]
    users = users.filter(good) if user_column else None
    line_numbers, padded = line_numbers[row_ok], padded[row_ok]
    int_missing = int_missing[row_ok]
    cat_values = np.stack([parse_hex_ids(c)[1] for c in columns[14:]], axis=1)
  _raise_if_strict(strict, cut)

  int_values = np.stack([np.asarray(pc.cast(pc.if_else(pc.equal(c, ""), "0", c), pa.int64()))
                         for c in columns[1:14]], axis=1)
  return ParsedChunk(
      path=path, line_numbers=line_numbers.astype(np.int64),
      label=np.asarray(pc.cast(columns[0], pa.int32())),
      int_values=int_values, int_missing=int_missing, cat_values=cat_values, padded=padded,
      bad_rows=[BadRow(path, line_no, f"field {field}: {reason}", raw)
                for line_no, field, reason, raw in bad] + cut,
      user_id=np.asarray(pc.cast(users, pa.int64())) if user_column else None)


def _without_cut_line(data: bytes, path: str, first_line_no: int,
                      fields: int) -> Tuple[bytes, List[BadRow]]:
  """`data` without its last line if that has no newline and fewer than `fields` fields (the
  file ends inside it: an interrupted copy), and that line as a `BadRow` with reason `cut: …`."""
  start = data.rfind(b"\n") + 1
  found = data.count(b"\t", start) + 1
  if not data or data.endswith(b"\n") or found >= fields:
    return data, []
  line_no = first_line_no + data.count(b"\n")
  reason = (f"cut: the file ends inside this line ({found} of {fields} fields, no newline): an "
            "interrupted copy? the rest of the file is missing; copy it again")
  return data[:start], [BadRow(path, line_no, reason, data[start:].decode(errors="replace"))]


def _raise_if_strict(strict: bool, cut: List[BadRow]) -> None:
  if strict and cut:
    raise InputError(cut[0].path, cut[0].line_no, "line", cut[0].reason)


def _is_utf8(data: bytes) -> bool:
  """Whether `data` is UTF-8 text (checked fast for ASCII, as Criteo's files are)."""
  if data.isascii():
    return True
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


def _without_binary(data: bytes, path: str, first_line_no: int, strict: bool) -> bytes:
  """Strict: raises `InputError` for the first line of `data` that is not UTF-8 text, naming the
  field holding the first bad byte. Permissive: `data` with such bytes replaced by U+FFFD, so
  the line is reported as a bad row by the checks of its fields."""
  for offset, line in enumerate(data.split(b"\n") if strict else ()):
    try:
      line.decode("utf-8")
    except UnicodeDecodeError as error:
      fields = line[:error.start].count(b"\t")
      field = COLUMNS[fields] if fields < len(COLUMNS) else "line"
      raise InputError(path, first_line_no + offset, field,
                       f"not UTF-8 text (binary data?): byte 0x{line[error.start]:02x} at "
                       f"character {error.start + 1} of the line") from None
  return data.decode("utf-8", errors="replace").encode("utf-8")


def _with_padded_lines(table, line_numbers, short, first_line_no, names):
  """`table` with the `short` lines (pyarrow's skipped (number, text, fields)) padded with empty
  trailing fields (to the `names` columns: an empty user id, then, is malformed), all rows in
  line order; returns (table, line numbers, padded flags)."""
  data = b"".join(text.encode() + b"\t" * (len(names) - count) + b"\n"
                  for _, text, count in short)
  extra, _ = _read_table(data, False, names)
  lines = np.concatenate([line_numbers, [number + first_line_no - 1 for number, _, _ in short]])
  flags = np.concatenate([np.zeros(table.num_rows, bool), np.ones(extra.num_rows, bool)])
  order = np.argsort(lines, kind="stable")
  return pa.concat_tables([table, extra]).take(pa.array(order)), lines[order], flags[order]


def _read_table(data: bytes, use_threads: bool,
                names: Sequence[str]) -> Tuple[pa.Table, List[Tuple[int, str, int]]]:
  """All columns `names` as strings (no quoting); ragged lines are skipped and listed."""
  skipped = []

  def on_invalid_row(row):
    skipped.append((row.number, row.text, row.actual_columns))
    return "skip"

  table = pa_csv.read_csv(
      io.BytesIO(data),
      read_options=pa_csv.ReadOptions(column_names=list(names), use_threads=use_threads,
                                      block_size=1 << 22),
      parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False,
                                        ignore_empty_lines=False,
                                        invalid_row_handler=on_invalid_row),
      convert_options=pa_csv.ConvertOptions(column_types={name: pa.string() for name in names},
                                            strings_can_be_null=False,
                                            quoted_strings_can_be_null=False))
  return table, skipped


def _field_reason(fields, label_ok, int_ok, cat_ok, user_ok=True) -> Tuple[str, str]:
  """The first bad field of a row with the right number of columns, and why it is bad."""
  if not any(fields):
    return "line", "empty line"
  if not label_ok:
    return "label", f"must be 0 or 1, got {fields[0]!r}"
  for name, ok, value in zip(INTEGER_FEATURES, int_ok, fields[1:14]):
    if not ok:
      return name, f"not an integer of at most 18 digits: {value!r}"
  for name, ok, value in zip(CATEGORICAL_FEATURES, cat_ok, fields[14:40]):
    if not ok:
      return name, f"not an 8-hex-digit id: {value!r}"
  if not user_ok:
    return USER_COLUMN, f"not a non-negative integer of at most 18 digits: {fields[40]!r}"
  raise AssertionError("row flagged bad without a bad field")
