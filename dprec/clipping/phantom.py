"""Phantom Clipping: per-example gradient norms of a tied input/output embedding (paper §3).

For example i with item ids s (padding 0), the tied table E is used twice: as lookup e_s = E[s]
and as the candidate matrix of the scores r_τ = E[1:]·h_τ. With ∇e_s = ∂L_i/∂e_s ∈ R^{L×d},
hidden states H ∈ R^{T×d} of the T scored positions and logit gradients G = ∂L_i/∂r ∈ R^{T×M},
the per-example squared norm is the corrected Eq. 16 (note 000 §2.6–2.7):

  ‖g_E‖² =  Σ_{t,t'} 1[s_t = s_t'] ⟨∇e_s[t], ∇e_s[t']⟩        input side (ghost, L×L)
          + ⟨G·Gᵀ, H·Hᵀ⟩                                      output side (= ‖Gᵀ H‖², T×T)
          + 2 Σ_{t,τ} G[τ, s_t] ⟨∇e_s[t], H[τ]⟩               cross term, a gather of G

Only positions with a target are scored, so H and G come packed: [P, d] and [P, M] with
P = Σ_i T_i, example i's rows contiguous and being its last T_i positions (left padding). The
output side needs each example's own T_i×T_i Gram of G; examples are sorted by T_i and split into
a few chunks, each padded to its own longest T (chunk sizes halve towards the longest examples,
so the padding stays small on long-tailed lengths). Cost O(Σ_i T_i²·M) instead of B·L²·M; extra
memory O(P·M) like G itself, nothing of size B×M×d. Padded input positions are excluded. With
untied tables the cross term vanishes and the two sides are the norms of the two tables.
"""
import tensorflow as tf


def phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, row_lengths, tied=True,
                          num_chunks=8):
  """Per-example ‖g_E‖² [B] from ids [B,L], ∇e_s [B,L,d], packed H [P,d], packed G [P,M] and
  the scored positions per example `row_lengths` [B] (rows of example i: its last T_i positions).
  `num_chunks` only trades padding for the number of Gram products; the result is exact."""
  row_lengths = tf.cast(row_lengths, tf.int32)
  valid = tf.cast(ids > 0, grad_lookup.dtype)
  grad_lookup = grad_lookup * valid[..., None]
  same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), grad_lookup.dtype)
  input_gram = tf.einsum("bld,bkd->blk", grad_lookup, grad_lookup)
  input_side = tf.reduce_sum(same * input_gram, axis=[1, 2])
  output_side = _output_side(grad_logits, hidden, row_lengths, num_chunks)
  if not tied:
    return input_side + output_side
  # [P, 2] (example, position) in packed-row order.
  positions = tf.where(scored_positions(row_lengths, tf.shape(ids)[1]))
  rows = positions[:, 0]
  hidden_dense = tf.scatter_nd(positions, hidden, tf.shape(grad_lookup, out_type=tf.int64))
  inner = tf.gather_nd(tf.einsum("bld,btd->btl", grad_lookup, hidden_dense), positions)  # [P, L]
  columns = tf.gather(tf.maximum(ids - 1, 0), rows)  # [P, L]: s_t of the row's example
  gathered = tf.gather(grad_logits, columns, axis=1, batch_dims=1)  # [P, L]: G[τ, s_t]
  cross = tf.math.unsorted_segment_sum(tf.reduce_sum(gathered * inner, axis=1), rows,
                                       tf.shape(ids)[0])
  return input_side + output_side + 2.0 * cross


def scored_positions(row_lengths, length):
  """bool [B, L]: the last `row_lengths[i]` of example i's L positions (the packed layout)."""
  row_lengths = tf.cast(row_lengths, tf.int32)
  return tf.range(length)[None, :] >= (length - row_lengths)[:, None]


def _output_side(grad_logits, hidden, row_lengths, num_chunks):
  """Σ_{τ,υ} ⟨G[τ], G[υ]⟩⟨H[τ], H[υ]⟩ per example, by length-sorted chunks (module doc)."""
  batch = tf.shape(row_lengths)[0]
  starts = tf.cumsum(row_lengths, exclusive=True)
  order = tf.argsort(row_lengths, stable=True)
  bounds = [tf.constant(0)] + [batch - batch // 2 ** c for c in range(1, num_chunks)] + [batch]
  values = []
  for begin, end in zip(bounds[:-1], bounds[1:]):
    examples = order[begin:end]
    lengths = tf.gather(row_lengths, examples)
    steps = tf.range(tf.reduce_max(tf.concat([lengths, [0]], axis=0)))
    inside = steps[None, :] < lengths[:, None]  # [n, T]
    index = tf.where(inside, tf.gather(starts, examples)[:, None] + steps[None, :], 0)
    grads = tf.gather(grad_logits, index)  # [n, T, M]; padded slots repeat row 0 ...
    states = tf.gather(hidden, index) * tf.cast(inside, hidden.dtype)[..., None]  # ... H = 0
    values.append(tf.reduce_sum(tf.einsum("ntm,num->ntu", grads, grads)
                                * tf.einsum("ntd,nud->ntu", states, states), axis=[1, 2]))
  return tf.scatter_nd(order[:, None], tf.concat(values, axis=0), [batch])


def tied_embedding_norm_fn(ids, hidden, row_lengths, tied=True):
  """Norm function for `DPModel.extra_squared_norms`: maps the summed-loss gradients of
  [lookup, packed logits] (the raw E[ids] and the scores of the packed `hidden`, from the step's
  forward pass) to per-example squared norms. ∇e_s is taken w.r.t. the raw lookup, so later
  masking or scaling of the lookup is included."""
  def squared_norm_fn(grads):
    grad_lookup, grad_logits = grads
    return phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, row_lengths, tied=tied)

  return squared_norm_fn
