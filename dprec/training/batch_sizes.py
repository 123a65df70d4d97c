"""The default batch sizes' constants, without TensorFlow (the command line shows them before it
loads `dprec.training.poisson`, which sizes batches with them)."""

DEFAULT_BATCH_SIZE = 1024  # B when none is given, at most N/8 (`poisson.default_batch_size`)

# Data-sized B: the power of two nearest N / STEPS_PER_EPOCH (`train ctr` and `make_private`;
# chosen on validation AUC over data sizes for DP-SGD and DP-AdaFEST alike: the numbers are in
# docs/experiments/ctr_utility.md) ...
STEPS_PER_EPOCH = 150
DATA_SIZED_RANGE = (64, 16384)  # ... within these bounds (and at most N/8)
