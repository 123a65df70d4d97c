"""`dprec train ctr`: train the pCTR model on Criteo data with one of seed 001's algorithms.

    dprec train ctr --data DIR --algorithm dp_adafest --epsilon 1 --batch-size 2048 --steps 1000

`--data` is a directory of Criteo TSV `day_N` files (vocabularies built in-process from the
training days; the last day is held out for evaluation) or a Beam preprocessing output directory
(its `manifest.json`). σ comes from ε via `dprec.privacy` (σ1, σ2 at ratio r for DP-AdaFEST); the
ledger is charged as training proceeds and training stops at the budget. Prints a JSON summary.

The noise, false positives, Poisson batches and DP top-k draws come from the run's secret key
(`dprec.workflows.run.Run`; kept in `--run-dir`'s `secret/` if one is given); `--seed` seeds only
initialisation. `--insecure-noise-seed N` makes them reproducible, and the run not private.
"""
import argparse
import dataclasses
import functools
import json
import os
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from dprec.errors import BudgetExceededError, DprecError
from dprec.models import ctr
from dprec.optimizers import config as config_lib
from dprec.optimizers import sparse as sparse_optimizers
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.training import callbacks as callbacks_lib
from dprec.training import poisson
from dprec.workflows.run import Run

ALGORITHMS = ("non_private", "dp_sgd", "dp_fest", "dp_adafest", "dp_adafest_plus")
OPTIMIZERS = {"sgd": sparse_optimizers.SparseSGD, "adagrad": sparse_optimizers.SparseAdagrad,
              "adam": sparse_optimizers.LazyAdam, "adambc": sparse_optimizers.AdamBC}
LOGIT_INITS = ("base_rate", "default")
VOCABULARY_NOTE = ("vocabularies (and the bucket counts DP-FEST uses with --top-k-epsilon 0) are "
                   "treated as public, as seed 001 does, unless dataset.vocab_privacy says the "
                   "vocabulary is DP (its epsilon is then in epsilon_parts); build them from "
                   "public data or by DP top-k for a guarantee that covers them")
EPSILON_COVERS = {
    "epsilon": "(epsilon, delta)-DP for adding or removing one training example (row), "
               "covering the model, the DP top-k rows and every field listed under 'covered'",
    "covered": ["auc", "eval_loss", "gradient_size", "gradient_size_reduction", "steps",
                "stopped_at_budget"],
    "public": ["settings", "noise multipliers", "train_rows and eval_rows (N, assumed public)",
               "dense_embedding_size", "timings"],
    "held_out_evaluation": "auc and eval_loss are computed on the last day, which is not "
                           "training data of this run (that day itself is not protected)",
    "not_covered": "diagnostics_nonprivate (only with --diagnostics): exact training loss/AUC",
}


@dataclasses.dataclass
class CTRTrainOptions:
  """Everything `dprec train ctr` accepts (see `register` for the meaning of each field)."""
  data: str
  algorithm: str = "dp_adafest"
  epsilon: Optional[float] = None
  delta: Optional[float] = None
  batch_size: int = 2048
  steps: int = 1000
  ratio: float = 5.0
  threshold: float = 15.0
  contribution_clip: float = 1.0
  l2_norm_clip: float = 10.0  # calibration: see BENCHMARKS.md "Calibrated DP pCTR"
  learning_rate: float = 3e-4
  optimizer: str = "adam"
  adambc_floor: float = sparse_optimizers.ADAMBC_FLOOR
  logit_init: str = "base_rate"
  base_rate_share: float = 0.01
  top_k: Optional[int] = None
  top_k_epsilon: float = 0.1
  fixed_batches: bool = False
  ledger: Optional[str] = None
  summary_json: Optional[str] = None
  accountant: str = "pld"
  vocab: Optional[str] = None
  vocab_min_count: int = 1
  hidden_units: Tuple[int, ...] = (598, 598, 598, 598)
  eval_batch_size: int = 8192
  charge_every: int = 100
  log_dir: Optional[str] = None
  seed: int = 0
  insecure_noise_seed: Optional[int] = None
  run_dir: Optional[str] = None
  diagnostics: bool = False
  progress: bool = True

  def validate(self):
    if self.algorithm not in ALGORITHMS:
      raise DprecError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm}")
    if self.optimizer not in OPTIMIZERS:
      raise DprecError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer}")
    if not self.adambc_floor > 0:
      raise DprecError(f"--adambc-floor must be positive, got {self.adambc_floor}")
    if self.logit_init not in LOGIT_INITS:
      raise DprecError(f"--logit-init must be one of {', '.join(LOGIT_INITS)}, got "
                       f"{self.logit_init}")
    if not 0 < self.base_rate_share < 1:
      raise DprecError(f"--base-rate-share must be in (0, 1), got {self.base_rate_share}")
    if self.batch_size < 1 or self.steps < 1:
      raise DprecError("--batch-size and --steps must be positive")
    private = self.algorithm != "non_private"
    if private and (self.epsilon is None or not self.epsilon > 0):
      raise DprecError(f"--algorithm {self.algorithm} needs a positive --epsilon")
    if self.delta is not None and not 0 < self.delta < 1:
      raise DprecError(f"--delta must be in (0, 1), got {self.delta}")
    if self.algorithm in ("dp_fest", "dp_adafest_plus") and not (self.top_k or 0) > 0:
      raise DprecError(f"--algorithm {self.algorithm} needs --top-k (rows kept over all tables)")
    if self.top_k_epsilon < 0:
      raise DprecError("--top-k-epsilon must be >= 0")


