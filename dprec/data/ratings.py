"""Synthetic explicit ratings shaped like MovieLens 100K (the TFRS ranking tutorial's data).

No public ratings data is reachable on the project machine, so the ranking benchmark of
`dprec.make_private` trains on ratings drawn from a latent-factor model with the marginals of
MovieLens 100K: 943 users, 1,682 items, 100,000 ratings on a 1–5 scale with mean ≈ 3.5 and
standard deviation ≈ 1.1, Zipf-like item popularity (a few items with hundreds of ratings, a
long tail with one or two), heavy-tailed user activity (at least `min_per_user` each), and
popular items rated higher. A rating is round(μ + b_u + b_i + ⟨p_u, q_i⟩ + noise) clipped to
1–5, so a model that learns the biases and factors beats the global mean, by about as much as on
MovieLens (RMSE ≈ 1.13 → ≈ 0.95). Deterministic by seed.
"""
from typing import Dict, Tuple

import numpy as np

RATING_RANGE = (1.0, 5.0)


def synthetic_ratings(num_users: int = 943, num_items: int = 1682, num_ratings: int = 100_000,
                      rank: int = 8, item_zipf: float = 1.1, min_per_user: int = 20,
                      noise: float = 0.85, seed: int = 0) -> Dict[str, np.ndarray]:
  """{"user_id": int32 [n], "item_id": int32 [n], "rating": float32 [n]}, ids from 0, no pair
  rated twice; n is `num_ratings` (fewer if the pairs run out)."""
  rng = np.random.default_rng(seed)
  popularity = 1.0 / np.arange(1, num_items + 1) ** item_zipf
  popularity = popularity[rng.permutation(num_items)]
  popularity /= popularity.sum()
  activity = rng.lognormal(0.0, 1.0, num_users)
  extra = num_ratings - min_per_user * num_users
  per_user = min_per_user + np.floor(activity / activity.sum() * max(extra, 0)).astype(int)
  per_user = np.minimum(per_user, num_items // 2)
  users, items = [], []
  for user, count in enumerate(per_user):
    chosen = rng.choice(num_items, size=count, replace=False, p=popularity)
    users.append(np.full(count, user))
    items.append(chosen)
  users, items = np.concatenate(users), np.concatenate(items)
  user_bias = rng.normal(0.0, 0.45, num_users)
  # Popular items are rated higher (as on MovieLens), plus their own spread.
  item_bias = 0.25 * (np.log(popularity) - np.log(popularity).mean()) / np.log(popularity).std()
  item_bias += rng.normal(0.0, 0.4, num_items)
  user_factors = rng.normal(0.0, 0.35, (num_users, rank))
  item_factors = rng.normal(0.0, 0.35, (num_items, rank))
  score = (3.2 + user_bias[users] + item_bias[items]
           + np.einsum("nk,nk->n", user_factors[users], item_factors[items])
           + rng.normal(0.0, noise, users.size))
  ratings = np.clip(np.round(score), *RATING_RANGE)
  order = rng.permutation(users.size)
  return {"user_id": users[order].astype(np.int32), "item_id": items[order].astype(np.int32),
          "rating": ratings[order].astype(np.float32)}


def split(data: Dict[str, np.ndarray], fractions: Tuple[float, ...] = (0.8, 0.2),
          seed: int = 0) -> Tuple[Dict[str, np.ndarray], ...]:
  """A random split of the rows into parts of the given fractions (the tutorial's 80/20)."""
  n = len(next(iter(data.values())))
  order = np.random.default_rng(seed).permutation(n)
  bounds = np.round(np.cumsum((0.0,) + tuple(fractions)) * n).astype(int)
  return tuple({key: values[order[lo:hi]] for key, values in data.items()}
               for lo, hi in zip(bounds[:-1], bounds[1:]))
