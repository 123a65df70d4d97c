"""Synthetic generators: real formats, determinism, long tails, drift, learnable structure,
bounded memory."""
import hashlib
import os
import tracemalloc

import numpy as np
import pytest
from scipy import special, stats

from dprec.data import criteo, criteo_parse, synthetic
from dprec.errors import DprecError

SMALL = "scaled:20000"  # Table 3 shape at 20k buckets: fast, still long-tailed


@pytest.fixture(scope="module")
def criteo_days(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("criteo"))
  summary = synthetic.generate_criteo(out, 60000, 3, seed=5, vocab=SMALL, progress=False)
  return out, summary


def _auc(labels, scores):
  labels = np.asarray(labels, bool)
  ranks = stats.rankdata(scores)
  positives, negatives = labels.sum(), (~labels).sum()
  return (ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives)


def test_output_parses_strictly_as_criteo_tsv(criteo_days):
  out, summary = criteo_days
  files = criteo.criteo_day_files(out)
  assert [os.path.basename(f) for f in files] == ["day_0", "day_1", "day_2"]
  chunks = [criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(f))) for f in files]
  assert [len(c) for c in chunks] == [20000, 20000, 20000]
  joined = criteo_parse.ParsedChunk.concatenate(chunks)
  assert summary["rows"] == 60000
  assert abs(joined.label.mean() - summary["ctr"]) < 1e-12
  assert 0.2 < summary["ctr"] < 0.3
  assert abs(joined.int_missing.mean() - summary["int_missing_share"]) < 1e-12
  assert abs((joined.cat_values < 0).mean() - summary["cat_missing_share"]) < 1e-12
  assert joined.int_missing.mean() > 0.1 and (joined.cat_values < 0).mean() > 0.05
  assert (joined.int_values[:, 1] < 0).any()  # I2 has negative values, as in Criteo
  present = joined.int_values[~joined.int_missing]
  assert present.max() > 100 * max(1, np.median(present))  # heavy tails


def test_bucket_frequencies_are_long_tailed(criteo_days):
  out, summary = criteo_days
  counts = criteo.count_categories(criteo.read_criteo_tsv(criteo.criteo_day_files(out)))
  covered = total = 0
  for _, cnt in counts:
    top = np.sort(cnt)[::-1][:max(1, int(np.ceil(0.01 * len(cnt))))]
    covered, total = covered + top.sum(), total + cnt.sum()
  share = covered / total
  print(f"top 1% of buckets cover {share:.1%} of rows")
  assert abs(share - summary["top1pct_bucket_share"]) < 1e-9
  assert share > 0.4
  big = int(np.argmax([len(ids) for ids, _ in counts]))
  by_feature = summary["top1pct_bucket_share_by_feature"][criteo.CATEGORICAL_FEATURES[big]]
  assert by_feature > 0.3  # even the largest table is dominated by its head


def test_days_share_ids_but_drift(criteo_days):
  out, _ = criteo_days
  files = criteo.criteo_day_files(out)
  per_day = [criteo.count_categories(criteo.read_criteo_tsv(f)) for f in files]
  big = int(np.argmax([len(ids) for ids, _ in per_day[0]]))
  first, last = per_day[0][big], per_day[-1][big]
  new = ~np.isin(last[0], first[0])
  assert 0.0 < last[1][new].sum() / last[1].sum() < 0.5  # some traffic on never-seen ids
  head = lambda ids, cnt: set(ids[np.argsort(-cnt, kind="stable")[:20]].tolist())
  shared = len(head(*first) & head(*last))
  assert 5 <= shared < 20  # the head persists, but popularity moves


def test_same_seed_same_bytes(tmp_path):
  for name, seed in (("a", 3), ("b", 3), ("c", 4)):
    synthetic.generate_criteo(str(tmp_path / name), 3000, 2, seed, SMALL, progress=False)
  for day in ("day_0", "day_1"):
    a, b, c = ((tmp_path / n / day).read_bytes() for n in "abc")
    assert a == b and a != c
  for name, seed in (("a.txt", 3), ("b.txt", 3), ("c.txt", 4)):
    synthetic.generate_sequences(str(tmp_path / name), 300, 100, seed, progress=False)
  a, b, c = ((tmp_path / n).read_bytes() for n in ("a.txt", "b.txt", "c.txt"))
  assert a == b and a != c


