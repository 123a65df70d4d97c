"""`train seqrec --model auto`: item2item or the transformer, chosen by a paid validation test.

Budgets are shares of μ*², the Gaussian budget: μ* = 1/σ* of the one Gaussian mechanism
(sensitivity 1) that meets the run's (ε, δ/2); Gaussian mechanisms at σ_k of sensitivity-1
queries compose exactly as one at μ = √(Σ_k 1/σ_k²) (Dong, Roth & Su, "Gaussian Differential
Privacy", JRSS-B 2022, Cor. 3.3).

Stage 1 (every run). item2item's releases (`dprec.workflows.item2item`), its budget the rest of
μ*² after the test's `TEST_SHARE`, split between its DP histogram of users per item and its
pair release as `--model item2item` splits them: the histogram at its whole share (it picks the
item set, which a top-up cannot change: docs/experiments/seqrec_auto.md), the pair release at
`model_choice_share` s of its share (so its noise is 1/√s times larger than alone), dense over
the item set (`item_pairs.noisy_dense`); then the noisy validation difference

    D = Σ_u [NDCG@10_u(item2item of stage 1) − NDCG@10_u(most popular by the same DP histogram)]
        + N(0, σ_t²)

over the users with a validation item, σ_t at `TEST_SHARE` of μ*². The two models are released
outputs and each user's term is in [−1, 1], so adding or removing a user moves D by at most 1:
the Gaussian mechanism with noise multiplier σ_t. item2item is chosen when D > 0, else the
transformer.

Branch A (item2item): a top-up of the pair release on the same cells (the same item set: it is
the stage-1 histogram's, post-processing) at the rest of its share, 1 − s, combined with stage 1
by inverse-variance weighting (`item_pairs.combine`): two Gaussian releases of one query at σ1,
σ2 combined are exactly one at 1/σ² = 1/σ1² + 1/σ2². The model is item2item at
(1 − `TEST_SHARE`)·μ*², thresholded at the combined σ.

Branch B (the transformer, with `TRANSFORMER_SETTINGS` where its options are at their defaults):
its own DP histogram and DP steps, σ calibrated so that stage 1 (one Gaussian at its share of
μ*²) composed with them in the accountant meets (ε, δ/2).

Accounting: the branch is chosen adaptively (from D), so the run is composed by a union over
the branches. For neighbouring data sets with output densities p and q of the whole run,
δ_run(ε) = ∫ max(0, p − e^ε q). The outputs fall in two disjoint regions, R_A (item2item chosen)
and R_B; on R_b the run's output is the output of the fixed, non-adaptive composition "stage 1
then branch b" (which on R_b runs branch b), and the integrand is non-negative, so
∫_{R_b} max(0, p − e^ε q) ≤ δ_{1∘b}(ε) and δ_run(ε) ≤ δ_{1∘A}(ε) + δ_{1∘B}(ε). Each term is a
composition the accountant computes (PLD by default): branch A is one Gaussian at μ*, branch B
stage 1's Gaussian with the transformer's releases; each is planned so that δ_{1∘b}(ε) ≤ δ/2.
The ledger records the run as one (ε, δ_{1∘A}(ε) + δ_{1∘B}(ε)) release under `LABEL`, paid
before stage 1 releases anything and composed with the ledger's other charges by basic
composition, as every (ε, δ) charge (`dprec.privacy.composition`). The releases are not charged
one by one: the branch taken, charged alone, would claim δ_{1∘b}, which does not bound the
adaptive run. With charges on the ledger before the run, (ε, δ) is what they leave by that
composition (`run_budget`): ε less their selections' ε and their Gaussian periods' ε at half of
the δ their selections leave (the run takes the other half; all of it without periods).
"""
import dataclasses
import math
from typing import Callable, Optional

import numpy as np

from dprec import privacy
from dprec.errors import BudgetExceededError, DprecError
from dprec.models.item2item import Item2ItemModel
from dprec.privacy import item_pairs, user_histogram
from dprec.workflows import item2item as item2item_lib
from dprec.workflows import item_frequencies as frequencies_lib
from dprec.workflows import plan as plan_lib

