"""The DP step's algorithm names and default settings, without TensorFlow: what the command line
offers and shows before it loads the step (`dprec.optimizers.config`, `dprec.optimizers.sparse`
define the algorithms and optimizers that use them)."""

# `config.ALGORITHMS`' names, in its order; PRESELECTED: those training a set of rows drawn once
# by DP top-k before training (`AlgorithmConfig.preselected`).
ALGORITHMS = ("non_private", "dp_sgd", "dp_sgd_lazy", "dp_fest", "dp_adafest", "dp_adafest_plus")
PRESELECTED = ("dp_fest", "dp_adafest_plus")
ADAFEST_RATIO = 2.0  # DP-AdaFEST's r = σ1/σ2
ADAFEST_THRESHOLD = 7.0  # DP-AdaFEST's τ
ADAMBC_FLOOR = 5e-8  # γ' of `AdamBC`: the ε2 of Tang et al.'s DP-AdamBC reference code