@dataclasses.dataclass
class CTRData:
  """Training and held-out arrays (`dprec.data.criteo.transform` dicts) and table sizes."""
  train: Dict[str, np.ndarray]
  eval: Dict[str, np.ndarray]
  vocab_sizes: Tuple[int, ...]
  source: str


def _concatenate(batches):
  batches = list(batches)
  if not batches:
    return None
  return {key: np.concatenate([np.asarray(b[key]) for b in batches]) for key in batches[0]}


def load_data(directory: str, vocab_dir: Optional[str] = None, min_count: int = 1) -> CTRData:
  """Reads `directory`: a Beam output (manifest.json) or Criteo TSV day files; last day = eval."""
  if not os.path.isdir(directory):
    raise DprecError(f"{directory}: --data must be a directory")
  if os.path.exists(os.path.join(directory, "manifest.json")):
    from dprec.data import criteo_tfrecord  # pylint: disable=import-outside-toplevel
    manifest = criteo_tfrecord.load_manifest(directory)
    days = [entry["day"] for entry in manifest["days"]]
    if len(days) < 2:
      raise DprecError(f"{directory}/manifest.json: need at least 2 days (the last is held out)")
    sizes = tuple(criteo_tfrecord.vocab_sizes(manifest))

    def read(selected):
      return _concatenate(criteo_tfrecord.criteo_tfrecord_dataset(directory, selected, 65536)
                          .as_numpy_iterator())
    return CTRData(read(days[:-1]), read(days[-1:]), sizes, "beam-manifest")
  from dprec.data import criteo  # pylint: disable=import-outside-toplevel
  files = criteo.criteo_day_files(directory)
  if len(files) < 2:
    raise DprecError(f"{directory}: need at least 2 day_N files (the last is held out)")
  vocab = (criteo.CriteoVocabulary.load(vocab_dir) if vocab_dir
           else criteo.CriteoVocabulary.build(files[:-1], min_count=min_count))
  train, held_out = criteo.load_criteo(files[:-1], vocab), criteo.load_criteo(files[-1:], vocab)
  if not len(train["label"]) or not len(held_out["label"]):
    raise DprecError(f"{directory}: the training days and the held-out day must not be empty")
  return CTRData(train, held_out, vocab.sizes, "criteo-tsv")


@dataclasses.dataclass
class PrivacyPlan:
  """Noise multipliers and the ε split for one run."""
  noise_multiplier: Optional[float]  # σ the accountant charges per step (composed for AdaFEST)
  sigma1: Optional[float]
  sigma2: Optional[float]
  selection_epsilon: float
  delta: Optional[float]
  sampling_rate: float
  base_rate_noise_multiplier: Optional[float] = None  # σ of the DP label sum (sensitivity 1)


