"""Phantom Clipping: per-example gradient norms of a tied input/output embedding (paper §3).

For example i with item ids s (padding 0), the tied table E is used twice: as lookup e_s = E[s]
and as the candidate matrix of the scores r_τ = E[1:]·h_τ. With ∇e_s = ∂L_i/∂e_s ∈ R^{L×d},
hidden states H ∈ R^{T×d} of the T scored positions and logit gradients G = ∂L_i/∂r ∈ R^{T×M},
the per-example squared norm is the corrected Eq. 16 (Ding et al., "DPFormer: Learning
Differentially Private Transformer on Long-Tailed Data", arXiv:2305.17633):

  ‖g_E‖² =  Σ_{t,t'} 1[s_t = s_t'] ⟨∇e_s[t], ∇e_s[t']⟩        input side (ghost, L×L)
          + ⟨G·Gᵀ, H·Hᵀ⟩                                      output side (= ‖Gᵀ H‖², T×T)
          + 2 Σ_{t,τ} G[τ, s_t] ⟨∇e_s[t], H[τ]⟩               cross term, a gather of G

Only positions with a target are scored, so H and G come packed: [P, d] and [P, M] with
P = Σ_i T_i, example i's rows contiguous and being its last T_i positions (left padding). The
output side needs each example's own T_i×T_i Gram of G: one example at a time (a serial
`map_fn` over its rows of G), cost O(Σ_i T_i²·M) instead of B·L²·M and extra memory O(L·M)
for the example in flight. Padded input positions are excluded. With untied tables the cross
term vanishes and the two sides are the norms of the two tables.

The clipped sum is book-kept from the same G (`tied_embedding_clipped_loss_fn`): the candidate
matrix gets (c⊙G)ᵀH and the network below H gets c⊙∇H, so the DP step keeps no P×M tensor but
G, as the non-private step does, and nothing of size B×M×d.
"""
import tensorflow as tf


def phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, row_lengths, tied=True):
  """Per-example ‖g_E‖² [B] from ids [B,L], ∇e_s [B,L,d], packed H [P,d], packed G [P,M] and
  the scored positions per example `row_lengths` [B] (rows of example i: its last T_i positions)."""
  row_lengths = tf.cast(row_lengths, tf.int32)
  valid = tf.cast(ids > 0, grad_lookup.dtype)
  grad_lookup = grad_lookup * valid[..., None]
  same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), grad_lookup.dtype)
  input_gram = tf.einsum("bld,bkd->blk", grad_lookup, grad_lookup)
  input_side = tf.reduce_sum(same * input_gram, axis=[1, 2])
  output_side = _output_side(grad_logits, hidden, row_lengths)
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


def _output_side(grad_logits, hidden, row_lengths):
  """Σ_{τ,υ} ⟨G[τ], G[υ]⟩⟨H[τ], H[υ]⟩ per example, one example at a time (module doc)."""
  starts = tf.cumsum(row_lengths, exclusive=True)

  def example_value(i):
    begin, end = starts[i], starts[i] + row_lengths[i]
    grads, states = grad_logits[begin:end], hidden[begin:end]
    return tf.reduce_sum(tf.matmul(grads, grads, transpose_b=True)
                         * tf.matmul(states, states, transpose_b=True))

  return tf.map_fn(example_value, tf.range(tf.shape(row_lengths)[0]),
                   fn_output_signature=grad_logits.dtype, parallel_iterations=1)


def tied_embedding_norm_fn(ids, hidden, row_lengths, tied=True):
  """Norm function for `DPModel.extra_squared_norms`: maps the summed-loss gradients of
  [lookup, packed logits, hidden] (the raw E[ids], the scores of the packed `hidden` and
  `hidden` itself, from the step's forward pass) to per-example squared norms. ∇e_s is taken
  w.r.t. the raw lookup, so later masking or scaling of the lookup is included."""
  def squared_norm_fn(grads):
    grad_lookup, grad_logits, _ = grads
    return phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, row_lengths, tied=tied)

  return squared_norm_fn


def tied_embedding_clipped_loss_fn(hidden, row_lengths, output_table):
  """`ExtraNorms.clipped_loss_fn` for logits = H·E_cᵀ (book-keeping): the loss depends on the
  network only through H and the candidate matrix E_c = `output_table()` (read inside the
  step's tape), so with c_τ the clip factor of row τ's example, Σ c_i·L_i has the gradients
  c⊙∇H on H (∇H from the norm pass) and (c⊙G)ᵀH on E_c. No P×M tensor beyond G itself."""
  def clipped_loss_fn(grads, clip_factors):
    _, grad_logits, grad_hidden = grads
    factors = _row_factors(clip_factors, row_lengths, hidden.dtype)
    grad_table = tf.matmul(grad_logits, factors * hidden, transpose_a=True)  # (c⊙G)ᵀH, M×d
    return (tf.reduce_sum(tf.stop_gradient(factors * grad_hidden) * hidden)
            + tf.reduce_sum(tf.stop_gradient(grad_table) * output_table()))

  return clipped_loss_fn


def tied_embedding_clipped_gradients_fn(ids, hidden, row_lengths, num_rows, tied=True):
  """`ExtraNorms.clipped_gradient_fn` of the item table(s) [(R+1)×d] (and the untied M×d output
  table), book-kept from the norm pass: Σ_i c_i·g_{i,E} is the scatter of c_i·∇e_s[t] onto rows
  s_t (input side) plus (c⊙G)ᵀH on rows 1..R (output side), with its own clip factors c (a
  clipping group of its own, `ExtraNorms.norm_share`)."""
  def clipped_gradients_fn(grads, clip_factors):
    grad_lookup, grad_logits, _ = grads
    factors = tf.cast(clip_factors, grad_lookup.dtype)
    valid = tf.cast(ids > 0, grad_lookup.dtype)[..., None]
    weighted = grad_lookup * valid * factors[:, None, None]
    input_side = tf.math.unsorted_segment_sum(
        tf.reshape(weighted, [-1, tf.shape(grad_lookup)[-1]]), tf.reshape(ids, [-1]),
        num_rows + 1)
    output_side = tf.matmul(grad_logits,
                            _row_factors(clip_factors, row_lengths, hidden.dtype) * hidden,
                            transpose_a=True)
    if not tied:
      return [input_side, output_side]
    return [input_side + tf.pad(output_side, [[1, 0], [0, 0]])]

  return clipped_gradients_fn


def _row_factors(clip_factors, row_lengths, dtype):
  """[P, 1]: each packed row's example's clip factor."""
  rows = tf.repeat(tf.range(tf.shape(row_lengths)[0]), row_lengths)
  return tf.gather(tf.cast(clip_factors, dtype), rows)[:, None]
