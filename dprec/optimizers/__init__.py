"""DP training configurations, the DP optimizer passed to `DPModel.compile`, row-sparse
optimizers."""
from dprec.optimizers.config import ALGORITHMS
from dprec.optimizers.config import DPAdaFEST
from dprec.optimizers.config import DPAdaFESTPlus
from dprec.optimizers.config import DPFEST
from dprec.optimizers.config import DPSGD
from dprec.optimizers.config import DPSGDLazy
from dprec.optimizers.config import NonPrivate
from dprec.optimizers.config import QuantileClipping
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.optimizers.sparse import AdamBC
from dprec.optimizers.sparse import LazyAdam
from dprec.optimizers.sparse import SparseAdagrad
from dprec.optimizers.sparse import SparseSGD
from dprec.optimizers.sparse import TableSGD
