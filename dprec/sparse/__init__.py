"""Contribution maps, private row selection and sparse noise (Ghazi et al., "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1, App.
B.2); names imported on first use (`dprec.lazy`: the NumPy-only `fest` imports without
TensorFlow)."""
from dprec import lazy as _lazy  # not `lazy`: that is this package's `dprec.sparse.lazy`

_NAMES = {
    "contribution_map": "dprec.sparse.contribution",
    "TableLayout": "dprec.sparse.kept_rows",
    "select_kept_rows": "dprec.sparse.kept_rows",
    "RowUniverse": "dprec.sparse.selection",
    "false_positive_rate": "dprec.sparse.selection",
    "sample_untouched": "dprec.sparse.selection",
    "select_rows": "dprec.sparse.selection",
    "FestRows": "dprec.sparse.fest",
    "fest_rows": "dprec.sparse.fest",
    "public_top_k": "dprec.sparse.fest",
}
__all__ = list(_NAMES)
__getattr__ = _lazy.exports(__name__, _NAMES, globals())
