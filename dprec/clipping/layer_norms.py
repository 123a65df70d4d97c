"""Per-example squared gradient norms of Keras' standard layers, without per-example gradients.

One registration per Keras layer (`registers`, the shape of Opacus' `@register_grad_sampler`),
by class name, so that it serves the class of that name in tf.keras and in Keras 3 alike (the
functions read only attributes both versions share): its squared-norm function, with the
calling convention of tensorflow_privacy's fast-gradient-clipping registry (so a user's own
registry functions plug in unchanged),
`fn(layer, args, kwargs, tape, num_microbatches) -> (watched, outputs, squared_norm_fn)`, and
optionally its clipped-gradient function. The norm function runs the layer's forward pass,
watches an intermediate tensor Z on `tape` and returns `squared_norm_fn(dL/dZ) -> [batch]`, the
per-example squared norms of the layer's weights, from the gradient of the summed loss with
respect to Z (Li, Tramèr, Liang & Hashimoto 2022, "Large language models can be strong
differentially private learners", arXiv:2110.05679, §4):

- Dense: Z = aW + b; ‖∇_W L_i‖² = ⟨a_i a_iᵀ, g_i g_iᵀ⟩ over positions (the ghost norm; ‖a_i‖²‖g_i‖²
  for one position, Goodfellow's trick), ‖∇_b L_i‖² = ‖Σ_t g_i,t‖². Its clipped sum
  Σ_i c_i·∇L_i is book-kept from the same pass (`dense_clipped_gradients`; Bu, Wang, Zha &
  Karypis 2022, "Differentially private optimization on large model at small cost",
  arXiv:2210.00038).
- EinsumDense: the same Gram form when every kernel axis is either contracted with the input or
  kept in the output (the axes they share are the positions), else the per-example gradient.
- Embedding: ‖∇_E L_i‖² = Σ_v ‖Σ_{t: x_i,t = v} g_i,t‖², by summing the gradients of each
  example's repeated ids.
- LayerNormalization: γ and β are copied per example (B·d numbers) and the copies watched, so
  their gradients are the per-example gradients.
MultiHeadAttention needs no function of its own: its projections are EinsumDense layers, each
used once per call, whose norms the DP step collects separately.

User level (`dprec.clipping.units`): a function registered `per_unit` returns a
`squared_norm_fn(dL/dZ, units)` that also gives the squared norms [U] of each unit's summed
gradient ‖Σ_{i∈u} ∇L_i‖²: the Gram identity with the unit's rows' positions as its positions
(`unit_gram_squared_norms`), per-unit sums of the bias, Embedding pair and LayerNormalization
gradients.
"""
import collections

import tensorflow as tf

from dprec.errors import DprecError

# A layer class's entry: its squared-norm function (tensorflow_privacy's convention) and its
# book-kept clipped-gradient function `fn(layer, args, output_grads, clip_factors) -> [Σ_i
# c_i·∇_w L_i per trainable weight]` (None: the DP step's second backward pass of Σ c_i·L_i),
# and whether its `squared_norm_fn` takes `units` (user level, module docstring).
Registration = collections.namedtuple("Registration",
                                      ["squared_norm", "clipped_gradients", "per_unit"],
                                      defaults=[False])


class LayerRegistry:
  """Layer class → `Registration` (exact class match, like tensorflow_privacy's registry)."""

  def __init__(self, registrations=None):
    self._registrations = dict(registrations or {})

  def insert(self, layer_class, function, clipped_gradients=None, per_unit=False):
    """Registers `function` (the squared norms) and `clipped_gradients` for `layer_class`;
    `per_unit`: its `squared_norm_fn(grads, units)` also gives per-unit norms."""
    self._registrations[layer_class] = Registration(function, clipped_gradients, per_unit)

  def is_elem(self, layer):
    return type(layer) in self._registrations

  def lookup(self, layer):
    """The squared-norm function of `layer`'s class."""
    return self._registrations[type(layer)].squared_norm

  def clipped_gradients(self, layer):
    """The clipped-gradient function of `layer`'s class, or None."""
    return self._registrations[type(layer)].clipped_gradients

  def per_unit(self, layer):
    """Whether the squared-norm function of `layer`'s class gives per-unit norms."""
    return self._registrations[type(layer)].per_unit

  def layer_names(self):
    """The registered classes' names, sorted: what error messages and docs list."""
    return sorted(layer_class.__name__ for layer_class in self._registrations)