AUTO = "auto"
LABEL = "train seqrec model choice"
CANDIDATES = ("item2item", "dpformer")
MAX_ITEM_SET = 5000  # the dense pair releases: (K + 1)² cells each
TEST_SHARE = 0.02  # of μ*²: σ_t = 7.1/μ* (docs/experiments/seqrec_auto.md: D against σ_t)
# Ding et al. 2023, App. A.9 (MovieLens): 100 epochs, normalised gradients at C = 1, dropout
# 0.2; the learning rate is 5e-3 from the paper's grid (the warm-up and decay are
# `dprec.models.seqrec.warmup_linear_decay`'s).
TRANSFORMER_SETTINGS = {"epochs": 100.0, "learning_rate": 5e-3, "dropout": 0.2,
                        "normalization_offset": 0.01}
# The noise key's purposes of the stage-1 and top-up releases (never another release's).
NOISE = {"histogram": "model choice item histogram", "pairs": "model choice item pairs",
         "test": "model choice validation test", "top-up pairs": "model choice top-up item pairs"}


def candidates(options):
  """The options `--model auto` may resolve to (each must be valid before anything is
  released, so that a refusal never depends on the release)."""
  return [_resolved(options, model) for model in CANDIDATES]


def _resolved(options, model):
  changes = {"model": model, "auto_model": True}
  if model == "dpformer":
    defaults = type(options)()
    changes.update({key: value for key, value in TRANSFORMER_SETTINGS.items()
                    if getattr(options, key) == getattr(defaults, key)})
  return dataclasses.replace(options, **changes)


def check_data(examples):
  """Refuses data without validation items (the test scores them), before anything is paid."""
  if examples.valid_histories is None or not len(examples.valid_items):
    raise DprecError("--model auto chooses on the validation items and the data has none: "
                     "preprocess with a validation item, or name the model (--model)")


@dataclasses.dataclass(frozen=True)
class AutoPlan:
  """The run's budget (ε, δ), the Gaussian budget μ* (at ε, δ/2), the histogram's share of
  item2item's μ², the noise multipliers of stage 1 {histogram, pairs, test} and of the top-up
  {pairs}, stage 1's share of μ*², the transformer's plan (branch B) and each branch's δ at
  ε."""
  epsilon: float
  delta: float
  accountant: str
  share: float
  mu: float
  histogram_share: float
  stage: dict
  top_up: dict
  stage_share: float
  transformer: plan_lib.PrivacyPlan
  delta_item2item: float
  delta_transformer: float

  @property
  def charge(self):
    """(ε, δ) of the run: δ_{1∘A}(ε) + δ_{1∘B}(ε)."""
    return self.epsilon, self.delta_item2item + self.delta_transformer

  def summary(self):
    return {"epsilon": self.epsilon, "delta": self.charge[1],
            "delta_item2item_branch": self.delta_item2item,
            "delta_transformer_branch": self.delta_transformer,
            "gaussian_budget_mu": self.mu, "choice_share_of_pairs": self.share,
            "shares_of_mu_squared": {"stage_1": self.stage_share, "test": TEST_SHARE,
                                     "top_up": 1.0 - self.stage_share},
            "histogram_share_of_item2item": self.histogram_share,
            "noise_multipliers": {"stage_1": self.stage, "top_up": self.top_up,
                                  "transformer_steps": self.transformer.noise_multiplier},
            "transformer_plan": {
                "sampling_rate": self.transformer.sampling_rate, "steps": self.transformer.steps,
                "histogram_noise_multiplier": self.transformer.mechanisms.get(
                    frequencies_lib.LABEL)},
            "composition": "union over the two branches, each branch PLD-composed "
                           "(dprec.workflows.model_choice); one (epsilon, delta) ledger charge",
            "ledger_label": LABEL}


def _noise(mu, share):
  """σ of a sensitivity-1 Gaussian mechanism at `share` of μ²."""
  return 1.0 / (mu * math.sqrt(share))


def run_budget(epsilon, delta, spent, accountant):
  """(ε, δ) the run may spend after `spent` (a `privacy.Spent`), by basic composition (module
  docstring); refuses a budget already spent."""
  left = delta - spent.selection_delta
  run_delta = left / 2 if spent.periods else left
  before = spent.selection_epsilon
  if spent.periods:
    before += privacy.gaussian_epsilon(spent.periods, left - run_delta, accountant)
  if not (left > 0 and epsilon - before > 0):
    raise BudgetExceededError(f"the ledger's earlier charges spent ε {before:.4g} of {epsilon:g} "
                              "on this data: nothing is left for --model auto")
  return epsilon - before, run_delta


