"""dprec: differentially private training for large-embedding recommender models.

`dprec.make_private` trains a Keras 3 model (`import keras`, TensorFlow backend) or a Keras 2
one: tf-keras, which TensorFlow ≥ 2.16 serves as `tf.keras` when `TF_USE_LEGACY_KERAS=1` (the
convention of TFRS and TF-GNN; dprec's own models and commands are tf-keras models). Importing
dprec sets that variable if the user has not, which works as long as `tf.keras` has not been
used yet (TF reads the variable on the first use); the `dprec` command always imports dprec
first. In a process whose `tf.keras` is already Keras 3, dprec trains Keras 3 models only.
Importing dprec also quiets TensorFlow's start-up log (`dprec.quiet.quiet_tensorflow_start_up`).
"""
import os

from dprec import lazy, quiet

__version__ = "0.1.0"

LEGACY_KERAS = "TF_USE_LEGACY_KERAS"


def _select_keras_2():
  if os.environ.get(LEGACY_KERAS) not in ("1", "true", "True"):
    os.environ[LEGACY_KERAS] = "1"


_select_keras_2()
quiet.quiet_tensorflow_start_up()


# The public surface: `from dprec import X` for everything the README and the guides use, each
# loaded on first use (they import TensorFlow; `import dprec` stays cheap). name → module.
_PUBLIC = {
    "make_private": "dprec.workflows.private_model",
    "PoissonBatches": "dprec.workflows.private_batches",
    "DPModel": "dprec.models.dp_model",
    "DPEmbedding": "dprec.layers.embedding",
    "DPOptimizer": "dprec.optimizers",
    "DPSGD": "dprec.optimizers",
    "DPFEST": "dprec.optimizers",
    "DPAdaFEST": "dprec.optimizers",
    "DPAdaFESTPlus": "dprec.optimizers",
    "NonPrivate": "dprec.optimizers",
    "SparseSGD": "dprec.optimizers",
    "SparseAdagrad": "dprec.optimizers",
    "LazyAdam": "dprec.optimizers",
    "AdamBC": "dprec.optimizers",
    "PrivacyBudgetCallback": "dprec.training.callbacks",
    "BatchSampling": "dprec.training.poisson",
    "sampled_dataset": "dprec.training.poisson",
    "PrivacyLedger": "dprec.privacy",
    "calibrate_noise_multiplier": "dprec.privacy",
    "compute_epsilon": "dprec.privacy",
    "SampledTwoTower": "dprec.models.retrieval",
    "DprecError": "dprec.errors",
    "BudgetExceededError": "dprec.errors",
}
__all__ = ["__version__", "privacy", *_PUBLIC]


_public = lazy.exports(__name__, _PUBLIC, globals())


def __getattr__(name):
  """The names of `__all__`, imported on first use (see `_PUBLIC`)."""
  if name == "privacy":
    import importlib
    return importlib.import_module("dprec.privacy")
  return _public(name)


def __dir__():
  return sorted(set(globals()) | set(__all__))
