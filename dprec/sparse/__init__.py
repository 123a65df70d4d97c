"""Contribution maps, private row selection and sparse noise (Ghazi et al., "Sparsity-Preserving
Differentially Private Training of Large Embedding Models", arXiv:2311.08357, Algorithm 1, App.
B.2)."""
from dprec.sparse.contribution import contribution_map
from dprec.sparse.kept_rows import TableLayout
from dprec.sparse.kept_rows import select_kept_rows
from dprec.sparse.selection import RowUniverse
from dprec.sparse.selection import false_positive_rate
from dprec.sparse.selection import sample_untouched
from dprec.sparse.selection import select_rows
from dprec.sparse.fest import FestRows
from dprec.sparse.fest import fest_rows
from dprec.sparse.fest import public_top_k