def test_users_add_a_zipf_user_id_column_and_change_nothing_else(tmp_path):
  plain = synthetic.generate_criteo(str(tmp_path / "a"), 4000, 2, 3, SMALL, progress=False)
  summary = synthetic.generate_criteo(str(tmp_path / "b"), 4000, 2, 3, SMALL,
                                      synthetic.CriteoSynthConfig(users=50), progress=False)
  assert "users" not in plain and summary["users"] == 50
  users = []
  for day in ("day_0", "day_1"):
    a = (tmp_path / "a" / day).read_text().splitlines()
    b = [line.rsplit("\t", 1) for line in (tmp_path / "b" / day).read_text().splitlines()]
    assert [fields for fields, _ in b] == a  # the 40 Criteo columns: the same bytes
    users += [int(user) for _, user in b]
    chunk = criteo_parse.parse_lines((tmp_path / "b" / day).read_text().splitlines(), day,
                                     user_column=True)
    assert len(chunk) == len(a)
  counts = np.bincount(users, minlength=51)[1:]
  assert counts.max() == summary["max_rows_per_user"] and counts.argmax() == 0  # user 1 most active
  # The continuous Zipf law of the bucket ranks: P(user ≤ k) = ((k + 1)^(1−s) − 1)/(51^(1−s) − 1).
  power = 1 - synthetic.CriteoSynthConfig.user_zipf
  cdf = (np.arange(1, 52, dtype=float) ** power - 1) / (51.0 ** power - 1)
  assert stats.chisquare(counts, np.diff(cdf) * len(users)).pvalue > 1e-4


def test_tail_decay_moves_the_click_signal_into_frequent_buckets():
  """tail_decay = α scales each bucket's click weight by (1 + its day-0 rank)^-α, ids new after
  day 0 counting as rank V, and changes nothing else that is drawn: the same buckets and
  integers, a recalibrated click rate, and almost no click signal left in rare buckets."""
  sizes = np.asarray(synthetic.vocab_sizes(SMALL))
  streams = [list(synthetic.criteo_blocks(60000, 3, 5, synthetic.CriteoSynthConfig(
      vocab=SMALL, tail_decay=alpha))) for alpha in (0.0, 0.5)]
  for (day, plain), (_, decayed) in zip(*streams):
    for key in ("ids", "hex_ids", "ints", "int_missing"):
      np.testing.assert_array_equal(plain[key], decayed[key])
    rank = np.where(plain["ids"] < sizes, np.maximum(plain["ids"], 0), sizes)  # id = day-0 rank
    np.testing.assert_allclose(decayed["weights"], plain["weights"] * (1.0 + rank) ** -0.5)
  assert (streams[1][-1][1]["ids"] >= sizes).any()  # drift brought fresh ids by day 2
  rare_shares = []
  for stream in streams:
    day0 = [block for day, block in stream if day == 0]
    ids, weights, labels = (np.concatenate([b[k] for b in day0])
                            for k in ("ids", "weights", "label"))
    assert abs(labels.mean() - 0.25) < 0.01
    rare = np.zeros(ids.shape, bool)
    for j, column in enumerate(ids.T):
      present = column >= 0
      rare[present, j] = np.bincount(column[present])[column[present]] < 30
    rare_shares.append((weights * rare).sum(axis=1).var() / weights.sum(axis=1).var())
  print(f"click-logit variance from buckets seen < 30 times: {rare_shares}")
  assert rare_shares[0] > 0.05 and rare_shares[1] < 0.01


