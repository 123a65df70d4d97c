"""Data-parallel DP training on `tf.distribute` (MirroredStrategy, MultiWorkerMirroredStrategy):
the DP step's cross-replica sums and single noise draw (`replicas`), and the strategies and
localhost clusters the workflows run on (`cluster`)."""
