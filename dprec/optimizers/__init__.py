"""DP training configurations, the DP optimizer passed to `DPModel.compile`, row-sparse
optimizers (their names imported on first use: `dprec.lazy`)."""
from dprec import lazy

_NAMES = {**{name: "dprec.optimizers.config"
             for name in ("ALGORITHMS", "DPAdaFEST", "DPAdaFESTPlus", "DPFEST", "DPSGD",
                          "DPSGDLazy", "NonPrivate", "QuantileClipping")},
          "DPOptimizer": "dprec.optimizers.dp_optimizer",
          **{name: "dprec.optimizers.sparse"
             for name in ("AdamBC", "LazyAdam", "SparseAdagrad", "SparseSGD", "TableSGD")}}
__all__ = sorted(_NAMES)
__getattr__ = lazy.exports(__name__, _NAMES, globals())
