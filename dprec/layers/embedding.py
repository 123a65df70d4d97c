"""DP-aware embedding tables for single- and multi-valued categorical features.

A `DPEmbedding` is an ordinary row lookup (gather) whose forward pass also reports, to the DP
training step, which rows each example touched and the gathered rows themselves. From those the
step builds the DP-AdaFEST contribution maps (Ghazi et al., "Sparsity-Preserving Differentially
Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1 line 5), the per-example
gradient norm restricted to kept rows (line 8, ghost norm of Li et al., "Large Language Models Can
Be Strong Differentially Private Learners", arXiv:2110.05679, §4.2 aggregated per (example, row))
and the clipped embedding gradient as `tf.IndexedSlices` over kept rows only. Outside a DP step the
layer is a plain embedding.
"""
import collections

import numpy as np
import tensorflow as tf

# One call of a DPEmbedding inside a DP step: local row ids [n, L] (pads replaced by row 0),
# `valid` [n, L] (False at pads) and the gathered rows [n, L, d] whose gradients the step reads;
# `distinct_columns`: no two columns can hold the same row (columns of different stacked tables).
Lookup = collections.namedtuple("Lookup", ["ids", "valid", "rows", "distinct_columns"],
                                defaults=[False])

COMBINERS = (None, "sum", "mean")


@tf.keras.utils.register_keras_serializable(package="dprec")
class DPEmbedding(tf.keras.layers.Layer):
  """An embedding table of `vocab_size` rows × `output_dim` trained with sparse DP updates.

  Inputs: int ids of shape [n] or [n, 1] (single-valued, output [n, d]); [n, L] padded with
  `pad_id`, or a `tf.RaggedTensor` [n, None] (multi-valued: output [n, d] combined by `combiner`
  "sum" or "mean", or [n, L, d] with `combiner=None`, pads giving zero vectors).

  `table_name` (default: the layer name) identifies the table in DP-FEST row sets and in the
  global row-id space the DP step lays out over all tables of a model.
  """

  def __init__(self, vocab_size, output_dim, combiner="sum", pad_id=-1,
               embeddings_initializer="uniform", table_name=None, **kwargs):
    super().__init__(**kwargs)
    if int(vocab_size) < 1 or int(output_dim) < 1:
      raise ValueError(f"vocab_size and output_dim must be >= 1, got {vocab_size}, {output_dim}")
    if combiner not in COMBINERS:
      raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    self.vocab_size = int(vocab_size)
    self.output_dim = int(output_dim)
    self.combiner = combiner
    self.pad_id = int(pad_id)
    self.embeddings_initializer = tf.keras.initializers.get(embeddings_initializer)
    self.table_name = table_name or self.name
    # A list while a DP step records this layer's lookups; set without Keras attribute tracking.
    object.__setattr__(self, "_recording", None)

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        name="embeddings", shape=(self.vocab_size, self.output_dim),
        initializer=self.embeddings_initializer, trainable=True)
    super().build(input_shape)

  @property
  def sub_tables(self):
    """(table name, rows, width) of the tables this layer's variable holds, in row order."""
    return [(self.table_name, self.vocab_size, self.output_dim)]

  padded = False  # a `DPStackedEmbedding` may hold tables narrower than its variable
  _ids_only = False  # recording ids alone (`start_recording`)

  def start_recording(self, ids_only=False):
    """Records this layer's lookups until `stop_recording`. `ids_only`: the ids alone are wanted
    (lazy noise's look ahead): the rows are not gathered (`_gather`)."""
    object.__setattr__(self, "_recording", [])
    object.__setattr__(self, "_ids_only", bool(ids_only))

  def stop_recording(self):
    lookups = self._recording or []
    object.__setattr__(self, "_recording", None)
    object.__setattr__(self, "_ids_only", False)
    return lookups

  def _gather(self, safe_ids):
    """The rows of `safe_ids` [n, L] ([n, L, d]); while recording ids alone, zeros of their shape
    instead: stateless, so a pass whose output nobody uses is pruned, where the table read (a
    stateful op) would run."""
    if self._ids_only:
      shape = tf.concat([tf.shape(safe_ids), [self.output_dim]], 0)
      return tf.ensure_shape(tf.zeros(shape, self.embeddings.dtype),
                             safe_ids.shape.concatenate([self.output_dim]))
    # A gather, also of a table sharded by rows (`dprec.distribute.parameter_server`), where
    # tf.gather returns the rows grouped by shard instead of in the order of the ids (TF 2.21).
    return tf.nn.embedding_lookup(self.embeddings, safe_ids)

  def call(self, inputs):
    if isinstance(inputs, tf.RaggedTensor):
      inputs = inputs.to_tensor(default_value=self.pad_id)
    ids = tf.cast(inputs, tf.int64)
    single = ids.shape.rank == 1
    if single:
      ids = ids[:, tf.newaxis]
    valid = tf.not_equal(ids, self.pad_id)
    safe_ids = tf.where(valid, ids, tf.zeros_like(ids))
    rows = self._gather(safe_ids)  # [n, L, d]
    if self._recording is not None:
      self._recording.append(Lookup(safe_ids, valid, rows))
    mask = tf.cast(valid, rows.dtype)[..., tf.newaxis]
    if single:
      return rows[:, 0, :]
    if self.combiner is None:
      return rows * mask
    total = tf.reduce_sum(rows * mask, axis=1)
    if self.combiner == "mean":
      total /= tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)
    return total

  def get_config(self):
    config = super().get_config()
    config.update(vocab_size=self.vocab_size, output_dim=self.output_dim, combiner=self.combiner,
                  pad_id=self.pad_id, table_name=self.table_name,
                  embeddings_initializer=tf.keras.initializers.serialize(
                      self.embeddings_initializer))
    return config