# Keras layer class name → its `Registration`.
_REGISTRATIONS = {}


def registers(*layer_names, clipped_gradients=None, per_unit=False):
  """Decorator: registers the decorated squared-norm function (and `clipped_gradients`,
  `per_unit`) for the Keras layer classes named `layer_names`, in every registry
  `make_layer_registry` makes."""

  def register(function):
    for name in layer_names:
      _REGISTRATIONS[name] = Registration(function, clipped_gradients, per_unit)
    return function

  return register


def make_layer_registry(layers=None):
  """A new registry of this module's functions ({layers}) for the classes of those names in
  `layers`, a Keras `layers` module (default `tf.keras.layers`; Keras 3's: `keras.layers`);
  insert more into it."""
  layers = layers or tf.keras.layers
  return LayerRegistry({getattr(layers, name): registration
                        for name, registration in _REGISTRATIONS.items()})


def _no_microbatches(num_microbatches, layer):
  if num_microbatches is not None:
    raise NotImplementedError(f"microbatches are not supported for {type(layer).__name__}")


def _per_position(tensor):
  """[B, ..., k] → [B, T, k]: every axis between the first and the last is a position."""
  if tensor.shape.rank == 2:
    return tensor[:, tf.newaxis]
  return tf.reshape(tensor, [tf.shape(tensor)[0], -1, tf.shape(tensor)[-1]])


def gram_squared_norms(inputs, grads):
  """‖Σ_t a_i,t g_i,tᵀ‖_F² = Σ_{t,s} ⟨a_i,t, a_i,s⟩⟨g_i,t, g_i,s⟩ (Li et al. 2022, §4), a [B, T, d],
  g [B, T, p]; with T = 1 it is ‖a_i‖²‖g_i‖²."""
  if inputs.shape[1] == 1:
    return tf.reduce_sum(tf.square(inputs), [1, 2]) * tf.reduce_sum(tf.square(grads), [1, 2])
  return tf.reduce_sum(tf.matmul(inputs, inputs, transpose_b=True)
                       * tf.matmul(grads, grads, transpose_b=True), axis=[1, 2])


def unit_gram_squared_norms(inputs, grads, units):
  """‖Σ_{i∈u} Σ_t a_i,t g_i,tᵀ‖_F² for each unit u (`dprec.clipping.units.Units`), a [B, T, d],
  g [B, T, p]: the unit's k_max·T padded positions in `gram_squared_norms`, or, when
  d·p < (k_max·T)², the norm of the unit's gradient Σ a g ᵀ [U, d, p] itself (the cheaper)."""

  def grouped(tensor):  # [B, T, k] → [U, k_max·T, k], zeros after the unit's rows
    return tf.reshape(units.pad(tensor),
                      tf.stack([units.count, -1, tf.shape(tensor, out_type=tf.int64)[-1]]))

  inputs, grads = grouped(inputs), grouped(grads)
  positions = tf.shape(inputs, out_type=tf.int64)[1]
  size = tf.shape(inputs, out_type=tf.int64)[2] * tf.shape(grads, out_type=tf.int64)[2]
  return tf.cond(
      positions * positions <= size, lambda: gram_squared_norms(inputs, grads),
      lambda: tf.reduce_sum(tf.square(tf.matmul(inputs, grads, transpose_a=True)), axis=[1, 2]))


def _squared_sum(tensor):
  """Σ over all axes but the batch axis of tensor²."""
  return tf.reduce_sum(tf.square(tf.reshape(tensor, [tf.shape(tensor)[0], -1])), axis=1)


def dense_clipped_gradients(layer, args, output_grads, clip_factors):
  """Σ_i c_i·∇L_i for a Dense layer's [kernel, bias], book-kept from its input a and the
  summed-loss gradient g of its pre-activation output (∇_W L_i = a_iᵀ g_i), so the clipped sum
  needs no second backward pass."""
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


