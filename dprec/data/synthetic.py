"""Synthetic data in the real formats: Criteo-like TSV day files and SASRec-style sequences.

No public data set is reachable from the machines dprec is built on, so tests, demos and
benchmarks use generated files that exercise the same readers and pipelines as the real releases.
Both generators are vectorised, stream fixed-size blocks to disk (bounded memory for any row
count) and are deterministic: the same arguments give identical bytes.
"""
import dataclasses
import os
import re
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from scipy import special

from dprec.data.criteo import TABLE3_VOCAB_SIZES
from dprec.data.criteo_parse import CATEGORICAL_FEATURES, format_hex
from dprec.errors import DprecError
from dprec.progress import progress_bar

BLOCK_ROWS = 1 << 15  # generation block; part of the random stream, so fixed
_MAX_INT = 10**10 - 1
_POW10 = 10.0 ** np.arange(10, -1, -1)  # 1e10 … 1
_TAB, _NEWLINE, _SPACE, _MINUS = 9, 10, 32, 45

# Missing-value rates roughly like the Criteo Kaggle release (I1..I13, C1..C26).
INT_MISSING_RATES = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
CAT_MISSING_RATES = (0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0,
                     0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44)


def vocab_sizes(spec: str) -> Tuple[int, ...]:
  """Buckets per feature: `table3` (Ghazi et al., "Sparsity-Preserving Differentially Private
  Training of Large Embedding Models", arXiv:2311.08357) or `scaled:M` (Table 3 scaled to about M
  buckets in all; `M` may end in k or M, e.g. `scaled:1.7M`)."""
  if spec == "table3":
    return TABLE3_VOCAB_SIZES
  match = re.fullmatch(r"scaled:(\d+(?:\.\d+)?)([kKmM]?)", spec)
  if not match:
    raise DprecError(f"vocab must be 'table3' or 'scaled:M' (e.g. scaled:1.7M), got {spec!r}")
  total = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[match.group(2).lower()]
  scale = total / sum(TABLE3_VOCAB_SIZES)
  return tuple(max(2, int(round(v * scale))) for v in TABLE3_VOCAB_SIZES)


@dataclasses.dataclass(frozen=True)
class CriteoSynthConfig:
  """The generated world; per-feature values are drawn from the seed within the given ranges."""
  vocab: str = "table3"
  ctr: float = 0.25  # mean click rate on day 0
  zipf_range: Tuple[float, float] = (1.05, 1.35)  # per-feature exponents of bucket frequency
  weight_scale_range: Tuple[float, float] = (0.04, 0.40)  # per-feature click weight scales
  latent_weight: float = 0.5  # click weight of the latent propensity the integers reveal
  interaction_weight: float = 0.3  # weight of the C1 x C2 product (learnable by an MLP, not LR)
  drift_swap: float = 0.05  # share of buckets whose popularity rank is jittered each day
  drift_new: float = 0.02  # share of ranks taken over by never-seen ids each day
  ctr_drift: float = 0.05  # std of the day-to-day change of the click logit's intercept
  # Click weights shrink with rarity: × (1 + day-0 popularity rank)^-tail_decay (ids drift brings
  # in count as the rarest rank). 0 = off. It moves the click signal into frequent buckets, the
  # regime Ghazi et al.'s (2023) Criteo results imply (rows kept by per-batch selection carry the
  # AUC).
  tail_decay: float = 0.0
  # A trailing 41st column `user_id` (1..users; 0 = no column, the Criteo format): each row's
  # user drawn from a Zipf law of activity, P(user u) ≈ u^-user_zipf (the continuous law of the
  # bucket ranks, `_bounded_zipf`), on every day alike and independent of the clicks (for
  # `dprec stream --privacy-unit user`).
  users: int = 0
  user_zipf: float = 1.1

  def __post_init__(self):
    if not 0 < self.ctr < 1:
      raise DprecError(f"ctr must be in (0, 1), got {self.ctr}")
    if self.users < 0 or not self.user_zipf > 1:
      raise DprecError(f"need users >= 0 and user_zipf > 1, got {self.users}, {self.user_zipf}")
    if not self.tail_decay >= 0:
      raise DprecError(f"tail_decay must be >= 0, got {self.tail_decay}")


