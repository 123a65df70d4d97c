"""Stacked tables (`DPMultiEmbedding(stack_tables=...)`): tables of one width (or padded to a
multiple of a width) in one variable give the same model and, with the same key, the same DP
step as one variable per table."""
import numpy as np
import pytest

from dprec.models import ctr
from dprec.optimizers import (AdamBC, DPAdaFEST, DPFEST, DPSGD, DPOptimizer, LazyAdam,
                              SparseAdagrad, SparseSGD)

# Widths interleave (3, 2, 3, 2, 4), so stacking reorders the tables: exact stacking makes two
# stacks of two tables and one of a single table; a multiple of 4 one stack of width 4 whose
# tables of widths 2 and 3 end in padding.
VOCABS = (7, 5, 9, 4, 6)
DIMS = (3, 2, 3, 2, 4)
NAMES = ("t0", "t1", "t2", "t3", "t4")
CONFIGS = {
    "dp_sgd": lambda: DPSGD(0.5, 0.7),
    "dp_fest": lambda: DPFEST(0.5, 0.7, selected_rows={"t0": [0, 2, 5], "t2": [1, 8],
                                                       "t3": [0, 1, 2, 3], "t4": [4]}),
    "dp_adafest": lambda: DPAdaFEST(0.5, 0.7, contribution_clip=1.0,
                                    contribution_noise_multiplier=0.6, threshold=0.8),
}
OPTIMIZERS = {
    "sgd": lambda: SparseSGD(0.2),
    "adagrad": lambda: SparseAdagrad(0.2),
    "lazy_adam": lambda: LazyAdam(0.05),
    "adambc": lambda: AdamBC(0.05),
}


def _model(stacked=False):
  return ctr.build_ctr_model(VOCABS, table_names=NAMES, embedding_dims=DIMS, hidden_units=(6,),
                             num_integer_features=2, auc_thresholds=10, stack_tables=stacked)


def _batch(n=9, seed=0):
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, v, n) for v in VOCABS], axis=1)
  ids[:3, 0] = 2  # a row several examples share
  return ({ctr.CAT_FEATURES: ids.astype(np.int32),
           ctr.INT_FEATURES: rng.normal(size=(n, 2)).astype(np.float32)},
          (rng.random(n) < 0.4).astype(np.float32))


def _copy_weights(source, target):
  for name in NAMES:
    rows = source.embedding.table_embeddings(name)
    for stack in target.embedding.tables:
      if name in stack.table_names:
        start = stack.row_offsets[stack.table_names.index(name)]
        stack.embeddings[start:start + rows.shape[0], :rows.shape[1]].assign(rows)
  dense = lambda m: [v for v in m.trainable_variables if "embedding" not in v.name]
  for want, got in zip(dense(source), dense(target)):
    got.assign(want)


def _trained(model, config, optimizer, batch):
  model.compile(DPOptimizer(config, optimizer, expected_batch_size=9.0, insecure_noise_seed=3))
  for _ in range(2):  # eagerly: small shapes trace slower than they run
    model.train_step(batch)
  return model


@pytest.mark.parametrize("stack, widths, tables", [
    (True, [2, 3, 4], [["t1", "t3"], ["t0", "t2"], ["t4"]]),
    (4, [4], [["t1", "t3", "t0", "t2", "t4"]])], ids=["exact", "multiple_4"])
def test_stacked_model_outputs_and_layout(stack, widths, tables):
  plain, stacked = _model(), _model(stack)
  assert [t.output_dim for t in stacked.dp_tables] == widths
  assert [t.table_names for t in stacked.dp_tables] == tables
  assert [t.table_name for t in plain.dp_step_tables] == ["t1", "t3", "t0", "t2", "t4"]
  assert stacked.dense_embedding_size == plain.dense_embedding_size
  _copy_weights(plain, stacked)
  x, _ = _batch()
  np.testing.assert_allclose(stacked(x), plain(x), rtol=1e-6, atol=1e-6)
  for name in NAMES:
    np.testing.assert_array_equal(stacked.embedding.table_embeddings(name),
                                  plain.embedding.table_embeddings(name))


# Every algorithm and optimizer with padded stacks; exact stacks with SGD.
CASES = ([(a, o, 4) for a in sorted(CONFIGS) for o in sorted(OPTIMIZERS)]
         + [(a, "sgd", True) for a in sorted(CONFIGS)])


@pytest.mark.parametrize("algorithm, optimizer, stack", CASES)
def test_stacked_dp_step_equals_unstacked(algorithm, optimizer, stack):
  batch = _batch()
  plain = _model()
  stacked = _model(stack)
  _copy_weights(plain, stacked)
  before = {name: plain.embedding.table_embeddings(name).numpy() for name in NAMES}
  padding = {table.name: table.embeddings.numpy() for table in stacked.dp_tables}
  plain = _trained(plain, CONFIGS[algorithm](), OPTIMIZERS[optimizer](), batch)
  stacked = _trained(stacked, CONFIGS[algorithm](), OPTIMIZERS[optimizer](), batch)
  moved = 0
  for name in NAMES:
    want = plain.embedding.table_embeddings(name).numpy()
    np.testing.assert_allclose(stacked.embedding.table_embeddings(name), want,
                               rtol=1e-6, atol=1e-6, err_msg=name)
    moved += int(np.sum(np.any(want != before[name], axis=1)))
  assert moved > 0  # the step updated some rows: the comparison is not of untouched tables
  for table in stacked.dp_tables:  # padding columns are never written
    for name, rows, width in table.sub_tables:
      start = table.row_offsets[table.table_names.index(name)]
      initial = padding[table.name][start:start + rows, width:]
      np.testing.assert_array_equal(table.embeddings.numpy()[start:start + rows, width:],
                                    initial)
  dense = lambda m: [v.numpy() for v in m.trainable_variables if "embedding" not in v.name]
  for got, want in zip(dense(stacked), dense(plain)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert (stacked.gradient_size_tracker.result().numpy()
          == pytest.approx(plain.gradient_size_tracker.result().numpy()))
