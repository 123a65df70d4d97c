"""Per-example gradient norms without per-example gradients (registry, DP embeddings)."""
from dprec.clipping.registry import RegistryRecorder
from dprec.clipping.registry import make_layer_registry