def test_scaled_vocabularies():
  assert synthetic.vocab_sizes("table3") == criteo.TABLE3_VOCAB_SIZES
  assert sum(criteo.TABLE3_VOCAB_SIZES) == 338782
  for spec, total in (("scaled:10M", 10_000_000), ("scaled:1.7M", 1_700_000)):
    assert abs(sum(synthetic.vocab_sizes(spec)) / total - 1) < 1e-3
  with pytest.raises(DprecError, match="scaled:M"):
    synthetic.vocab_sizes("huge")


def test_click_model_is_learnable(criteo_days):
  """Per-bucket click rates counted on days 0-1 rank day-2 clicks well above chance, and the
  generator's own probabilities are in the intended band."""
  out, _ = criteo_days
  files = criteo.criteo_day_files(out)
  train = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(files[:2])))
  test = criteo_parse.ParsedChunk.concatenate(list(criteo.read_criteo_tsv(files[2:])))
  prior = train.label.mean()
  score = np.zeros(len(test))
  for j in range(26):
    ids, inverse = np.unique(train.cat_values[:, j], return_inverse=True)
    clicks = np.bincount(inverse, weights=train.label)
    seen = np.bincount(inverse)
    rate = special.logit((clicks + 20 * prior) / (seen + 20)) - special.logit(prior)
    position = np.minimum(np.searchsorted(ids, test.cat_values[:, j]), len(ids) - 1)
    score += np.where(ids[position] == test.cat_values[:, j], rate[position], 0.0)
  naive_bayes = _auc(test.label, score)
  oracle = np.concatenate([special.expit(b["logit"]) for d, b in synthetic.criteo_blocks(
      60000, 3, 5, synthetic.CriteoSynthConfig(vocab=SMALL)) if d == 2])
  oracle_auc = _auc(test.label, oracle)
  print(f"naive Bayes AUC {naive_bayes:.3f}, oracle AUC {oracle_auc:.3f}")
  assert 0.75 < oracle_auc < 0.9
  assert 0.65 < naive_bayes < oracle_auc