class _CriteoWorld:
  """Per-feature parameters, the day's rank → bucket-id maps, and the click model."""

  def __init__(self, config: CriteoSynthConfig, seed: int):
    self.config, self.seed = config, seed
    self.sizes = np.asarray(vocab_sizes(config.vocab), np.int64)
    rng = np.random.default_rng([seed, 0])
    features = len(CATEGORICAL_FEATURES)
    self.zipf = rng.uniform(*config.zipf_range, features)
    self.weight_scale = rng.uniform(*config.weight_scale_range, features)
    self.int_mu = rng.uniform(0.5, 4.0, len(INT_MISSING_RATES))
    self.int_sigma = rng.uniform(0.8, 1.6, len(INT_MISSING_RATES))
    self.int_latent = rng.uniform(0.2, 0.8, len(INT_MISSING_RATES))
    self.rank_maps = [np.arange(v, dtype=np.int64) for v in self.sizes]
    self.next_id = self.sizes.copy()
    self.day, self.intercept = 0, 0.0
    self.intercept = self._calibrate_intercept(config.ctr)

  def advance_day(self):
    """Day-to-day drift: some buckets move a little in popularity, some ranks go to new ids."""
    self.day += 1
    rng = np.random.default_rng([self.seed, 1, self.day])
    for j, ranks in enumerate(self.rank_maps):
      size = len(ranks)
      jitter = rng.normal(0.0, 0.5, size) * (rng.random(size) < self.config.drift_swap)
      ranks[:] = ranks[np.argsort(np.log1p(np.arange(size)) + jitter, kind="stable")]
      fresh = np.flatnonzero(rng.random(size) < self.config.drift_new)
      ranks[fresh] = self.next_id[j] + np.arange(len(fresh))
      self.next_id[j] += len(fresh)
    self.intercept += rng.normal(0.0, self.config.ctr_drift)

  def sample(self, rng: np.random.Generator, rows: int) -> Dict[str, np.ndarray]:
    """One block: latent propensity, integers, bucket ids (-1 missing) and clicks."""
    latent = rng.standard_normal(rows)
    noise = rng.standard_normal((rows, len(INT_MISSING_RATES)))
    log_scale = self.int_mu + self.int_sigma * (
        self.int_latent * latent[:, None] + np.sqrt(1 - self.int_latent**2) * noise)
    ints = np.floor(np.expm1(np.minimum(log_scale, 22.0))).clip(0, _MAX_INT).astype(np.int64)
    ints[:, 1] -= 3  # like Criteo's I2, which has a few negative values
    int_missing = rng.random(ints.shape) < np.asarray(INT_MISSING_RATES)
    uniform = rng.random((rows, len(self.sizes)))
    cat_missing = rng.random(uniform.shape) < np.asarray(CAT_MISSING_RATES)
    ranks = _bounded_zipf(uniform, self.sizes, self.zipf)
    ids = np.stack([self.rank_maps[j][ranks[:, j]] for j in range(len(self.sizes))], axis=1)
    ids[cat_missing] = -1
    weights = self._bucket_weights(ids)
    logit = self._logits(weights, latent)
    return {"label": (rng.random(rows) < special.expit(logit)).astype(np.int64), "logit": logit,
            "ints": ints, "int_missing": int_missing, "ids": ids, "weights": weights}

  def hex_ids(self, ids: np.ndarray) -> np.ndarray:
    """Stable 32-bit id of each (feature, bucket): a bijection per feature, so no collisions."""
    keys = _mix32(np.arange(len(self.sizes), dtype=np.uint32) + np.uint32(0x9E3779B9))
    return _mix32(ids.astype(np.uint32) ^ keys).astype(np.int64)

  def _logits(self, weights: np.ndarray, latent: np.ndarray) -> np.ndarray:
    return (self.intercept + weights.sum(axis=1) + self.config.latent_weight * latent
            + self.config.interaction_weight * weights[:, 0] * weights[:, 1]
            / (self.weight_scale[0] * self.weight_scale[1]))

  def _bucket_weights(self, ids: np.ndarray) -> np.ndarray:
    """Logistic-distributed click weight per (feature, bucket) from a hash, scaled down by the
    bucket's day-0 rank when `tail_decay` > 0 (day 0's rank map is the identity); 0 when
    missing."""
    keys = _mix32(np.arange(ids.shape[1], dtype=np.uint32) ^ _mix32(np.array(self.seed % 2**32)))
    uniform = (_mix32(ids.astype(np.uint32) ^ keys).astype(np.float64) + 0.5) / 2.0**32
    weights = self.weight_scale * special.logit(uniform) / (np.pi / np.sqrt(3))
    if self.config.tail_decay:
      day0_rank = np.clip(ids, 0, self.sizes)  # fresh ids (>= size) rank last
      weights = weights * (1.0 + day0_rank) ** -self.config.tail_decay
    return np.where(ids >= 0, weights, 0.0)

  def _calibrate_intercept(self, ctr: float) -> float:
    """Intercept whose day-0 mean click probability is `ctr` (bisection on a pilot sample)."""
    logits = self.sample(np.random.default_rng([self.seed, 2]), 20000)["logit"] - self.intercept
    low, high = -20.0, 20.0
    for _ in range(60):
      middle = (low + high) / 2
      low, high = (middle, high) if special.expit(logits + middle).mean() < ctr else (low, middle)
    return (low + high) / 2


