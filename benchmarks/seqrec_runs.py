"""What the `train seqrec` benchmarks share (`seqrec_auto.py`, `seqrec_frozen.py`): `--set`
overrides parsed as JSON, a run's record key, one run of `seqrec.run` as a JSON record, the
most popular baseline, and appending a record to a JSONL file (read back with
`jsonl_records.read`)."""
import dataclasses
import json
import os
import time

import numpy as np

from dprec.models import ranking_metrics
from dprec.workflows import seqrec


def value(text):
  """A `--set` value: JSON if it parses, else the string."""
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def pairs(items):
  """{KEY: value} of `KEY=VALUE` items."""
  return dict((key, value(text)) for key, text in (item.split("=", 1) for item in items))


def key(overrides):
  """The overrides as a record key (a run with the same key and seed is done)."""
  return json.dumps(overrides, sort_keys=True)


def run(data, overrides, seed, kept):
  """One `seqrec.run` of `SeqRecTrainOptions(**overrides)` at `seed` on `data`: the summary's
  `kept` fields with the overrides, seed, wall seconds, load averages and the scalar options."""
  options = seqrec.SeqRecTrainOptions(data=None, seed=seed, progress=False, **overrides)
  load = os.getloadavg()
  start = time.time()
  summary = seqrec.run(options, data)
  record = {field: summary.get(field) for field in kept}
  record.update(overrides=overrides, seed=seed, seconds=time.time() - start,
                load_before=[round(x, 1) for x in load],
                load_after=[round(x, 1) for x in os.getloadavg()],
                options={k: v for k, v in dataclasses.asdict(options).items()
                         if isinstance(v, (int, float, str, type(None)))})
  return record


def popularity(examples):
  """Most popular by exact training counts: test and validation metrics."""
  counts = examples.item_frequencies[1:].astype(np.float32)
  score = lambda histories: np.broadcast_to(counts, (len(histories), len(counts)))
  buckets = ranking_metrics.popularity_buckets(examples.item_frequencies)
  test = ranking_metrics.evaluate_full_ranking(score, examples.test_histories,
                                               examples.test_items, buckets, batch_size=1024)
  test["validation"] = ranking_metrics.evaluate_full_ranking(
      score, examples.valid_histories, examples.valid_items, buckets, batch_size=1024)
  test.update(model="most popular", distinct_top10_items=10)
  return test


def append(path, record):
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")
