"""Line-block splits keep every line exactly once with its true line number; gzip corruption."""
import gzip

import pytest

from dprec.errors import DprecError
from pipelines import beam_io


def _lines_of(splits):
  seen = []
  for split in splits:
    for item in beam_io.read_split(split):
      assert isinstance(item, beam_io.LineBlock)
      lines = item.data.decode().splitlines()
      seen += [(item.first_line + offset, text) for offset, text in enumerate(lines)]
  return seen


@pytest.mark.parametrize("split_bytes", [1, 7, 100, 1 << 20])
def test_splits_cover_every_line_once_with_its_number(tmp_path, split_bytes):
  path = tmp_path / "day_4"
  lines = [f"row {i} " + "x" * (i % 13) for i in range(1, 301)]
  path.write_text("\n".join(lines))  # No final newline: the last line still counts.
  splits = beam_io.plan_splits([str(path)], split_bytes)
  assert all(split.day == 4 for split in splits)
  assert [s.index for s in splits] == list(range(len(splits)))
  assert _lines_of(splits) == list(enumerate(lines, start=1))
  if split_bytes == 7:
    assert len(splits) > 100


def test_gzip_file_is_one_split_and_corruption_is_a_dead_letter(tmp_path):
  lines = [f"line {i}" for i in range(1, 50001)]
  data = gzip.compress(("\n".join(lines) + "\n").encode())
  good = tmp_path / "day_0.gz"
  good.write_bytes(data)
  [split] = beam_io.plan_splits([str(good)])
  assert split.end == -1
  assert _lines_of([split]) == list(enumerate(lines, start=1))

  broken = tmp_path / "day_1.gz"
  broken.write_bytes(data[:len(data) // 2] + b"\x00" * 64)
  items = list(beam_io.read_split(beam_io.plan_splits([str(broken)])[0]))
  blocks = [i for i in items if isinstance(i, beam_io.LineBlock)]
  [letter] = [i for i in items if isinstance(i, beam_io.DeadLetter)]
  good_lines = sum(b.data.count(b"\n") for b in blocks)
  assert 0 < good_lines < len(lines)
  assert letter.line == good_lines + 1 and letter.reason.startswith("gzip:")
  assert lines[letter.line - 1].startswith(letter.raw)  # The cut line's readable prefix.


def test_inputs_from_directory_glob_and_day_names(tmp_path):
  for name in ["day_10", "day_2.gz", "day_2.tmp", "notes.txt"]:
    (tmp_path / name).write_text("x\n")
  assert [p.split("/")[-1] for p in beam_io.match_inputs(str(tmp_path))] == ["day_2.gz", "day_10"]
  assert beam_io.day_of("/a/day_7.gz") == 7 and beam_io.day_of("/a/train.txt") == 0
  assert not beam_io.is_day_file("/a/day_2.tmp")
  with pytest.raises(DprecError, match="no input files match"):
    beam_io.match_inputs(str(tmp_path / "missing_*"))


def test_default_options_are_the_multiprocess_embedded_runner_unless_told_otherwise():
  options = beam_io.pipeline_options([]).get_all_options()
  assert options["runner"] == beam_io.EMBEDDED_RUNNER
  assert options["direct_num_workers"] == 2
  assert options["direct_running_mode"] == "multi_processing"
  passed = beam_io.pipeline_options(["--runner=DataflowRunner", "--project=p"]).get_all_options()
  assert passed["runner"] == "DataflowRunner" and passed["project"] == "p"
  in_process = beam_io.pipeline_options([], embedded=("in_memory", 1)).get_all_options()
  assert (in_process["direct_running_mode"], in_process["direct_num_workers"]) == ("in_memory", 1)
  given = beam_io.pipeline_options(["--direct_num_workers=3"], embedded=("in_memory", 1))
  assert given.get_all_options()["direct_num_workers"] == 3
  # The streaming job watches in its own process on these, and runs one pipeline on the others.
  for runner, embedded in [(None, True), ("DirectRunner", True), ("DataflowRunner", False),
                           ("FlinkRunner", False), ("PrismRunner", False)]:
    args = [] if runner is None else [f"--runner={runner}"]
    assert beam_io.is_embedded(beam_io.pipeline_options(args)) == embedded, runner


def test_makedirs_tolerates_a_worker_creating_the_directory_first(tmp_path, monkeypatch):
  # Two worker processes of one job: both see the directory missing, the other one creates it.
  path = tmp_path / "out" / "day_0"
  real_exists = beam_io.FileSystems.exists
  seen = []

  def exists_once_stale(p):
    if not seen:
      seen.append(p)
      path.mkdir(parents=True)  # The other worker wins the race.
      return False
    return real_exists(p)

  monkeypatch.setattr(beam_io.FileSystems, "exists", exists_once_stale)
  beam_io.makedirs(str(path))
  assert path.is_dir()


def test_makedirs_still_fails_when_the_directory_cannot_be_made(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(IOError):
    beam_io.makedirs(str(blocker / "sub"))
