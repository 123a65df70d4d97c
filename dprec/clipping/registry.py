"""Per-example gradient norms of ordinary layers, routed through a layer registry.

A registry (`dprec.clipping.layer_norms`) maps a layer class to a function that runs the layer,
watches an intermediate tensor Z and returns `F(dL/dZ)` = the per-example squared gradient norms
of the layer's weights (Goodfellow's trick / ghost norms, note 004 §3.1–3.2). tensorflow_privacy
drives such functions by re-walking a functional model's graph; here every call of a registered
layer is routed through its function during the one forward pass of the DP step, so the same
functions also serve layers nested inside subclassed layers and models (the DPFormer encoder
blocks). Functions written for tensorflow_privacy's registry have the same signature and can be
inserted as they are.
"""
import collections

import tensorflow as tf

from dprec.errors import DprecError


# One routed call: the layer, its call arguments, the tensors its registry function watched and
# the function mapping their summed-loss gradients to per-example squared norms.
Record = collections.namedtuple("Record", ["layer", "args", "watched", "squared_norm_fn"])


def dense_clipped_gradients(layer, args, output_grads, clip_factors):
  """Σ_i c_i·∇L_i for a Dense layer's [kernel, bias], book-kept from its input a and the
  summed-loss gradient g of its pre-activation output (∇_W L_i = a_iᵀ g_i, note 004 eq. 1),
  so the clipped sum needs no second backward pass."""
  inputs = args[0]
  output_grads = tf.reshape(output_grads, [tf.shape(output_grads)[0], -1,
                                           output_grads.shape[-1]])
  weighted = output_grads * tf.cast(clip_factors, output_grads.dtype)[:, tf.newaxis, tf.newaxis]
  # Σ_{n,t} a_{n,t}ᵀ (c_n g_{n,t}) as one matmul over the flattened (n, t) axis, the kernel
  # gradient of the non-private backward pass (~10% less CPU than the equivalent einsum).
  weighted = tf.reshape(weighted, [-1, weighted.shape[-1]])
  grads = [tf.matmul(tf.reshape(inputs, [-1, inputs.shape[-1]]), weighted, transpose_a=True)]
  if layer.use_bias:
    grads.append(tf.reduce_sum(weighted, axis=0))
  return grads


# Layer classes whose clipped gradients are book-kept from the norm pass (others: a second
# backward pass of Σ c_i·L_i).
CLIPPED_GRADIENT_FUNCTIONS = {tf.keras.layers.Dense: dense_clipped_gradients}


class RegistryRecorder:
  """While active, each call of a registered layer runs its registry function on `tape`.

  `records` collects a `Record` per call. Only the outermost
  registered layer of a nesting is routed (a MultiHeadAttention's inner EinsumDense layers are
  covered by its own function). A layer called twice in one step shares its weights between
  uses, where per-use norms do not add up; that raises an error pointing to the model hook.
  """

  def __init__(self, layers, registry, tape):
    self._layers = [layer for layer in layers
                    if layer.trainable_weights and registry.is_elem(layer)]
    self._registry = registry
    self._tape = tape
    self._depth = 0
    self.records = []

  @property
  def layers(self):
    return self._layers

  def __enter__(self):
    for layer in self._layers:
      object.__setattr__(layer, "call", self._routed_call(layer))
    return self

  def __exit__(self, *exc_info):
    for layer in self._layers:
      object.__delattr__(layer, "call")

  def _routed_call(self, layer):
    original_call = type(layer).call.__get__(layer)
    registry_fn = self._registry.lookup(layer)

    @tf.autograph.experimental.do_not_convert
    def call(*args, **kwargs):
      if self._depth:
        return original_call(*args, **kwargs)
      if any(record.layer is layer for record in self.records):
        raise DprecError(
            f"layer {layer.name!r} is called more than once per step: its per-example norm is "
            "not the sum of per-call norms; compute it in DPModel.extra_squared_norms")
      self._depth += 1
      try:
        watched, outputs, squared_norm_fn = registry_fn(layer, args, kwargs, self._tape, None)
      finally:
        self._depth -= 1
      self.records.append(Record(layer, args, watched, squared_norm_fn))
      return outputs

    return call