@tf.keras.utils.register_keras_serializable(package="dprec")
class DPStackedEmbedding(DPEmbedding):
  """Single-valued tables of widths ≤ `output_dim` stacked in one variable of that width (table
  f's local row r at row `row_offsets[f]` + r, its columns the first `table_dims[f]`; the others
  are padding, never read, with zero gradient, noise and update), as TPUEmbedding stacks tables:
  the DP step's per-table work (pairs, kept rows, noise, sparse update, optimizer slots) runs
  once for all of them. Inputs: int local ids [n, F], column f for table f; output [n, F, d]
  (padding columns included). Made by `DPMultiEmbedding(stack_tables=...)`; `table_names` keep
  naming the tables (DP-FEST sets)."""

  def __init__(self, vocab_sizes, table_dims, table_names, output_dim=None, pad_id=-1,
               **kwargs):
    for key in ("vocab_size", "combiner", "table_name"):
      kwargs.pop(key, None)
    self.table_vocab_sizes = [int(v) for v in vocab_sizes]
    self.table_dims = [int(d) for d in table_dims]
    self.table_names = list(table_names)
    if not len(self.table_names) == len(self.table_vocab_sizes) == len(self.table_dims):
      raise ValueError("give one vocabulary size, width and name per stacked table")
    output_dim = max(self.table_dims) if output_dim is None else int(output_dim)
    if max(self.table_dims) > output_dim:
      raise ValueError(f"tables of widths {self.table_dims} do not fit a stack of {output_dim}")
    super().__init__(sum(self.table_vocab_sizes), output_dim, combiner=None, pad_id=pad_id,
                     **kwargs)
    self.row_offsets = np.concatenate(
        [[0], np.cumsum(self.table_vocab_sizes)[:-1]]).astype(np.int64)

  @property
  def sub_tables(self):
    return list(zip(self.table_names, self.table_vocab_sizes, self.table_dims))

  @property
  def padded(self):
    """Whether some table is narrower than the stack (its rows end in padding columns)."""
    return min(self.table_dims) < self.output_dim

  def call(self, inputs):
    ids = tf.cast(inputs, tf.int64)
    valid = tf.not_equal(ids, self.pad_id)
    # A pad looks up its own table's row 0, as an unstacked single-valued table does.
    safe_ids = tf.where(valid, ids, tf.zeros_like(ids)) + self.row_offsets
    rows = self._gather(safe_ids)  # [n, F, d]
    if self._recording is not None:
      self._recording.append(Lookup(safe_ids, valid, rows, distinct_columns=True))
    return rows

  def table_rows(self, name):
    """The rows of the stacked table `name` (a tensor of its vocabulary × width)."""
    f = self.table_names.index(name)
    start = self.row_offsets[f]
    return tf.convert_to_tensor(self.embeddings)[start:start + self.table_vocab_sizes[f],
                                                 :self.table_dims[f]]

  def get_config(self):
    config = super().get_config()
    for key in ("vocab_size", "combiner", "table_name"):
      config.pop(key)
    config.update(vocab_sizes=self.table_vocab_sizes, table_dims=self.table_dims,
                  table_names=self.table_names)
    return config


