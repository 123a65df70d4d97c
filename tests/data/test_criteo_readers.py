"""Vocabularies, the model-input transform and the numpy / tf.data readers."""
import numpy as np
import pytest

from dprec.data import criteo
from dprec.errors import DprecError


def _line(label, ints, cats):
  return "\t".join([str(label)] + [str(v) if v is not None else "" for v in ints]
                   + ["%08x" % v if v is not None else "" for v in cats])


def _file(path, rows):
  path.write_text("\n".join(_line(*row) for row in rows) + "\n")
  return str(path)


def _rows(rng, n, ids_per_feature=5):
  return [(int(rng.integers(0, 2)),
           [None if rng.random() < 0.2 else int(rng.integers(-3, 1000)) for _ in range(13)],
           [None if rng.random() < 0.1 else int(rng.integers(0, ids_per_feature)) * 1000 + j
            for j in range(26)]) for _ in range(n)]


def test_vocabulary_keeps_min_count_and_top_k_by_count_then_id():
  counts = {name: {} for name in criteo.CATEGORICAL_FEATURES}
  counts["C1"] = {"0000000a": 5, "0000000b": 1, "00000003": 5, "00000009": 7}
  counts["C2"] = {4: 2, 2: 2, 1: 3}
  vocab = criteo.CriteoVocabulary.from_counts(counts, min_count=2, top_k=[2, 3] + [None] * 24)
  assert vocab.ids[0].tolist() == [9, 3]  # 7 then the smaller id of the tie at 5
  assert vocab.counts[0].tolist() == [7, 5]
  assert vocab.ids[1].tolist() == [1, 2, 4]
  assert vocab.sizes[:3] == (3, 4, 1)
  values = np.full((4, 26), -1, np.int64)
  values[:, 0] = [9, 3, 10, -1]
  values[:, 1] = [4, 1, 7, 2]
  indices = vocab.lookup(values)
  assert indices[:, 0].tolist() == [1, 2, 0, 0]  # 10 was cut by top_k, -1 is missing
  assert indices[:, 1].tolist() == [3, 1, 0, 2]
  assert not indices[:, 2:].any()
  with pytest.raises(DprecError, match="unknown categorical"):
    criteo.CriteoVocabulary.from_counts({"C99": {}})


def test_vocabulary_build_save_load(tmp_path):
  rng = np.random.default_rng(0)
  rows = _rows(rng, 200)
  path = _file(tmp_path / "day_0", rows)
  vocab = criteo.CriteoVocabulary.build(path, min_count=1)
  for j in range(26):  # brute-force counts
    seen = [r[2][j] for r in rows if r[2][j] is not None]
    ids, cnt = np.unique(seen, return_counts=True)
    assert sorted(zip(vocab.ids[j].tolist(), vocab.counts[j].tolist())) == sorted(
        zip(ids.tolist(), cnt.tolist()))
    assert (np.diff(vocab.counts[j]) <= 0).all()
  vocab.save(str(tmp_path / "vocab"))
  loaded = criteo.CriteoVocabulary.load(str(tmp_path / "vocab"))
  for a, b, c, d in zip(vocab.ids, loaded.ids, vocab.counts, loaded.counts):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c, d)
  empty = criteo.CriteoVocabulary.from_counts({})
  empty.save(str(tmp_path / "empty"))
  assert criteo.CriteoVocabulary.load(str(tmp_path / "empty")).sizes == (1,) * 26
  (tmp_path / "vocab" / "C2.tsv").write_text("0000000a\tmany\n")
  with pytest.raises(DprecError, match=r"C2.tsv: not a vocabulary file"):
    criteo.CriteoVocabulary.load(str(tmp_path / "vocab"))
  (tmp_path / "vocab" / "C2.tsv").write_text("0000000a\t3\n")
  (tmp_path / "vocab" / "C3.tsv").write_text("0000000a\t3\nxyz\t1\n")
  with pytest.raises(DprecError, match=r"C3.tsv:2: field id"):
    criteo.CriteoVocabulary.load(str(tmp_path / "vocab"))


def test_transform_and_load(tmp_path):
  rows = [(1, [None, 0, -3, 8] + [1] * 9, [7] * 26), (0, [2] * 13, [None, 8] + [7] * 24)]
  path = _file(tmp_path / "day_0", rows)
  counts = {name: {7: 1} for name in criteo.CATEGORICAL_FEATURES}
  vocab = criteo.CriteoVocabulary.from_counts(counts)
  data = criteo.load_criteo(path, vocab)
  assert data["label"].dtype == np.int32 and data["label"].tolist() == [1, 0]
  assert data["int_features"].dtype == np.float32
  np.testing.assert_allclose(data["int_features"][0, :4], [0, 0, 0, np.log(9)], rtol=1e-6)
  np.testing.assert_allclose(data["int_features"][1], np.log(3), rtol=1e-6)
  assert data["cat_features"].dtype == np.int32
  assert data["cat_features"][0].tolist() == [1] * 26
  assert data["cat_features"][1].tolist() == [0, 0] + [1] * 24  # missing and OOV → 0


def test_load_permissive_reports_bad_rows(tmp_path):
  rng = np.random.default_rng(1)
  text = [_line(*row) for row in _rows(rng, 5)]
  text[2] = "x" + text[2]
  (tmp_path / "day_0").write_text("\n".join(text) + "\n")
  vocab = criteo.CriteoVocabulary.from_counts({})
  bad = []
  data = criteo.load_criteo(str(tmp_path / "day_0"), vocab, strict=False, bad_rows=bad)
  assert len(data["label"]) == 4
  assert [(r.line_no, r.reason.split(":")[0]) for r in bad] == [(3, "field label")]
  with pytest.warns(UserWarning, match="skipped 1 malformed Criteo lines"):
    criteo.load_criteo(str(tmp_path / "day_0"), vocab, strict=False)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_dataset_rebatches_across_chunks_and_files(tmp_path, drop_remainder):
  rng = np.random.default_rng(2)
  paths = [_file(tmp_path / "day_0", _rows(rng, 23)), _file(tmp_path / "day_1", _rows(rng, 18))]
  vocab = criteo.CriteoVocabulary.build(paths[:1])
  expected = criteo.load_criteo(paths, vocab)
  dataset = criteo.criteo_dataset(paths, vocab, batch_size=10, drop_remainder=drop_remainder,
                                  chunk_rows=7)
  batches = list(dataset.as_numpy_iterator())
  assert [len(label) for _, label in batches] == [10] * 4 + ([] if drop_remainder else [1])
  kept = 40 if drop_remainder else 41
  np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), expected["label"][:kept])
  for key in ("int_features", "cat_features"):
    np.testing.assert_array_equal(np.concatenate([b[0][key] for b in batches]),
                                  expected[key][:kept])
