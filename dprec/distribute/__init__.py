"""DP training on `tf.distribute`: the data-parallel step's cross-replica sums and single noise
draw (`replicas`; MirroredStrategy, MultiWorkerMirroredStrategy), the strategies and localhost
clusters the workflows run on (`cluster`), and embedding tables sharded by rows over parameter
servers with DP steps scheduled by the chief (`parameter_server`; ParameterServerStrategy)."""