def test_memory_is_bounded_by_the_block_not_the_rows(tmp_path):
  peaks = []
  for rows in (synthetic.BLOCK_ROWS // 2, 4 * synthetic.BLOCK_ROWS):
    tracemalloc.start()
    synthetic.generate_criteo(str(tmp_path / str(rows)), rows, 1, 0, SMALL, progress=False)
    peaks.append(tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
  assert peaks[1] < 2.5 * peaks[0], peaks  # 8x the rows, not 8x the memory


def _sequences(path):
  data = np.loadtxt(path, dtype=np.int64).reshape(-1, 2)
  users, starts = np.unique(data[:, 0], return_index=True)
  return users, np.split(data[:, 1], np.sort(starts)[1:])


def test_sequences_format_tail_and_learnable_structure(tmp_path):
  path = str(tmp_path / "seq.txt")
  summary = synthetic.generate_sequences(path, 3000, 600, seed=1, progress=False)
  data = np.loadtxt(path, dtype=np.int64)
  assert len(data) == summary["actions"]
  user_changes = np.flatnonzero(np.diff(data[:, 0]))
  assert (np.diff(data[:, 0]) >= 0).all() and len(user_changes) == 2999  # consecutive users
  users, sequences = _sequences(path)
  assert users.tolist() == list(range(1, 3001))
  assert min(map(len, sequences)) >= 3
  assert data[:, 1].min() >= 1 and data[:, 1].max() <= 600
  counts = np.bincount(data[:, 1], minlength=601)[1:]
  top = np.sort(counts)[::-1][:6].sum() / counts.sum()
  assert abs(top - summary["top1pct_item_share"]) < 1e-9
  assert top > 0.05  # the top 1% of items (6 of 600) get far more than 1% of actions
  # Next-item structure: successor counts from the first users predict the last item of the
  # others far better than popularity does (hit rate at 10).
  train, test = sequences[:2000], sequences[2000:]
  successors = np.zeros((601, 601))
  for seq in train:
    np.add.at(successors, (seq[:-1], seq[1:]), 1)
  popular = set(np.argsort(-counts)[:10] + 1)
  hits_markov = np.mean([seq[-1] in set(np.argsort(-successors[seq[-2]])[:10]) for seq in test])
  hits_popular = np.mean([seq[-1] in popular for seq in test])
  print(f"HR@10 successor {hits_markov:.3f} vs popularity {hits_popular:.3f}")
  assert hits_markov > 2 * hits_popular


def test_taste_order_history_tells_taste_and_last_item_predicts_little(tmp_path):
  """--order taste: no item recurs in a user's history; at the defaults, successor counts from
  the last item predict the held-out item worse than popularity (on the chain default, test
  above, far better); with a strong taste the whole history's co-occurrences beat both. The
  chain default's bytes are pinned (same seed, same file as before taste existed)."""
  hits = {}
  for name, config in (("defaults", synthetic.SequenceSynthConfig(mean_length=40, order="taste")),
                       ("strong", synthetic.SequenceSynthConfig(
                           mean_length=40, order="taste", taste_clusters=2, taste_share=0.9))):
    path = str(tmp_path / f"{name}.txt")
    summary = synthetic.generate_sequences(path, 3000, 600, seed=1, config=config, progress=False)
    users, sequences = _sequences(path)
    assert len(users) == 3000 and summary["actions"] == sum(map(len, sequences))
    assert all(len(set(seq)) == len(seq) for seq in sequences)  # each item at most once a user
    assert min(map(len, sequences)) >= 3 and summary["top1pct_item_share"] > 0.02
    hits[name] = _taste_hits(sequences[:2000], sequences[2000:])
  print("HR@10 (history items excluded)", hits)
  assert hits["defaults"]["successor"] < hits["defaults"]["popular"]
  assert hits["strong"]["history"] > 1.5 * max(hits["strong"]["successor"],
                                               hits["strong"]["popular"])
  synthetic.generate_sequences(str(tmp_path / "chain.txt"), 300, 100, 3, progress=False)
  digest = hashlib.sha256((tmp_path / "chain.txt").read_bytes()).hexdigest()
  assert digest[:16] == "458114673797a7e0"  # pinned: the chain default's bytes


def _taste_hits(train, test, items=600):
  """HR@10 on each test user's last item, their history excluded: successor counts of the
  second to last item, popularity, and co-occurrence with the whole history (÷ √count)."""
  counts = np.bincount(np.concatenate(train), minlength=items + 1).astype(float)
  successors, together = np.zeros((2, items + 1, items + 1))
  for seq in train:
    np.add.at(successors, (seq[:-1], seq[1:]), 1)
    together[np.ix_(seq, seq)] += 1
  np.fill_diagonal(together, 0)
  scores = {"successor": lambda seq: successors[seq[-2]] + 1e-6 * counts,
            "popular": lambda seq: counts,
            "history": lambda seq: together[seq[:-1]].sum(0) / np.sqrt(np.maximum(counts, 1))}
  return {name: np.mean([seq[-1] in set(np.argsort(-(score(seq) - 1e9 * _seen(seq)))[:10])
                         for seq in test]) for name, score in scores.items()}


def _seen(seq):
  mask = np.zeros(601)
  mask[seq[:-1]] = 1
  mask[0] = 1
  return mask


def test_generator_rejects_bad_arguments(tmp_path):
  with pytest.raises(DprecError, match="rows >= days"):
    synthetic.generate_criteo(str(tmp_path), 2, 3, progress=False)
  with pytest.raises(DprecError, match="ctr"):
    synthetic.CriteoSynthConfig(ctr=1.5)
  with pytest.raises(DprecError, match="tail_decay"):
    synthetic.CriteoSynthConfig(tail_decay=-0.5)
  with pytest.raises(DprecError, match="items >= 2"):
    synthetic.generate_sequences(str(tmp_path / "s"), 10, 1, progress=False)
  with pytest.raises(DprecError, match="order must be one of chain, taste"):
    synthetic.SequenceSynthConfig(order="random")
  with pytest.raises(DprecError, match="share in"):
    synthetic.SequenceSynthConfig(order="taste", taste_share=1.0)