def plan(options, num_examples, delta, spent, plan_model: Callable) -> AutoPlan:
  """The `AutoPlan` of a private run at δ after `spent`; `plan_model(options, N, δ, spent)` is
  `train seqrec`'s planner of a named model."""
  epsilon, run_delta = run_budget(options.epsilon, delta, spent, options.accountant)
  branch_delta = run_delta / 2
  mu = 1.0 / privacy.calibrate_gaussian_mechanism(epsilon, branch_delta, options.accountant)
  alone = plan_model(_resolved(options, "item2item"), num_examples, branch_delta,
                     privacy.Spent())
  histogram = alone.mechanisms[frequencies_lib.LABEL] ** -2
  weight = histogram / (histogram + alone.noise_multiplier ** -2)
  share, item2item = options.model_choice_share, 1.0 - TEST_SHARE
  pairs = item2item * (1 - weight)
  stage = {"histogram": _noise(mu, item2item * weight), "pairs": _noise(mu, share * pairs),
           "test": _noise(mu, TEST_SHARE)}
  top_up = {"pairs": _noise(mu, (1 - share) * pairs)}
  stage_share = 1.0 - (1 - share) * pairs
  stage_period = privacy.gaussian_mechanism_period(_noise(mu, stage_share))
  transformer = plan_model(_resolved(options, "dpformer"), num_examples, branch_delta,
                           privacy.Spent(periods=(stage_period,)))
  item2item_periods = [privacy.gaussian_mechanism_period(1.0 / mu)]
  transformer_periods = [stage_period] + [
      privacy.gaussian_mechanism_period(sigma) for sigma in transformer.mechanisms.values()] + [
      privacy.TrainingPeriod(transformer.noise_multiplier, transformer.sampling_rate,
                             transformer.steps, transformer.poisson)]
  return AutoPlan(
      epsilon, run_delta, options.accountant, share, mu, weight, stage, top_up, stage_share,
      transformer,
      privacy.gaussian_delta(item2item_periods, epsilon, options.accountant),
      privacy.gaussian_delta(transformer_periods, epsilon, options.accountant))


def pay(budget, auto: AutoPlan):
  """Charges the run, once, as one (ε, δ) release under `LABEL` (a resumed run has paid it);
  the ledger refuses it, recording nothing, over its budget."""
  budget.pay_once(auto.transformer, {LABEL: auto.charge}, mechanisms={})


@dataclasses.dataclass
class StageOne:
  """Stage 1's releases (raw noisy counts of users per item, the dense noisy pairs over `ids`,
  the item set with 0 first) and the noisy D; the exact pair statistics over `ids` for the
  top-up (not released)."""
  counts: np.ndarray
  pairs: np.ndarray
  ids: np.ndarray
  statistics: object
  difference: float
  users: int


def _histogram_rows(options, examples):
  return examples.items[:, -frequencies_lib.histogram_items(options):]


def _popularity(counts, num_users):
  """Users per item from raw noisy counts: `item2item.popularity` of the clamped p_i."""
  return user_histogram.frequencies_of(counts, num_users) * num_users


def _model(options, pairs, sigma, popularity, ids, num_items):
  released = item_pairs.thresholded(pairs, sigma, options.pair_threshold * sigma
                                    * item_pairs.SENSITIVITY)
  matrix = item2item_lib.on_items(released.matrix, ids, num_items)
  return (Item2ItemModel(matrix, popularity, item2item_lib.scoring_config(options)),
          dict(released.summary(), item_set=len(ids) - 1))


def validation_difference(model, popularity, examples, options):
  """(D without noise, users): Σ_u NDCG@10_u(`model`) − NDCG@10_u(most popular by
  `popularity` [M + 1]) over the validation items."""
  from dprec.models import ranking_metrics  # TensorFlow: not when the options are imported
  scores = np.asarray(popularity, np.float32)[1:]
  metrics = ranking_metrics.evaluate_scorings(
      lambda histories: [model.score_items(histories),
                         np.broadcast_to(scores, (len(histories), len(scores)))],
      examples.valid_histories, examples.valid_items,
      ranking_metrics.popularity_buckets(examples.item_frequencies),
      batch_size=options.eval_batch_size, exclude_history=options.exclude_history)
  users = metrics[0]["users"]
  return users * (metrics[0]["ndcg_at_10"] - metrics[1]["ndcg_at_10"]), users