def _bounded_zipf(uniform: np.ndarray, sizes: np.ndarray, exponent: np.ndarray) -> np.ndarray:
  """Ranks in [0, size) with P(rank) ∝ (rank + 1)^-exponent (continuous inverse CDF)."""
  power = 1.0 - exponent
  top = (sizes + 1.0) ** power
  ranks = np.floor((1.0 + uniform * (top - 1.0)) ** (1.0 / power)).astype(np.int64) - 1
  return np.clip(ranks, 0, sizes - 1)


def _mix32(x: np.ndarray) -> np.ndarray:
  """lowbias32: a bijection of uint32 with good avalanche."""
  x = x.astype(np.uint32)
  x ^= x >> np.uint32(16)
  x *= np.uint32(0x7FEB352D)
  x ^= x >> np.uint32(15)
  x *= np.uint32(0x846CA68B)
  x ^= x >> np.uint32(16)
  return x


def _int_text(values: np.ndarray,
              missing: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
  """Decimal text of int64 values [n, f] in fixed slots [n, f, 1 + D] (sign, D digits, where D is
  the block's widest number), and which bytes to keep."""
  values = np.asarray(values, np.int64)
  magnitude = np.minimum(np.abs(values), _MAX_INT).astype(np.float64)
  width = max(1, int(np.searchsorted(_POW10[::-1], magnitude.max(initial=0), side="right")))
  powers = _POW10[-(width + 1):]
  # Float division is exact here: quotients of integers below 1e10 never round across an integer.
  quotients = np.floor(magnitude[..., None] / powers)
  chars = np.empty(values.shape + (width + 1,), np.uint8)
  chars[..., 0] = _MINUS
  chars[..., 1:] = quotients[..., 1:] - 10 * quotients[..., :-1] + 48
  keep = np.empty(chars.shape, bool)
  keep[..., 0] = values < 0
  keep[..., 1:] = quotients[..., 1:] > 0
  keep[..., -1] = True  # the units digit, also of 0
  if missing is not None:
    keep &= ~missing[..., None]
  return chars, keep


def _hex_text(ids: np.ndarray, present: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """8-hex-digit slots [n, f, 8] of 32-bit ids, kept where present."""
  chars = format_hex(ids.ravel()).reshape(ids.shape + (8,))
  return chars, np.broadcast_to(present[..., None], chars.shape)


def _join_fields(blocks: Sequence[Tuple[np.ndarray, np.ndarray]], separator: int) -> bytes:
  """Lines of the kept bytes of each row's fields ([n, f, w] slots), `separator` between fields."""
  rows = blocks[0][0].shape[0]
  parts, masks = [], []
  for chars, keep in blocks:
    fields, width = chars.shape[1:]
    text = np.empty((rows, fields, width + 1), np.uint8)
    text[..., :width], text[..., width] = chars, separator
    kept = np.empty(text.shape, bool)
    kept[..., :width], kept[..., width] = keep, True
    parts.append(text.reshape(rows, -1))
    masks.append(kept.reshape(rows, -1))
  text, kept = np.concatenate(parts, axis=1), np.concatenate(masks, axis=1)
  text[:, -1] = _NEWLINE
  return text[kept].tobytes()


def _criteo_text(block: Dict[str, np.ndarray]) -> bytes:
  fields = [_int_text(block["label"][:, None]), _int_text(block["ints"], block["int_missing"]),
            _hex_text(block["hex_ids"], block["ids"] >= 0)]
  if "user_id" in block:
    fields.append(_int_text(block["user_id"][:, None]))
  return _join_fields(fields, _TAB)


def _top_share(counts: Sequence[np.ndarray], fraction: float = 0.01) -> Tuple[float, List[float]]:
  """Share of occurrences covered by the top `fraction` of each feature's observed buckets."""
  covered, total, shares = 0, 0, []
  for c in counts:
    c = np.sort(c[c > 0])[::-1]
    top = c[:max(1, int(np.ceil(fraction * len(c))))].sum() if len(c) else 0
    covered, total = covered + top, total + c.sum()
    shares.append(float(top / max(1, c.sum())))
  return float(covered / max(1, total)), shares


def criteo_blocks(rows: int, days: int = 1, seed: int = 0,
                  config: Optional[CriteoSynthConfig] = None
                  ) -> Iterator[Tuple[int, Dict[str, np.ndarray]]]:
  """The generator's stream: `(day, block)` with `label`, `logit` (the true click logit), `ints`,
  `int_missing`, `ids` (bucket ids, -1 missing), `weights` (each bucket's click weight in the
  logit, 0 missing) and `hex_ids` (as written), `rows` in all; with `config.users`, also
  `user_id` (from a random stream of its own: the other columns are the same bytes as without).

  Buckets follow per-feature Zipf laws over `vocab_sizes(config.vocab)` ranks; each day some
  ranks change buckets and some buckets are new (drift). Clicks are Bernoulli(σ(logit)) with a
  logit summing hashed per-bucket weights, a latent propensity that the heavy-tailed integers
  reveal, and one feature interaction.
  """
  if days < 1 or rows < days:
    raise DprecError(f"need days >= 1 and rows >= days, got rows={rows}, days={days}")
  config = config or CriteoSynthConfig()
  world = _CriteoWorld(config, seed)
  for day in range(days):
    if day:
      world.advance_day()
    day_rows = rows // days + (day < rows % days)
    for block, first in enumerate(range(0, day_rows, BLOCK_ROWS)):
      sample = world.sample(np.random.default_rng([seed, 4, day, block]),
                            min(BLOCK_ROWS, day_rows - first))
      sample["hex_ids"] = world.hex_ids(sample["ids"])
      if config.users:
        uniform = np.random.default_rng([seed, 5, day, block]).random(len(sample["label"]))
        sample["user_id"] = 1 + _bounded_zipf(uniform, np.asarray([config.users]),
                                              np.asarray([config.user_zipf]))
      yield day, sample


def generate_criteo(out_dir: str, rows: int, days: int = 1, seed: int = 0,
                    vocab: str = "table3", config: Optional[CriteoSynthConfig] = None,
                    progress: bool = True) -> dict:
  """Writes `out_dir/day_0 … day_{days-1}`, `rows` Criteo TSV lines in all (see
  `criteo_blocks`); returns a summary with the top-1% bucket share and missing-value rates."""
  config = dataclasses.replace(config or CriteoSynthConfig(), vocab=vocab)
  sizes = vocab_sizes(vocab)
  os.makedirs(out_dir, exist_ok=True)
  counts = [np.zeros(v, np.int64) for v in sizes]
  clicks = int_missing = cat_missing = 0
  user_rows = np.zeros(config.users + 1, np.int64)
  files, out, start = [], None, time.perf_counter()
  with progress_bar(total=rows, unit="row", unit_scale=True, disable=not progress,
                    desc="synth criteo") as bar:
    for day, sample in criteo_blocks(rows, days, seed, config):
      if len(files) == day:
        if out:
          out.close()
        files.append(os.path.join(out_dir, f"day_{day}"))
        out = open(files[-1], "wb")
      out.write(_criteo_text(sample))
      for j, column in enumerate(sample["ids"].T):
        seen = np.bincount(column[column >= 0], minlength=len(counts[j]))
        seen[:len(counts[j])] += counts[j]
        counts[j] = seen
      clicks += int(sample["label"].sum())
      int_missing += int(sample["int_missing"].sum())
      cat_missing += int((sample["ids"] < 0).sum())
      if config.users:
        user_rows += np.bincount(sample["user_id"], minlength=len(user_rows))
      bar.update(len(sample["label"]))
    out.close()
  seconds = time.perf_counter() - start
  share, by_feature = _top_share(counts)
  return {
      "rows": rows, "days": days, "seed": seed, "vocab": vocab, "files": files,
      "vocab_sizes": dict(zip(CATEGORICAL_FEATURES, sizes)),
      "distinct_buckets": dict(zip(CATEGORICAL_FEATURES, (int((c > 0).sum()) for c in counts))),
      "ctr": clicks / rows,
      "int_missing_share": int_missing / (rows * len(INT_MISSING_RATES)),
      "cat_missing_share": cat_missing / (rows * len(CATEGORICAL_FEATURES)),
      "top1pct_bucket_share": share,
      "top1pct_bucket_share_by_feature": dict(zip(CATEGORICAL_FEATURES, by_feature)),
      "seconds": seconds, "rows_per_second": rows / max(seconds, 1e-9),
      **({"users": config.users, "active_users": int((user_rows > 0).sum()),
          "max_rows_per_user": int(user_rows.max())} if config.users else {}),
  }


ORDERS = ("chain", "taste")


@dataclasses.dataclass(frozen=True)
class SequenceSynthConfig:
  """How users pick items (`order`):

  - "chain" (the default): users walk item chains inside a favourite cluster, so the next item
    follows from the current one (a Markov process: item-to-item statistics predict it).
  - "taste": each user's items are drawn without repetition from their taste, a mix of global
    popularity and a few favourite clusters, in random order. The whole history tells the taste
    and the last item little more than any other; no item recurs in a user's history (a
    rating log such as MovieLens). Not modelled: order in time (trends, sessions, sequels),
    ratings, tastes beyond cluster membership.
  """
  mean_length: float = 12.0  # mean actions per user (at least 3: train, valid and test item)
  max_length: int = 200
  cluster_size: int = 40  # items per cluster
  follow_chain: float = 0.55  # chain: P(next item = the chain successor of the current one)
  stay_in_cluster: float = 0.30  # chain: P(a popular item of the user's cluster); else global
  zipf: float = 1.1  # popularity exponent of clusters, of items in a cluster and of all items
  order: str = "chain"
  taste_clusters: int = 4  # taste: favourite clusters per user (Zipf over clusters)
  taste_share: float = 0.6  # taste: P(a draw from the favourite clusters); else global

  def __post_init__(self):
    if self.order not in ORDERS:
      raise DprecError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
    if self.taste_clusters < 1 or not 0 <= self.taste_share < 1:
      raise DprecError(f"taste needs clusters >= 1 and a share in [0, 1), got "
                       f"{self.taste_clusters} and {self.taste_share}")


def generate_sequences(out_file: str, users: int, items: int, seed: int = 0,
                       config: Optional[SequenceSynthConfig] = None, progress: bool = True) -> dict:
  """Writes SASRec-style `user item` lines (1-based ids, each user's lines consecutive and in
  time order) with long-tailed item popularity, each user's items drawn as `config.order`
  says; returns a summary."""
  config = config or SequenceSynthConfig()
  if users < 1 or items < 2:
    raise DprecError(f"need users >= 1 and items >= 2, got users={users}, items={items}")
  if config.mean_length < 3:
    raise DprecError(f"mean_length must be at least 3, got {config.mean_length}")
  rng = np.random.default_rng([seed, 10])
  by_popularity = rng.permutation(items) + 1  # item id of each global popularity rank
  clusters = max(1, items // config.cluster_size)
  cluster = rng.integers(0, clusters, items)  # by popularity rank
  members = np.lexsort((np.arange(items), cluster))  # ranks grouped by cluster, popular first
  sizes = np.bincount(cluster, minlength=clusters)
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  if config.order == "chain":
    chain = np.lexsort((rng.random(items), cluster))  # a random cycle through each cluster
    successor = np.empty(items + 1, np.int64)
    following = np.where(np.arange(items) + 1 < offsets[cluster[chain]] + sizes[cluster[chain]],
                         np.roll(chain, -1), chain[offsets[cluster[chain]]])
    successor[by_popularity[chain]] = by_popularity[following]
    draw = lambda block_rng, lengths: _chain_block(
        block_rng, lengths, config, clusters, sizes, offsets, members, by_popularity, successor)
  else:
    tastes = _cluster_tastes(config, items, clusters, cluster, members, offsets)
    draw = lambda block_rng, lengths: _taste_block(block_rng, lengths, config, clusters, tastes,
                                                   by_popularity)
  counts = np.zeros(items + 1, np.int64)
  start = time.perf_counter()
  with open(out_file, "wb") as out, progress_bar(total=users, unit="user", unit_scale=True,
                                                disable=not progress,
                                                desc="synth sequences") as bar:
    for block, first in enumerate(range(0, users, BLOCK_ROWS)):
      size = min(BLOCK_ROWS, users - first)
      block_rng = np.random.default_rng([seed, 11, block])
      lengths = np.minimum(config.max_length, 3 + np.floor(block_rng.exponential(
          config.mean_length - 3, size)).astype(np.int64))
      if config.order == "taste":
        lengths = np.minimum(lengths, items)
      sequence = draw(block_rng, lengths)
      present = np.arange(sequence.shape[1]) < lengths[:, None]
      user_ids = np.broadcast_to(np.arange(first + 1, first + size + 1)[:, None], sequence.shape)
      pairs = np.stack([user_ids[present], sequence[present]], axis=1)
      out.write(_join_fields([_int_text(pairs)], _SPACE))
      counts += np.bincount(sequence[present], minlength=items + 1)
      bar.update(size)
  seconds = time.perf_counter() - start
  share, _ = _top_share([counts[1:]])
  return {"file": out_file, "users": users, "items": items, "seed": seed,
          "actions": int(counts.sum()), "mean_length": float(counts.sum() / users),
          "distinct_items": int((counts[1:] > 0).sum()), "top1pct_item_share": share,
          "seconds": seconds}


def _chain_block(rng, lengths, config, clusters, sizes, offsets, members, by_popularity,
                 successor):
  """[users, max length] item ids: each step the chain successor of the previous item
  (`follow_chain`), a popular item of the user's favourite cluster (`stay_in_cluster`) or a
  globally popular one."""
  size = len(lengths)
  exponent = np.asarray([config.zipf])
  favourite = _bounded_zipf(rng.random(size), np.asarray([clusters]), exponent)
  sequence = np.zeros((size, lengths.max()), np.int64)
  for step in range(sequence.shape[1]):
    in_cluster = _bounded_zipf(rng.random(size), sizes[favourite], exponent)
    choice = by_popularity[members[offsets[favourite] + in_cluster]]
    anywhere = by_popularity[_bounded_zipf(rng.random(size), np.asarray([len(members)]),
                                           exponent)]
    move = rng.random(size)
    if step:
      choice = np.where(move < config.follow_chain, successor[sequence[:, step - 1]], choice)
    sequence[:, step] = np.where(move >= config.follow_chain + config.stay_in_cluster,
                                 anywhere, choice)
  return sequence


def _cluster_tastes(config, items, clusters, cluster, members, offsets):
  """[clusters + 1, items] by popularity rank: row c < clusters the Zipf distribution over
  cluster c's items (its most popular first), the last row the Zipf distribution over all."""
  tastes = np.zeros((clusters + 1, items))
  within = np.arange(items) - offsets[cluster[members]]  # rank inside its cluster
  tastes[cluster[members], members] = (within + 1.0) ** -config.zipf
  tastes[clusters] = (np.arange(items) + 1.0) ** -config.zipf
  return tastes / tastes.sum(axis=1, keepdims=True)


def _taste_block(rng, lengths, config, clusters, tastes, by_popularity, chunk=1024):
  """[users, max length] item ids: each user's `lengths` items drawn without replacement
  (Gumbel top-k: successive draws proportional to the weights) from (1 − `taste_share`)·global
  popularity + `taste_share`·the mean of `taste_clusters` favourite clusters (Zipf over
  clusters, with repetition), then put in random order."""
  size = len(lengths)
  exponent = np.asarray([config.zipf])
  favourites = _bounded_zipf(rng.random((size, config.taste_clusters)), np.asarray([clusters]),
                             exponent)
  sequence = np.zeros((size, lengths.max()), np.int64)
  for first in range(0, size, chunk):
    rows = slice(first, min(size, first + chunk))
    taste = tastes[favourites[rows]].mean(axis=1)
    weights = (1 - config.taste_share) * tastes[clusters] + config.taste_share * taste
    with np.errstate(divide="ignore"):
      keys = np.log(weights) + rng.gumbel(size=weights.shape)
    drawn = np.argsort(-keys, axis=1)[:, :sequence.shape[1]]
    present = np.arange(sequence.shape[1]) < lengths[rows, None]
    shuffled = np.argsort(np.where(present, rng.random(drawn.shape), 2.0), axis=1)
    sequence[rows] = np.where(present, by_popularity[np.take_along_axis(drawn, shuffled, 1)], 0)
  return sequence
