"""The pCTR model matches Ghazi et al., "Sparsity-Preserving Differentially Private Training of
Large Embedding Models", arXiv:2311.08357, App. D.1.1 and trains through every DP configuration."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.models import ctr
from dprec.optimizers import config as config_lib
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import SparseSGD
from dprec.training import output_layer

# Ghazi et al. 2023: Table 3 vocabularies (C1..C26 order) and the dims int(2·V^0.25) it derives.
TABLE3 = [1472, 577, 82741, 18940, 305, 23, 1172, 633, 3, 9090, 5918, 64300, 3207, 27, 1550,
          44262, 10, 5485, 2161, 3, 56473, 17, 15, 27360, 104, 12934]
NOTE_DIMS = [12, 9, 33, 23, 8, 4, 11, 10, 2, 19, 17, 31, 15, 4, 12, 29, 3, 17, 13, 2, 30, 4, 3,
             25, 6, 21]


def _batch(config, n, seed=0):
  rng = np.random.default_rng(seed)
  cat = np.stack([rng.integers(0, v, n) for v in config.vocab_sizes], axis=1).astype(np.int32)
  ints = rng.exponential(1.0, (n, config.num_integer_features)).astype(np.float32)
  labels = (rng.random(n) < 0.3).astype(np.int32)
  return {ctr.CAT_FEATURES: cat, ctr.INT_FEATURES: ints}, labels


def test_table3_model_has_the_papers_shapes():
  config = ctr.CTRConfig(vocab_sizes=tuple(v + 1 for v in TABLE3))  # + the OOV row 0
  assert list(config.embedding_dims) == NOTE_DIMS and sum(NOTE_DIMS) == 363
  model = ctr.build_ctr_model(config.vocab_sizes)
  tables = model.dp_tables
  assert [t.vocab_size for t in tables] == [v + 1 for v in TABLE3]
  assert [t.output_dim for t in tables] == NOTE_DIMS
  assert model.dense_embedding_size == 9599632 + sum(NOTE_DIMS)  # note's count + OOV rows
  assert [layer.units for layer in model.hidden] == [598] * 4
  assert model.hidden[0].kernel.shape == (363 + 13, 598) and model.logit.kernel.shape == (598, 1)
  dense = sum(int(np.prod(v.shape)) for v in model.trainable_variables
              if all(v is not t.embeddings for t in tables))
  assert dense == 1300651  # Ghazi et al. 2023: 376→598→598→598→598→1


def test_embedding_dim_formula_and_validation():
  assert [ctr.embedding_dim(v) for v in (1, 3, 16, 10 ** 4, 10 ** 7)] == [2, 2, 4, 20, 112]
  with pytest.raises(ValueError):
    ctr.CTRConfig(vocab_sizes=())
  with pytest.raises(ValueError):
    ctr.CTRConfig(vocab_sizes=(5, 6), table_names=("a",))


def test_loss_is_binary_cross_entropy_of_the_logit():
  model = ctr.build_ctr_model((7, 9, 4), hidden_units=(8, 8))
  model.compile(optimizer=SparseSGD(0.1))
  features, labels = _batch(model.config, 32)
  logits = model(features).numpy()[:, 0].astype(np.float64)
  probability = 1 / (1 + np.exp(-logits))
  expected = -(labels * np.log(probability) + (1 - labels) * np.log(1 - probability))
  per_example = model.per_example_loss(labels, model(features)).numpy()
  np.testing.assert_allclose(per_example, expected, rtol=1e-5)
  mean = model.compute_loss(features, labels, model(features)).numpy()
  np.testing.assert_allclose(mean, expected.mean(), rtol=1e-5)


def test_folding_an_affine_map_into_the_logit_layer_makes_every_logit_scale_z_plus_shift():
  model = ctr.build_ctr_model((7, 9, 4), hidden_units=(8,))
  features, _ = _batch(model.config, 16)
  before = model(features).numpy()
  output_layer.fold_affine(model.logit, 0.4, 1.5)  # what `train ctr`'s recalibration does
  np.testing.assert_allclose(model(features).numpy(), 0.4 * before + 1.5, rtol=1e-5, atol=1e-6)


def test_dp_step_without_noise_or_clipping_is_the_non_private_step():
  """Every variable of the model (embeddings, hidden layers, logit) gets a per-example norm
  and, with σ = 0 and C = ∞, the DP-AdaFEST update equals the plain one (τ = 0.5 keeps every
  touched row)."""
  dp_config = config_lib.DPAdaFEST(
      l2_norm_clip=float("inf"), noise_multiplier=0.0, contribution_clip=float("inf"),
      contribution_noise_multiplier=0.0, threshold=0.5)
  features, labels = _batch(ctr.CTRConfig(vocab_sizes=(11, 5, 30)), 48, seed=1)
  weights = {}
  for name, algorithm in (("plain", config_lib.NonPrivate()), ("dp", dp_config)):
    tf.keras.utils.set_random_seed(3)
    model = ctr.build_ctr_model((11, 5, 30), hidden_units=(16, 16))
    model.compile(optimizer=DPOptimizer(algorithm, SparseSGD(0.5), expected_batch_size=48))
    model.fit(features, labels, batch_size=48, epochs=1, shuffle=False, verbose=0)
    weights[name] = model.get_weights()
  for plain, private in zip(weights["plain"], weights["dp"]):
    np.testing.assert_allclose(private, plain, rtol=1e-4, atol=1e-6)


def test_fit_logs_auc_loss_and_gradient_size():
  model = ctr.build_ctr_model((50, 20), hidden_units=(8,))
  model.compile(optimizer=DPOptimizer(
      config_lib.DPAdaFEST(l2_norm_clip=1.0, noise_multiplier=0.5, contribution_clip=1.0,
                           contribution_noise_multiplier=2.0, threshold=4.0),
      SparseSGD(0.1), expected_batch_size=32))
  features, labels = _batch(model.config, 64, seed=2)
  history = model.fit(features, labels, batch_size=32, epochs=1, verbose=0).history
  assert {"loss", "auc", "gradient_size", "gradient_size_reduction"} <= set(history)
  evaluation = model.evaluate(features, labels, verbose=0, return_dict=True)
  assert 0.0 <= evaluation["auc"] <= 1.0 and evaluation["loss"] > 0
