"""Phantom Clipping: per-example gradient norms of a tied input/output embedding (paper §3).

For example i with item ids s (padding 0), the tied table E is used twice: as lookup e_s = E[s]
and as the candidate matrix of the scores r_τ = E[1:]·h_τ. With ∇e_s = ∂L_i/∂e_s ∈ R^{L×d},
hidden states H ∈ R^{T×d} and logit gradients G = ∂L_i/∂r ∈ R^{T×M} (T = L positions, or 1 for a
last-position loss), the per-example squared norm is the corrected Eq. 16 (note 000 §2.6–2.7):

  ‖g_E‖² =  Σ_{t,t'} 1[s_t = s_t'] ⟨∇e_s[t], ∇e_s[t']⟩        input side (ghost, L×L)
          + ⟨G·Gᵀ, H·Hᵀ⟩                                      output side (= ‖Gᵀ H‖², T×T)
          + 2 Σ_{t,τ} G[τ, s_t] ⟨∇e_s[t], H[τ]⟩               cross term, a gather of G

Padded positions are excluded. Extra memory is O(B·L·(L + T)) beyond G, which non-private
training materialises anyway; nothing of size B×M×d is formed. With untied tables the cross term
vanishes and the two sides are the norms of the two separate tables.
"""
import tensorflow as tf


def phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, tied=True):
  """Per-example ‖g_E‖² [B] from ids [B,L], ∇e_s [B,L,d], H [B,T,d] and G [B,T,M]."""
  valid = tf.cast(ids > 0, grad_lookup.dtype)
  grad_lookup = grad_lookup * valid[..., None]
  same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), grad_lookup.dtype)
  input_gram = tf.einsum("bld,bkd->blk", grad_lookup, grad_lookup)
  input_side = tf.reduce_sum(same * input_gram, axis=[1, 2])
  output_side = tf.reduce_sum(
      tf.einsum("btm,bum->btu", grad_logits, grad_logits)
      * tf.einsum("btd,bud->btu", hidden, hidden), axis=[1, 2])
  if not tied:
    return input_side + output_side
  columns = tf.maximum(ids - 1, 0)
  gathered = tf.gather(grad_logits, columns, axis=2, batch_dims=1)  # [B, T, L]: G[τ, s_t]
  inner = tf.einsum("bld,btd->btl", grad_lookup, hidden)
  cross = tf.reduce_sum(gathered * inner, axis=[1, 2])
  return input_side + output_side + 2.0 * cross


def tied_embedding_norm_fn(ids, hidden, tied=True):
  """Norm function for `DPModel.extra_squared_norms`: maps the summed-loss gradients of
  [lookup, logits] (the raw E[ids] and the scores of `hidden`, from the step's forward pass) to
  per-example squared norms. ∇e_s is taken w.r.t. the raw lookup, so later masking or scaling of
  the lookup is included."""
  def squared_norm_fn(grads):
    grad_lookup, grad_logits = grads
    return phantom_squared_norms(ids, grad_lookup, hidden, grad_logits, tied=tied)

  return squared_norm_fn