@functools.lru_cache(maxsize=64)
def _training_noise_multiplier(epsilon, delta, sampling_rate, steps, selection_epsilon,
                               accountant, poisson_batches, gaussian_mechanisms=(), spent=None):
  """Calibration is slow (PLD, seconds to a minute): reuse it across runs of one process."""
  from dprec import privacy  # pylint: disable=import-outside-toplevel
  return privacy.plan_training(epsilon, delta, [(sampling_rate, steps)],
                               selection_epsilon=selection_epsilon, accountant=accountant,
                               poisson=poisson_batches, gaussian_mechanisms=gaussian_mechanisms,
                               spent=spent or privacy.Spent()).noise_multiplier


@functools.lru_cache(maxsize=64)
def _base_rate_noise_multiplier(epsilon, delta, accountant):
  from dprec import privacy  # pylint: disable=import-outside-toplevel
  return privacy.calibrate_gaussian_mechanism(epsilon, delta, accountant)


def plan_privacy(options: CTRTrainOptions, num_examples: int, ledger=None,
                 spent=None) -> PrivacyPlan:
  """σ from the target ε (note 001 §2.2): DP-SGD's σ at (ε − ε_select, δ, q, T), split into
  σ1 = r·σ2 and σ2 for DP-AdaFEST so that (σ1⁻² + σ2⁻²)^(−1/2) = σ. The DP base rate's Gaussian
  mechanism (σ_b alone at `base_rate_share`·ε) is composed with training in the accountant, and
  so is what the `ledger` spent before the run (`spent`, e.g. a DP top-k vocabulary; δ: the
  ledger's)."""
  from dprec import privacy  # pylint: disable=import-outside-toplevel
  q = poisson.BatchSampling(options.batch_size).sampling_rate(num_examples)
  if options.algorithm == "non_private":
    return PrivacyPlan(None, None, None, 0.0, None, q)
  delta = (ledger.delta if ledger is not None else
           options.delta if options.delta is not None else 1.0 / num_examples)
  selects = options.algorithm in ("dp_fest", "dp_adafest_plus")
  selection_epsilon = options.top_k_epsilon if selects else 0.0
  base_sigma = _base_rate_noise_multiplier(options.base_rate_share * options.epsilon, delta,
                                           options.accountant)
  sigma = _training_noise_multiplier(options.epsilon, delta, q, options.steps, selection_epsilon,
                                     options.accountant, not options.fixed_batches, (base_sigma,),
                                     spent)
  if options.algorithm.startswith("dp_adafest"):
    sigma1, sigma2 = privacy.adafest_noise_multipliers(sigma, options.ratio)
  else:
    sigma1, sigma2 = None, sigma
  return PrivacyPlan(sigma, sigma1, sigma2, selection_epsilon, delta, q, base_sigma)


def base_rate(labels, plan: PrivacyPlan, ledger=None, rng=None) -> float:
  """The training click rate: exact for a non-private run; else the Gaussian mechanism on the
  label sum (sensitivity 1, σ_b from the plan, noise from the secret `rng`: the run's key)
  divided by the public row count, charged to `ledger`. Clipped to [1/N, 1 − 1/N]."""
  n = len(labels)
  total = float(np.sum(labels))
  if plan.base_rate_noise_multiplier is not None:
    ledger.charge_gaussian_mechanism(plan.base_rate_noise_multiplier, label="train ctr base rate")
    total += plan.base_rate_noise_multiplier * (rng or np.random.default_rng()).normal()
  return float(np.clip(total / n, 1.0 / n, 1.0 - 1.0 / n))


def log_loss_of_constant(labels, rate) -> float:
  """Mean binary cross-entropy of predicting `rate` for every example."""
  positive = float(np.mean(labels))
  return -(positive * np.log(rate) + (1 - positive) * np.log1p(-rate))


