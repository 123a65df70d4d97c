"""Per-example gradient norms of ordinary layers, routed through a layer registry.

A registry (`dprec.clipping.layer_norms`) maps a layer class to a function that runs the layer,
watches an intermediate tensor Z and returns `F(dL/dZ)` = the per-example squared gradient norms
of the layer's weights (Goodfellow's trick / ghost norms: Li, Tramèr, Liang & Hashimoto 2022,
"Large language models can be strong differentially private learners", arXiv:2110.05679, §4),
and to the layer's book-kept clipped-gradient function, if it has one. tensorflow_privacy
drives such functions by re-walking a functional model's graph; here every call of a registered
layer is routed through its function during the one forward pass of the DP step, so the same
functions also serve layers nested inside subclassed layers and models (the DPFormer encoder
blocks). Functions written for tensorflow_privacy's registry have the same signature and can be
inserted as they are.
"""
import collections

import tensorflow as tf

from dprec.errors import DprecError


# One routed call: the layer, its call arguments, the tensors its registry function watched,
# the function mapping their summed-loss gradients to per-example squared norms, and the layer's
# clipped-gradient function (`layer_norms.Registration`; None: none registered).
Record = collections.namedtuple("Record", ["layer", "args", "watched", "squared_norm_fn",
                                           "clipped_gradient_fn"])


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
      self.records.append(Record(layer, args, watched, squared_norm_fn,
                                 self._registry.clipped_gradients(layer)))
      return outputs

    return call


def refuse_uncovered(layers, weights, covered, registry, caller):
  """Refuses, in one line naming the innermost of `layers` that hold them, the trainable
  `weights` outside `covered` (ids of the weights some per-example norm covers): their gradients
  would be neither clipped nor bounded. `caller` names who refuses; the layers `registry`
  knows are listed as the remedy."""
  owners = set()
  for weight in weights:
    if id(weight) in covered:
      continue
    holders = [m for m in layers if any(w is weight for w in m.trainable_weights)]
    owner = min(holders, key=lambda m: len(m.trainable_weights)) if holders else None
    owners.add(f"{owner.name} ({type(owner).__name__})" if owner else weight.name)
  if owners:
    raise DprecError(
        f"{caller} cannot clip layer(s) {', '.join(sorted(owners))} exactly: no per-example "
        f"gradient norm covers their weights; use layers of DPModel.layer_registry "
        f"({', '.join(registry.layer_names())}) or DPEmbedding, register the layer class "
        "there (LayerRegistry.insert), or cover the weights in DPModel.extra_squared_norms")
