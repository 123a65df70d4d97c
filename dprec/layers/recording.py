"""Forward passes that record per-example gradient-norm functions for sublayers.

tensorflow_privacy's fast clipping walks a *functional* model and, for each layer, calls a registry
function returning `(base_vars, outputs, sqr_norm_fn)`. dprec's sequence layers nest Dense and
LayerNormalization sublayers inside custom layers, so they route every sublayer call through
`call_layer`, which either calls the layer plainly or hands it to a tensorflow_privacy registry
generator (`clip_grads.get_registry_generator_fn`) and keeps what it returns.
"""


class NormRecorder:
  """Wraps a tensorflow_privacy registry generator function; collects its records in order."""

  def __init__(self, tape, generator_fn):
    self.tape = tape
    self._generator_fn = generator_fn
    self.records = []

  def __call__(self, layer, *args, **kwargs):
    outputs, record = self._generator_fn(layer, args, kwargs)
    if record is not None:
      self.records.append(record)
    return outputs

  def watch(self, tensor):
    """Watches an intermediate tensor whose gradient a norm function needs."""
    self.tape.watch(tensor)
    return tensor

  def add(self, base_vars, sqr_norm_fn, weights):
    """Adds a record computed outside the registry (e.g. Phantom norms of the tied embedding)."""
    self.records.append((base_vars, sqr_norm_fn, weights))


def call_layer(recorder, layer, *args, **kwargs):
  """`layer(*args, **kwargs)`, recording its norm function when `recorder` is set."""
  if recorder is None:
    return layer(*args, **kwargs)
  return recorder(layer, *args, **kwargs)