def _selected_rows(options, model_config, train, ledger, rng):
  """DP-FEST rows per table: top int(k/F) by count, DP (Gumbel noise from the secret `rng`,
  charged) unless ε_select = 0."""
  from dprec.sparse import fest  # pylint: disable=import-outside-toplevel
  columns = train[ctr.CAT_FEATURES]
  counts = {name: np.bincount(columns[:, f], minlength=size)
            for f, (name, size) in enumerate(zip(model_config.table_names,
                                                 model_config.vocab_sizes))}
  per_table = max(1, options.top_k // len(counts))
  k = {name: min(per_table, len(c)) for name, c in counts.items()}
  epsilon = options.top_k_epsilon or None
  return fest.fest_rows(counts, k, epsilon=epsilon, rng=rng,
                        ledger=ledger if epsilon else None).rows


def algorithm_config(options: CTRTrainOptions, plan: PrivacyPlan, selected_rows=None):
  """The `dprec.optimizers.config` object of `options.algorithm`."""
  if options.algorithm == "non_private":
    return config_lib.NonPrivate()
  common = dict(l2_norm_clip=float(options.l2_norm_clip), noise_multiplier=plan.sigma2)
  if options.algorithm == "dp_sgd":
    return config_lib.DPSGD(**common)
  if options.algorithm == "dp_fest":
    return config_lib.DPFEST(selected_rows=selected_rows, **common)
  adafest = dict(contribution_clip=float(options.contribution_clip),
                 contribution_noise_multiplier=plan.sigma1, threshold=float(options.threshold),
                 **common)
  if options.algorithm == "dp_adafest":
    return config_lib.DPAdaFEST(**adafest)
  return config_lib.DPAdaFESTPlus(selected_rows=selected_rows, **adafest)


def make_optimizer(options: CTRTrainOptions):
  """The row-sparse optimizer of `options.optimizer` at `options.learning_rate`."""
  if options.optimizer == "adambc":
    return sparse_optimizers.AdamBC(options.learning_rate, floor=options.adambc_floor)
  return OPTIMIZERS[options.optimizer](options.learning_rate)


def _check_budget(ledger, plan, options):
  """Refuse, before any step, a run whose full cost would exceed the budget."""
  planned = ledger.epsilon_if_charged(plan.noise_multiplier, plan.sampling_rate, options.steps,
                                      poisson=not options.fixed_batches)
  if planned > options.epsilon * (1 + 1e-6):
    raise BudgetExceededError(
        f"the planned run would spend ε={planned:.4g} > budget {options.epsilon:g}")


def train_ctr(options: CTRTrainOptions, data: Optional[CTRData] = None) -> dict:
  """Trains and evaluates the pCTR model; returns the JSON summary (also written to
  `options.summary_json` if set)."""
  options.validate()
  data = data or load_data(options.data, options.vocab, options.vocab_min_count)
  num_examples = len(data.train["label"])
  private = options.algorithm != "non_private"
  with Run("train ctr", options.run_dir, options.ledger, options.insecure_noise_seed,
           options.data) as run:
    if run.resumed:  # a second run on the same key would reuse its noise
      raise DprecError(f"{options.run_dir}: already holds a run (its run.json and noise key); "
                       "`train ctr` does not resume yet: use a new --run-dir")
    ledger = run.open_ledger(options.epsilon, options.delta, options.accountant,
                             default_delta=1.0 / num_examples) if private else None
    plan = plan_privacy(options, num_examples, ledger, run.spent_before(ledger))
    rate = base_rate(data.train["label"], plan, ledger, run.numpy_rng("base rate"))
    tf.keras.utils.set_random_seed(options.seed)
    model = ctr.build_ctr_model(
        data.vocab_sizes, hidden_units=options.hidden_units,
        logit_bias=float(np.log(rate / (1 - rate))) if options.logit_init == "base_rate" else None)
    selected = None
    if options.algorithm in ("dp_fest", "dp_adafest_plus"):
      selected = _selected_rows(options, model.config, data.train, ledger,
                                run.numpy_rng("dp top-k"))
    config = algorithm_config(options, plan, selected)
    if private:
      _check_budget(ledger, plan, options)
    model.compile(optimizer=DPOptimizer(config, make_optimizer(options),
                                        expected_batch_size=options.batch_size,
                                        noise_key=run.noise_key))
    model.optimizer.build(model.trainable_variables)  # slots now: the step is traced only once
    sampling = poisson.BatchSampling(options.batch_size, private and not options.fixed_batches,
                                     run.entropy("poisson"))
    features = {key: data.train[key] for key in (ctr.CAT_FEATURES, ctr.INT_FEATURES)}
    dataset = poisson.sampled_dataset(features, data.train["label"], sampling, options.steps)
    timer = callbacks_lib.StepTimer()
    callbacks = [timer, run.noise_callback({"dp step": model.dp_optimizer.generator})]
    budget = None
    if private:
      budget = callbacks_lib.PrivacyBudgetCallback(
          ledger, plan.noise_multiplier, plan.sampling_rate, poisson=not options.fixed_batches,
          charge_every=options.charge_every, label=f"train ctr {options.algorithm}",
          log_dir=options.log_dir)
      callbacks.append(budget)
    if options.log_dir and options.diagnostics:  # Keras' scalars: the exact training loss/AUC
      callbacks.append(tf.keras.callbacks.TensorBoard(
          os.path.join(options.log_dir, "diagnostics_nonprivate"), update_freq=100))
    if options.progress:
      callbacks.append(callbacks_lib.ProgressBar(desc=f"train ctr {options.algorithm}",
                                                 diagnostics=options.diagnostics))
    history = model.fit(dataset, epochs=1, steps_per_epoch=options.steps, callbacks=callbacks,
                        verbose=0)
    evaluation = model.evaluate(
        {key: data.eval[key] for key in (ctr.CAT_FEATURES, ctr.INT_FEATURES)},
        data.eval["label"], batch_size=options.eval_batch_size, verbose=0, return_dict=True)
    summary = _summary(options, data, model, plan, history.history, evaluation, timer, ledger,
                       budget, run, rate)
  if options.summary_json:
    with open(options.summary_json, "w", encoding="utf-8") as out:
      json.dump(summary, out, indent=2, sort_keys=True)
  return summary


def _summary(options, data, model, plan, history, evaluation, timer, ledger, budget, run, rate):
  last = {key: float(values[-1]) for key, values in history.items()}
  notes = ["fixed-size batches: not Poisson, accounted as if Poisson"] if (
      options.fixed_batches and ledger is not None) else []
  summary = {
      "algorithm": options.algorithm,
      "auc": float(evaluation["auc"]),
      "eval_loss": float(evaluation["loss"]),
      "eval_log_loss": float(evaluation["loss"]),
      "base_rate": rate,
      "base_rate_log_loss": log_loss_of_constant(data.eval["label"], rate),
      "base_rate_noise_multiplier": plan.base_rate_noise_multiplier,
      "epsilon": ledger.epsilon_spent() if ledger else None,
      "epsilon_budget": options.epsilon if ledger else None,
      "delta": plan.delta,
      "noise_multiplier": plan.noise_multiplier,
      "sigma1": plan.sigma1,
      "sigma2": plan.sigma2,
      "selection_epsilon": plan.selection_epsilon,
      "sampling_rate": plan.sampling_rate,
      "poisson": ledger is not None and not options.fixed_batches,
      "accountant": options.accountant if ledger else None,
      "gradient_size": last.get("gradient_size"),
      "gradient_size_reduction": last.get("gradient_size_reduction"),
      "dense_embedding_size": model.config.embedding_parameters,
      "steps": timer.steps,
      "steps_requested": options.steps,
      "stopped_at_budget": bool(budget and budget.stopped_at_budget),
      "steps_per_second": timer.steps_per_second,
      "train_seconds": timer.seconds,
      "batch_size": options.batch_size,
      "train_rows": int(len(data.train["label"])),
      "eval_rows": int(len(data.eval["label"])),
      "data_source": data.source,
      "ledger": options.ledger,
      "run_dir": options.run_dir,
      "note": "; ".join([VOCABULARY_NOTE] + notes),
      **run.privacy_fields(ledger is not None, EPSILON_COVERS, notes, ledger),
  }
  if options.diagnostics:
    summary["diagnostics_nonprivate"] = {
        "train_loss": last.get("loss"), "train_auc": last.get("auc"),
        "note": "NOT covered by ε: exact (unclipped) training loss and AUC of the last steps"}
  return summary


def _int_list(text):
  try:
    values = tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
  return values


def register(subparsers):
  parser = subparsers.add_parser(
      "ctr", help="train the pCTR model (seed 001 App. D.1.1) with DP-SGD/FEST/AdaFEST",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add = parser.add_argument
  defaults = CTRTrainOptions  # one source for the defaults of the CLI and the Python API
  add("--data", required=True, help="directory of Criteo TSV day_N files, or a Beam output dir")
  add("--algorithm", choices=ALGORITHMS, default=defaults.algorithm, help="training algorithm")
  add("--epsilon", type=float,
      help="privacy budget ε, the total: what --ledger spent on this data before (e.g. a DP "
           "top-k vocabulary) is composed in (required unless non_private)")
  add("--delta", type=float,
      help="δ (default: the --ledger's if it exists, else 1/N, N = training rows)")
  add("--batch-size", type=int, default=defaults.batch_size,
      help="expected (Poisson) batch size B")
  add("--steps", type=int, default=defaults.steps, help="training steps T")
  add("--ratio", type=float, default=defaults.ratio, help="DP-AdaFEST noise ratio r = σ1/σ2")
  add("--threshold", type=float, default=defaults.threshold,
      help="DP-AdaFEST threshold τ on noisy counts")
  add("--contribution-clip", type=float, default=defaults.contribution_clip,
      help="DP-AdaFEST contribution clip C1")
  add("--l2-norm-clip", type=float, default=defaults.l2_norm_clip,
      help="per-example gradient clip C2 (default 10: at 1 every example is clipped, the "
           "clipped gradient points at the label median instead of the mean and the DP model "
           "ends worse calibrated than the base rate)")
  add("--learning-rate", type=float, default=defaults.learning_rate,
      help="learning rate (the default suits --optimizer adam at C2 = 10; larger steps let "
           "the noise drive the logits away)")
  add("--optimizer", choices=sorted(OPTIMIZERS), default=defaults.optimizer,
      help="row-sparse optimizer applying the noisy gradient (adam = lazy Adam; adambc = "
           "DP-AdamBC, seed 002: Adam with the noise variance subtracted)")
  add("--adambc-floor", type=float, default=defaults.adambc_floor,
      help="γ' of --optimizer adambc: floor of the corrected second moment")
  add("--logit-init", choices=LOGIT_INITS, default=defaults.logit_init,
      help="base_rate: the logit layer starts at zero weights and the bias at the logit of the "
           "training click rate (DP: a Gaussian estimate charged to the ledger), so the "
           "untrained model predicts the base rate; default: Keras' Glorot init (p ≈ 0.5)")
  add("--base-rate-share", type=float, default=defaults.base_rate_share,
      help="share of --epsilon the DP base rate is calibrated for (composed with training in "
           "the accountant, so it costs training far less)")
  add("--top-k", type=int, help="DP-FEST / DP-AdaFEST+: rows kept over all tables (k/F each)")
  add("--top-k-epsilon", type=float, default=defaults.top_k_epsilon,
      help="pure ε of the DP top-k (Gumbel) selection, deducted from --epsilon; 0 = treat "
           "the training counts as public")
  add("--fixed-batches", action="store_true",
      help="fixed-size shuffled batches instead of Poisson sampling (ledger flags it)")
  add("--ledger", help="privacy ledger JSON file (default: a temporary one)")
  add("--summary-json", help="also write the JSON summary to this file")
  add("--accountant", choices=("pld", "rdp"), default=defaults.accountant,
      help="privacy accountant")
  add("--vocab", help="directory of a saved (public) CriteoVocabulary instead of building one")
  add("--vocab-min-count", type=int, default=defaults.vocab_min_count,
      help="min count of an id kept in the vocabulary")
  add("--hidden-units", type=_int_list, default=defaults.hidden_units,
      help="comma-separated Dense(relu) widths (App. D.1.1: 598,598,598,598)")
  add("--eval-batch-size", type=int, default=defaults.eval_batch_size,
      help="batch size of the evaluation")
  add("--charge-every", type=int, default=defaults.charge_every,
      help="steps prepaid per ledger charge")
  add("--log-dir", help="TensorBoard directory (loss, AUC, ε, gradient size)")
  add("--seed", type=int, default=defaults.seed,
      help="seed of initialisation only (public); noise and batches come from a secret key")
  add("--insecure-noise-seed", type=int, metavar="N",
      help="derive noise, batches and DP top-k draws from N: reproducible, NOT private (the "
           "summary and ledger say so)")
  add("--run-dir", metavar="DIR",
      help="keep the run's id, secret noise key (DIR/secret: keep it private) and ledger here")
  add("--diagnostics", action="store_true",
      help="also report non-private diagnostics (exact training loss/AUC), labelled so")
  add("--no-progress", action="store_true", help="no progress bar")
  parser.set_defaults(func=run)


def run(args) -> dict:
  fields = {f.name for f in dataclasses.fields(CTRTrainOptions)}
  values = {key: value for key, value in vars(args).items() if key in fields}
  return train_ctr(CTRTrainOptions(progress=not args.no_progress, **values))
