"""The DP step under MirroredStrategy with 2 replicas equals the one-device step on the same
global batch, and adds one noise draw (σ·C), not one per replica."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.training import poisson

VOCABS = (1000, 500)  # for the noise test: ~4500 untouched coordinates


@pytest.mark.parametrize("algorithm, rows_kept", [
    ("dp_sgd", "all"), ("dp_adafest", "some"), ("dp_adafest_none_kept", "none")])
def test_mirrored_step_equals_one_device_step(steps, mirrored, algorithm, rows_kept):
  assert mirrored.num_replicas_in_sync == 2
  before = [w.numpy() for w in steps.build_model(steps.CONFIGS[algorithm]).trainable_weights]
  single = steps.one_step(algorithm)
  replicated = steps.one_step(algorithm, mirrored)
  for got, want in zip(replicated, single):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for want, start in zip(single[2:], before[2:]):  # dense variables
    assert not np.array_equal(want, start)
  # Embedding tables (the first two weights): the same rows updated (DP-AdaFEST: kept rows, false
  # positives included): every one (DP-SGD), some, or none.
  kept = []
  for got, want, start in zip(replicated[:2], single[:2], before[:2]):
    kept.append(np.any(want != start, axis=1))
    np.testing.assert_array_equal(np.any(got != start, axis=1), kept[-1])
  kept = np.concatenate(kept)
  assert {"all": kept.all(), "some": kept.any() and not kept.all(),
          "none": not kept.any()}[rows_kept]


def test_noise_is_drawn_once_over_the_global_sum(steps, mirrored):
  """σ·C per coordinate of the summed gradient (lr 1, normaliser 1): one draw for the global sum,
  not one per replica (√2 times as large)."""
  config = steps.CONFIGS["dp_sgd"]
  with mirrored.scope():
    model = steps.build_model(config, lr=1.0, expected_batch_size=1.0, vocabs=VOCABS)
  features, labels = steps.data()
  start = [w.numpy() for w in model.trainable_weights]
  model.fit(tf.keras.utils.experimental.DatasetCreator(poisson.replica_dataset_fn(
      features, labels, poisson.BatchSampling(steps.BATCH, entropy=7), 1)),
            steps_per_epoch=1, verbose=0)
  # Rows no example touches moved by noise alone: −σ·C·N(0, 1) per coordinate.
  noise = []
  for f, (after, before) in enumerate(zip(model.trainable_weights[:2], start[:2])):
    untouched = np.setdiff1d(np.arange(VOCABS[f]), features["cat"][:, f])
    noise.append((after.numpy() - before)[untouched].ravel())
  noise = np.concatenate(noise)
  assert noise.size > 4000
  expected = config.noise_multiplier * config.l2_norm_clip
  # 4.5 standard errors of the sample std (σ/√(2n)); √2·σC lies ~20 of them away.
  assert np.std(noise) == pytest.approx(expected, abs=4.5 * expected / np.sqrt(2 * noise.size))


def test_replica_shards_make_up_the_global_batch(steps):
  features, labels = steps.data()
  sampling = poisson.BatchSampling(steps.BATCH, entropy=3)
  whole = [x["cat"] for x, _ in poisson.sampled_dataset(features, labels, sampling, 3)]
  shards = [[x["cat"] for x, _ in poisson.sampled_dataset(features, labels, sampling, 3,
                                                          shards=(r, 1, 2))] for r in range(2)]
  both = list(poisson.sampled_dataset(features, labels, sampling, 3, shards=(0, 2, 2)))
  for step, batch in enumerate(whole):
    np.testing.assert_array_equal(np.concatenate([shards[0][step], shards[1][step]]), batch)
    assert abs(len(shards[0][step]) - len(shards[1][step])) <= 1
    np.testing.assert_array_equal(both[2 * step][0]["cat"], shards[0][step])
