"""Golden tests of the sequences job: formats, iterative k-core, time order, leave-last-out split,
item frequencies p_i, dead letters, and the reader a model trains from."""
import json

import numpy as np
import pytest

from dprec.data import identity
from dprec.data.sequences import load_sequences
from dprec.errors import DprecError
from pipelines import sequences


def _run(tmp_path, name, text, input_format, in_process, **options):
  path = tmp_path / name
  path.write_text(text)
  job = sequences.SequencesJob(inputs=(str(path),), input_format=input_format,
                               output=str(tmp_path / f"out_{name}"), **options)
  return sequences.run(job, in_process), load_sequences(job.output)


def test_movielens_both_layouts_sort_by_time_and_split(tmp_path, in_process):
  # ratings.dat: user::item::rating::time; lines out of time order on purpose.
  ratings = "\n".join(["7::30::5::300", "7::10::3::100", "7::20::4::200", "7::40::1::400",
                       "9::10::5::50", "9::30::2::60"]) + "\n"
  stats, data = _run(tmp_path, "ratings.dat", ratings, "movielens", in_process, min_count=1)
  udata = ratings.replace("::", "\t")
  stats_tab, data_tab = _run(tmp_path, "u.data", udata, "movielens", in_process, min_count=1)
  assert stats["users"] == stats_tab["users"] == 2 and stats["actions"] == 6
  # Items 10, 20, 30, 40 → 1..4 by original id; users 7, 9 → 1, 2.
  # User 9 has two actions: too few to hold out validation and test, so both train (SASRec).
  assert [s.tolist() for s in data.train] == [[1, 2], [1, 3]] == [
      s.tolist() for s in data_tab.train]
  assert data.valid_items.tolist() == [3, 0] and data.test_items.tolist() == [4, 0]
  # p_i = share of users whose training sequence holds item i.
  assert data.item_frequencies.tolist() == [0.0, 1.0, 0.5, 0.5, 0.0]
  assert data.padded_train(3).tolist() == [[0, 1, 2], [0, 1, 3]]
  no_valid = sequences.SequencesJob(inputs=(str(tmp_path / "ratings.dat"),),
                                    input_format="movielens", output=str(tmp_path / "nv"),
                                    min_count=1, validation=False)
  sequences.run(no_valid, in_process)
  data = load_sequences(no_valid.output)
  assert [s.tolist() for s in data.train] == [[1, 2, 3], [1]]
  assert data.valid_items.tolist() == [0, 0] and data.test_items.tolist() == [4, 3]


def test_iterative_k_core_needs_several_rounds(tmp_path, in_process):
  # 2-core: item 99 has one action, so user 3 drops to 1 action, so item 50 drops to 1, ...
  lines = ["1 10", "1 20", "2 10", "2 20", "3 50", "3 99", "4 50", "4 10"]
  stats, data = _run(tmp_path, "v.txt", "\n".join(lines) + "\n", "sasrec", in_process,
                     min_count=2)
  assert stats["k_core_rounds"] >= 3
  assert (stats["users"], stats["items"], stats["actions"]) == (2, 2, 4)
  # The item vocabulary comes from exact counts: the manifest says it is treated as public.
  vocab_privacy = identity.manifest_field(str(tmp_path / "out_v.txt"), "vocab_privacy")
  assert vocab_privacy == identity.public_vocab_privacy("2-core items")
  everything, _ = _run(tmp_path, "w.txt", "\n".join(lines) + "\n", "sasrec", in_process)
  assert (everything["users"], everything["items"], everything["actions"]) == (4, 4, 8)
  assert everything["k_core"] == 1  # sasrec files are filtered already: no k-core by default.


def test_csv_header_line_order_and_dead_letters(tmp_path, in_process):
  text = "user,item,timestamp\nu1,a,5\nu1,b,5\nu1,c,1\nu2,a,9\nu2,x\nu2,b,soon\n"
  stats, data = _run(tmp_path, "log.csv", text, "csv", in_process, min_count=1,
                     max_bad_fraction=0.5)
  assert stats["dead_letters"] == 2 and stats["lines_in"] == 6  # 4 good + 2 bad (+ header).
  assert stats["bad_rows_by_reason"] == {"line": 1, "timestamp": 1}
  assert stats["beam_counters"] == {"dead_letters": 2, "lines_in": 6}
  with open(tmp_path / "out_log.csv" / "dead_letters.jsonl") as stream:
    letters = [json.loads(line) for line in stream]
  assert [(l["line"], l["raw"]) for l in letters] == [(6, "u2,x"), (7, "u2,b,soon")]
  # u1: c (t=1), then a and b (t=5, file order); ids a, b, c → 1, 2, 3.
  assert [s.tolist() for s in data.train] == [[3], [1]]
  assert data.valid_items.tolist() == [1, 0] and data.test_items.tolist() == [2, 0]


def test_too_many_bad_lines_fail(tmp_path, in_process):
  with pytest.raises(DprecError, match="1 of 3 lines are malformed"):
    _run(tmp_path, "bad.txt", "1 2\n1 3\nnonsense\n", "sasrec", in_process)


def test_filtering_everything_away_is_refused_in_one_line(tmp_path, in_process, capsys):
  from dprec import cli
  # Three users with two ratings each: the default 5-core of movielens leaves nothing.
  path = tmp_path / "u.data"
  path.write_text("".join(f"{u}\t{i}\t5\t{u * 10 + i}\n" for u in (1, 2, 3) for i in (7, 8)))
  out = tmp_path / "empty"
  code = cli.main(["preprocess", "sequences", "--input", str(path), "--format", "movielens",
                   "--output", str(out)] + in_process)
  assert code == 2
  *progress, err = capsys.readouterr().err.strip().splitlines()  # the job's phase lines, then it
  assert all(line.startswith("preprocess sequences: ") for line in progress)
  assert err.startswith("dprec: error: no sequences") and "--min-count" in err
  assert "6 actions of 3 users and 2 items" in err and "5-core" in err and "leaves 0" in err
  assert not (out / "manifest.json").exists()
  stats, data = _run(tmp_path, "u2.data", path.read_text(), "movielens", in_process, min_count=2)
  assert stats["users"] == 3 and data.num_items == 2


def test_a_model_trains_on_the_sequences(tmp_path, in_process):
  import tensorflow as tf
  rng = np.random.default_rng(0)
  # Each user walks through items in a cycle: the next item is predictable from the last.
  lines = [f"{u} {(s + i) % 12 + 1}" for u in range(1, 61) for s in [rng.integers(12)]
           for i in range(6)]
  _, data = _run(tmp_path, "cycle.txt", "\n".join(lines) + "\n", "sasrec", in_process)
  window = data.padded_train(3)
  inputs, targets = window[:, :-1][:, -1:], window[:, -1]
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([tf.keras.Input([1], dtype=tf.int64),
                               tf.keras.layers.Embedding(data.num_items + 1, 8),
                               tf.keras.layers.Flatten(),
                               tf.keras.layers.Dense(data.num_items + 1)])
  model.compile(tf.keras.optimizers.Adam(0.05),
                tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  losses = model.fit(inputs, targets, epochs=5, verbose=0).history["loss"]
  assert losses[-1] < losses[0] / 2