@registers("Dense", clipped_gradients=dense_clipped_gradients, per_unit=True)
def dense_computation(layer, args, kwargs, tape, num_microbatches=None):
  """Dense: watches the pre-activation Z = aW + b."""
  del kwargs
  _no_microbatches(num_microbatches, layer)
  inputs = tf.cast(args[0], layer.compute_dtype)
  preactivation = tf.tensordot(inputs, layer.kernel, [[inputs.shape.rank - 1], [0]])
  if layer.use_bias:
    preactivation = tf.nn.bias_add(preactivation, layer.bias)
  tape.watch(preactivation)
  outputs = layer.activation(preactivation) if layer.activation else preactivation

  def squared_norm_fn(grads, units=None):
    grads, positions = _per_position(grads), _per_position(inputs)
    if units is not None:
      squared = unit_gram_squared_norms(positions, grads, units)
      if layer.use_bias:
        squared += _squared_sum(units.sum(tf.reduce_sum(grads, axis=1)))
      return squared
    if grads.shape[1] == 1:  # ‖a_i‖²‖g_i‖², and ‖g_i‖² again for the bias: one pass over g
      grad_squared = tf.reduce_sum(tf.square(grads), axis=[1, 2])
      input_squared = tf.reduce_sum(tf.square(positions), axis=[1, 2])
      return (input_squared + 1.0 if layer.use_bias else input_squared) * grad_squared
    squared = gram_squared_norms(positions, grads)
    if layer.use_bias:
      squared += tf.reduce_sum(tf.square(tf.reduce_sum(grads, axis=1)), axis=1)
    return squared

  return preactivation, outputs, squared_norm_fn


def _einsum_specs(equation):
  """'ab,bc->ac' → ('ab', 'bc', 'ac'), the batch axis first in the input and the output."""
  if "..." in equation:
    raise DprecError(f"EinsumDense equation {equation!r}: ellipses are not supported; name "
                     "every axis")
  inputs, output = equation.replace(" ", "").split("->")
  inputs, kernel = inputs.split(",")
  if inputs[0] != output[0] or inputs[0] in kernel:
    raise DprecError(f"EinsumDense equation {equation!r}: the first axis of the input and the "
                     "output must be the batch axis, which the kernel must not have")
  return inputs, kernel, output


def einsum_kernel_squared_norms(equation, inputs, grads, units=None):
  """‖∇_K L_i‖² for Z = einsum(equation, a, K), from a and g = dL/dZ; with `units`, of each
  unit's summed gradient."""
  in_spec, kernel_spec, out_spec = _einsum_specs(equation)
  batch = in_spec[0]
  contracted = "".join(c for c in kernel_spec if c in in_spec and c not in out_spec)
  kept = "".join(c for c in kernel_spec if c in out_spec and c not in in_spec)
  if len(contracted) + len(kept) < len(kernel_spec):  # a kernel axis shared by a and Z: Eq. 1
    per_example = tf.einsum(f"{in_spec},{out_spec}->{batch}{kernel_spec}", inputs, grads)
    return _squared_sum(per_example if units is None else units.sum(per_example))
  positions = "".join(c for c in in_spec[1:] if c in out_spec and c not in kernel_spec)

  def per_position(tensor):  # [B, positions..., kernel axes...] → [B, T, K]
    size = tf.reduce_prod(tf.shape(tensor)[1 + len(positions):])
    return tf.reshape(tensor, [tf.shape(tensor)[0], -1, size])

  inputs = per_position(tf.einsum(f"{in_spec}->{batch}{positions}{contracted}", inputs))
  grads = per_position(tf.einsum(f"{out_spec}->{batch}{positions}{kept}", grads))
  if units is not None:
    return unit_gram_squared_norms(inputs, grads, units)
  return gram_squared_norms(inputs, grads)


def _bias_gradients(bias, grads):
  """Per-example gradient of a bias broadcast against Z [B, ...]: g summed over the axes the
  bias does not have (leading ones, and its size-1 axes)."""
  rank, bias_rank = grads.shape.rank, bias.shape.rank
  leading = list(range(1, rank - bias_rank))
  grads = tf.reduce_sum(grads, axis=leading) if leading else grads
  broadcast = [1 + j for j, size in enumerate(bias.shape) if size == 1]
  return tf.reduce_sum(grads, axis=broadcast) if broadcast else grads