def stack_width(dim, multiple):
  """The width of the stack holding a table of width `dim`: `dim` rounded up to `multiple`."""
  return -(-int(dim) // int(multiple)) * int(multiple)


@tf.keras.utils.register_keras_serializable(package="dprec")
class DPMultiEmbedding(tf.keras.layers.Layer):
  """One single-valued `DPEmbedding` per column of an int [n, F] input, outputs concatenated.

  The pCTR model of Ghazi et al. 2023, App. D.1.1 uses one table per categorical feature; the DP
  step lays the F tables out in one global row-id space so a single contribution map is clipped
  jointly across all of them (Algorithm 1, Fig. 2).

  `stack_tables`: False (one variable per table), True (the tables of each width in one
  `DPStackedEmbedding`) or an int m (tables whose widths round up to the same multiple of m in
  one stack of that width, e.g. m = 8 puts Table 3's 20 widths in 5 stacks for 14% more
  stored parameters, all padding). Stacks are ordered by width, tables within a stack by width
  then column, which is the order in which `DPModel.dp_step_tables` lays out unstacked tables:
  the outputs are the same, and so is a DP step with the same key.
  """

  def __init__(self, vocab_sizes, output_dims, table_names=None,
               embeddings_initializer="uniform", stack_tables=False, **kwargs):
    super().__init__(**kwargs)
    if len(vocab_sizes) != len(output_dims):
      raise ValueError("vocab_sizes and output_dims must have the same length")
    table_names = list(table_names or [f"{self.name}_{i}" for i in range(len(vocab_sizes))])
    if len(table_names) != len(vocab_sizes) or len(set(table_names)) != len(table_names):
      raise ValueError("table_names must be unique, one per table")
    if stack_tables is not False and (isinstance(stack_tables, float) or int(stack_tables) < 1):
      raise ValueError(f"stack_tables must be False, True or a width multiple >= 1, got "
                       f"{stack_tables!r}")
    self.vocab_sizes = [int(v) for v in vocab_sizes]
    self.output_dims = [int(d) for d in output_dims]
    self.table_names = table_names
    self.embeddings_initializer = embeddings_initializer
    self.stack_tables = stack_tables if isinstance(stack_tables, bool) else int(stack_tables)
    if self.stack_tables is False:
      self.tables = [
          DPEmbedding(v, d, embeddings_initializer=embeddings_initializer, table_name=t,
                      name=f"{self.name}_{t}")
          for v, d, t in zip(self.vocab_sizes, self.output_dims, table_names)]
      return
    widths = [stack_width(d, self.stack_tables) for d in self.output_dims]
    self._stack_columns = [
        sorted((f for f, w in enumerate(widths) if w == width), key=lambda f: self.output_dims[f])
        for width in sorted(set(widths))]
    self.tables = [
        DPStackedEmbedding([self.vocab_sizes[f] for f in columns],
                           [self.output_dims[f] for f in columns],
                           [table_names[f] for f in columns], output_dim=widths[columns[0]],
                           embeddings_initializer=embeddings_initializer,
                           name=f"{self.name}_stack_{widths[columns[0]]}")
        for columns in self._stack_columns]

  def call(self, inputs):
    if self.stack_tables is False:
      columns = tf.unstack(inputs, num=len(self.tables), axis=1)
      return tf.concat([table(column) for table, column in zip(self.tables, columns)], axis=1)
    # Each table's output is its stack's column for it without padding, all in column order
    # (unstack and slices: cheaper to differentiate than one gather along axis 1).
    outputs = {}
    for stack, columns in zip(self.tables, self._stack_columns):
      rows = tf.unstack(stack(tf.gather(inputs, columns, axis=1)), num=len(columns), axis=1)
      for f, row in zip(columns, rows):
        width = self.output_dims[f]
        outputs[f] = row if width == stack.output_dim else row[:, :width]
    return tf.concat([outputs[f] for f in range(len(self.output_dims))], axis=1)

  def table_embeddings(self, name):
    """The embedding matrix (vocabulary × width) of the table `name`, stacked or not."""
    for table in self.tables:
      if isinstance(table, DPStackedEmbedding):
        if name in table.table_names:
          return table.table_rows(name)
      elif table.table_name == name:
        return tf.convert_to_tensor(table.embeddings)
    raise KeyError(f"no table {name!r}; the tables are {self.table_names}")

  def get_config(self):
    config = super().get_config()
    config.update(vocab_sizes=self.vocab_sizes, output_dims=self.output_dims,
                  table_names=self.table_names,
                  embeddings_initializer=self.embeddings_initializer,
                  stack_tables=self.stack_tables)
    return config


def refuse_untabled_options(layer):
  """Refuses a Keras `Embedding` (either Keras version) with what a DP table cannot do the same
  way: `mask_zero` (the mask would be lost), regularizers or constraints (not part of the
  clipped per-example loss)."""
  refused = [name for name in ("embeddings_regularizer", "activity_regularizer",
                               "embeddings_constraint") if getattr(layer, name, None) is not None]
  if getattr(layer, "mask_zero", False):
    refused.append("mask_zero=True")
  if refused:
    raise ValueError(f"Embedding layer '{layer.name}' has {', '.join(refused)}, which a DP "
                     "table cannot keep: remove it, or use a DPEmbedding with pad_id")


def convert_embedding(layer: tf.keras.layers.Embedding) -> DPEmbedding:
  """Turns a `tf.keras.layers.Embedding` into a `DPEmbedding` in place: the same object (so
  every model, functional, Sequential or subclassed, that holds it holds the DP table), with its
  name, weights (built or not) and initializer; it serialises as a `DPEmbedding`. Its lookups
  are those of the Keras layer for ids of rank 1 or 2 ([n] → [n, d], [n, L] → [n, L, d]).
  Refuses what a DP table cannot do the same way (`refuse_untabled_options`)."""
  refuse_untabled_options(layer)
  layer.__class__ = DPEmbedding
  for name, value in (("vocab_size", int(layer.input_dim)), ("combiner", None), ("pad_id", -1),
                      ("table_name", layer.name), ("_recording", None)):
    object.__setattr__(layer, name, value)
  return layer