def stage_one(options, examples, auto: AutoPlan, rng: Callable) -> StageOne:
  """Stage 1 at `auto`'s noise, each release from `rng(purpose)` (the run's key, `NOISE`)."""
  options = _resolved(options, "item2item")
  num_users, num_items = len(examples.items), examples.num_items
  counts = user_histogram.noisy_users_per_item(_histogram_rows(options, examples), num_items,
                                               auto.stage["histogram"], rng(NOISE["histogram"]))
  popularity = _popularity(counts, num_users)
  ids = item2item_lib.item_ids(options, popularity, num_items)
  statistics = item2item_lib.pair_statistics(options, examples)[ids][:, ids]
  pairs = item_pairs.noisy_dense(statistics, auto.stage["pairs"], rng(NOISE["pairs"]))
  model, _ = _model(options, pairs, auto.stage["pairs"], popularity, ids, num_items)
  exact, users = validation_difference(model, popularity, examples, options)
  noisy = exact + rng(NOISE["test"]).normal(0.0, auto.stage["test"])
  return StageOne(counts, pairs, ids, statistics, float(noisy), users)


def choose(difference):
  """The model D calls for: item2item when it beats most popular (D > 0)."""
  return "item2item" if difference > 0 else "dpformer"


def top_up(options, examples, auto: AutoPlan, stage: StageOne, rng: Callable):
  """Branch A: (`Item2ItemModel`, the pair release's summary, p_i, the noise multipliers
  {histogram, pairs}) from stage 1's histogram and its pair release combined with the top-up on
  the same cells by inverse variance."""
  num_users, num_items = len(examples.items), examples.num_items
  pairs, pairs_sigma = item_pairs.combine([
      (stage.pairs, auto.stage["pairs"]),
      (item_pairs.noisy_dense(stage.statistics, auto.top_up["pairs"], rng(NOISE["top-up pairs"])),
       auto.top_up["pairs"])])
  model, release = _model(options, pairs, pairs_sigma, _popularity(stage.counts, num_users),
                          stage.ids, num_items)
  return (model, release, user_histogram.frequencies_of(stage.counts, num_users),
          {"histogram": auto.stage["histogram"], "pairs": pairs_sigma})


def resolve(options, examples, auto: Optional[AutoPlan], rng: Callable):
  """(options with the chosen model and `auto_model` set, stage 1 (None without DP), the
  choice's summary). Without DP (`auto` None) D is exact and nothing is charged."""
  if auto is None:
    item2item = _resolved(options, "item2item")
    counts = user_histogram.users_per_item(examples.items, examples.num_items)
    model, _ = item2item_lib.build_model(
        item2item, examples, plan_lib.plan_privacy(math.inf, None, 1, 1, 1), None, None)
    difference, users = validation_difference(model, counts, examples, options)
    stage = None
  else:
    stage = stage_one(options, examples, auto, rng)
    difference, users = stage.difference, stage.users
  model = choose(difference)
  resolved = _resolved(options, model)
  applied = {key: getattr(resolved, key) for key in TRANSFORMER_SETTINGS
             if model == "dpformer" and getattr(resolved, key) != getattr(options, key)}
  return resolved, stage, {
      "model": model, "by": "--model auto",
      "reason": f"validation test: D = {difference:.2f} (item2item's NDCG@10 less most "
                f"popular's, summed over {users} validation users"
                + (", noisy" if auto else ", exact: no DP") + f"): {model}",
      "validation_difference": difference, "validation_users": users,
      "test_noise_std": auto and auto.stage["test"], "test_sensitivity": 1.0,
      "private": auto is not None, "settings_applied": applied,
      **({"privacy": auto.summary()} if auto else {})}


def given(options):
  """The choice's summary when `--model` named the model: nothing released, nothing charged."""
  return {"model": options.model, "by": "--model"}