@registers("EinsumDense", per_unit=True)
def einsum_dense_computation(layer, args, kwargs, tape, num_microbatches=None):
  """EinsumDense: watches the pre-activation Z = einsum(equation, a, K) + b."""
  del kwargs
  _no_microbatches(num_microbatches, layer)
  inputs = tf.cast(args[0], layer.compute_dtype)
  preactivation = tf.einsum(layer.equation, inputs, layer.kernel)
  if layer.bias is not None:
    preactivation += layer.bias
  tape.watch(preactivation)
  outputs = layer.activation(preactivation) if layer.activation else preactivation

  def squared_norm_fn(grads, units=None):
    squared = einsum_kernel_squared_norms(layer.equation, inputs, grads, units)
    if layer.bias is not None:
      bias_grads = _bias_gradients(layer.bias, grads)
      squared += _squared_sum(bias_grads if units is None else units.sum(bias_grads))
    return squared

  return preactivation, outputs, squared_norm_fn


@registers("Embedding", per_unit=True)
def embedding_computation(layer, args, kwargs, tape, num_microbatches=None):
  """Embedding (dense [B, ...] or ragged ids): watches the looked-up vectors."""
  del kwargs
  _no_microbatches(num_microbatches, layer)
  ids = args[0]
  if isinstance(ids, tf.RaggedTensor):
    ids = ids.merge_dims(1, -1) if ids.ragged_rank > 1 else ids
    flat_ids, example = ids.flat_values, ids.value_rowids()
    batch_size = ids.nrows()
  else:
    flat_ids = tf.reshape(ids, [-1])
    batch_size = tf.shape(ids, out_type=tf.int64)[0]
    example = tf.repeat(tf.range(batch_size), tf.size(flat_ids, tf.int64) // batch_size)
  flat_ids = tf.cast(flat_ids, tf.int64)
  vectors = tf.gather(layer.embeddings, flat_ids)
  tape.watch(vectors)
  if isinstance(args[0], tf.RaggedTensor):
    outputs = ids.with_flat_values(vectors)
  else:
    outputs = tf.reshape(vectors, tf.concat([tf.shape(args[0]), [-1]], 0))

  def squared_norm_fn(grads, units=None):
    # Rows are per (example, id) pair (per (unit, id) with `units`): the gradients of an id
    # repeated in one example (unit) add up.
    owner, count = (example, batch_size) if units is None else (units.of(example),
                                                                units.count)
    pairs, pair_of_lookup = tf.unique(owner * layer.input_dim + flat_ids)
    summed = tf.math.unsorted_segment_sum(grads, pair_of_lookup, tf.size(pairs))
    return tf.math.unsorted_segment_sum(tf.reduce_sum(tf.square(summed), axis=1),
                                        pairs // layer.input_dim, count)

  return vectors, outputs, squared_norm_fn


@registers("LayerNormalization", per_unit=True)
def layer_normalization_computation(layer, args, kwargs, tape, num_microbatches=None):
  """LayerNormalization: watches per-example copies of γ and β."""
  del kwargs
  _no_microbatches(num_microbatches, layer)
  inputs = tf.cast(args[0], layer.compute_dtype)
  rank = inputs.shape.rank
  axes = sorted(a % rank for a in layer.axis)
  if 0 in axes:
    raise DprecError(f"LayerNormalization {layer.name!r} normalises over the batch axis: not "
                     "a per-example computation")
  mean, variance = tf.nn.moments(inputs, axes, keepdims=True)
  outputs = (inputs - mean) * tf.math.rsqrt(variance + layer.epsilon)
  shape = [tf.shape(inputs)[0]] + [inputs.shape[a] if a in axes else 1 for a in range(1, rank)]
  watched = []
  for weight, combine in ((layer.gamma, tf.multiply), (layer.beta, tf.add)):
    if weight is not None:
      copies = tf.broadcast_to(tf.reshape(weight, [1] + shape[1:]), shape)
      tape.watch(copies)
      watched.append(copies)
      outputs = combine(outputs, copies)

  def squared_norm_fn(grads, units=None):
    return tf.add_n([_squared_sum(g if units is None else units.sum(g)) for g in grads])

  return watched, outputs, squared_norm_fn


make_layer_registry.__doc__ = make_layer_registry.__doc__.format(
    layers=", ".join(sorted(_REGISTRATIONS)))
