"""Per-example gradient norms without per-example gradients (registry, DP embeddings)."""
from dprec.clipping.registry import RegistryRecorder
from dprec.clipping.layer_norms import LayerRegistry
from dprec.clipping.layer_norms import make_layer_registry
from dprec.clipping.layer_norms import registers
