"""`dprec demo`: the end-to-end walkthrough run by `make demo` (generate → account → train).

1. Generates a small Criteo-like dataset (Table 3 vocabularies, `day_0..day_2`; day_2 held out).
2. Privacy calculation: the DP-SGD σ for (ε, δ = 1/N, q, T) and its DP-AdaFEST split σ1 = r·σ2,
   checked by recomputing ε of the composed σ with the DP base rate's and DP Platt scaling's
   Gaussian mechanisms (`dprec.privacy.gaussian_epsilon`).
3. Trains the pCTR model through `dprec train ctr`'s code path twice, non-private (its best step
   on a validation split of the training rows kept, as a tuned baseline would be) and with
   DP-AdaFEST (same data, batches of the same size, same steps), and prints them side by side
   (AUC, log loss beside the constant predictor's at the held-out click rate, ε,
   gradient-size reduction, steps/s) so the cost of privacy shows; returns both JSON summaries.
"""
import dataclasses
import os
import sys

from dprec.cli_help import OptionGroups
from dprec.workflows.ctr_options import CTRTrainOptions

DAYS = 3
VALIDATION_SHARE = 0.1  # of the training rows: the non-private baseline's model selection


def register(subparsers):
  parser = subparsers.add_parser(
      "demo", help="generate a small Criteo-like dataset, account privacy and train on it",
      description="End-to-end demo on a generated Criteo-like dataset: generate, account "
                  "privacy, train non-private and DP-AdaFEST, print them side by side and a "
                  "JSON summary. Takes a few minutes.")
  groups = OptionGroups(parser)
  groups.data.add("--rows", type=int, default=150000, help="synthetic rows to generate")
  groups.data.add("--seed", type=int, default=0,
                  help="seed of the generated data and the initialisation (public)")
  groups.privacy.add("--epsilon", type=float, default=1.0, help="privacy budget ε")
  groups.privacy.add("--insecure-noise-seed", type=int, default=None, metavar="N",
                     help="derive the training noise and batches from N: reproducible, NOT "
                     "private (the summary and ledger say so)")
  groups.training.add("--steps", type=int, default=200, help="training steps of each run")
  groups.training.add("--batch-size", type=int, default=1024,
                      help="expected batch size (0: `train ctr`'s, from the N training rows: the "
                           "power of two nearest N/150)")
  groups.run.add("--out", default="demo_out", help="working directory for generated files")
  parser.set_defaults(func=run)


def demo_options(data_dir: str, out_dir: str, steps: int, batch_size: int, epsilon: float,
                 seed: int, insecure_noise_seed=None) -> CTRTrainOptions:
  """The demo's DP-AdaFEST run with `train ctr`'s defaults: r = 2, τ = 7, C1 = 1 (false
  positives stay rare), C2 = 1, Dense 256-256, lazy Adam at lr 1e-2, logit bias at the DP base
  rate and DP Platt scaling after training."""
  return CTRTrainOptions(
      data=data_dir, algorithm="dp_adafest", epsilon=epsilon, batch_size=batch_size,
      steps=steps, ledger=os.path.join(out_dir, "ledger.json"),
      summary_json=os.path.join(out_dir, "summary.json"), seed=seed, charge_every=100,
      insecure_noise_seed=insecure_noise_seed)


def privacy_calculation(options: CTRTrainOptions, num_examples: int) -> dict:
  """σ, σ1, σ2 for the run and ε recomputed from the composed σ with the DP base rate's and
  DP Platt scaling's Gaussian mechanisms (should equal the target)."""
  from dprec import privacy
  from dprec.workflows import ctr
  plan = ctr.plan_privacy(options, num_examples)
  sigma1, sigma2 = ctr.noise_multipliers(options, plan.noise_multiplier)
  composed = privacy.composed_noise_multiplier(sigma1, sigma2)
  check = privacy.gaussian_epsilon(
      [privacy.gaussian_mechanism_period(sigma) for sigma in plan.mechanisms.values()]
      + [privacy.TrainingPeriod(composed, plan.sampling_rate, options.steps)], plan.delta)
  return {"target_epsilon": options.epsilon, "delta": plan.delta,
          "sampling_rate": plan.sampling_rate, "steps": options.steps,
          "dp_sgd_noise_multiplier": plan.noise_multiplier, "sigma1": sigma1,
          "sigma2": sigma2, "base_rate_noise_multiplier": plan.mechanisms[ctr.BASE_RATE_LABEL],
          "calibration_noise_multiplier": plan.mechanisms.get(ctr.CALIBRATION_LABEL),
          "epsilon_of_composed_sigma": check}


def run(args) -> dict:
  from dprec.data import synthetic
  from dprec.workflows import ctr  # TensorFlow loads here, after the arguments parsed
  data_dir = os.path.join(args.out, "data")
  ledger = os.path.join(args.out, "ledger.json")
  if os.path.exists(ledger):
    os.remove(ledger)  # every demo run is a fresh training run with a fresh budget
  print(f"[1/4] generating {args.rows} Criteo-like rows in {data_dir}", file=sys.stderr)
  generated = synthetic.generate_criteo(data_dir, args.rows, days=DAYS, seed=args.seed)
  print("[2/4] privacy calculation", file=sys.stderr)
  data = ctr.load_data(data_dir)
  options = ctr.sized_for(demo_options(data_dir, args.out, args.steps, args.batch_size or None,
                                       args.epsilon, args.seed, args.insecure_noise_seed),
                          len(data.train["label"]))
  privacy = privacy_calculation(options, len(data.train["label"]))
  print(f"      σ = {privacy['dp_sgd_noise_multiplier']:.4f} → σ1 = {privacy['sigma1']:.4f}, "
        f"σ2 = {privacy['sigma2']:.4f}; ε recomputed = {privacy['epsilon_of_composed_sigma']:.4f}",
        file=sys.stderr)
  print(f"[3/4] training non-private for {options.steps} steps at B = {options.batch_size}",
        file=sys.stderr)
  non_private = ctr.run(non_private_options(options), data)
  print(f"[4/4] training DP-AdaFEST for {options.steps} steps at B = {options.batch_size}",
        file=sys.stderr)
  training = ctr.run(options, data)
  print(side_by_side(non_private, training), file=sys.stderr)
  return {"data": {key: generated[key] for key in ("rows", "days", "files", "ctr")},
          "privacy": privacy, "non_private": non_private, "training": training}


def non_private_options(options: CTRTrainOptions) -> CTRTrainOptions:
  """The DP run's options without privacy (same data, batch size, steps, model, optimizer):
  shuffled batches of the same expected size, no ledger, no clipping or noise; and model
  selection on validation (`VALIDATION_SHARE` of the training rows held out, the weights of the
  best validation log loss kept: `CTRTrainOptions.select_on_validation`), as a non-private
  baseline is tuned in practice (without it, it over-fits its repeated epochs)."""
  return dataclasses.replace(options, algorithm="non_private", epsilon=None, ledger=None,
                             summary_json=None, select_on_validation=VALIDATION_SHARE)


def side_by_side(non_private: dict, private: dict) -> str:
  """A table of the two runs' held-out AUC and log loss (nats), ε, gradient-size reduction and
  training steps/s, with the log loss of the constant predictor at the held-out click rate:
  what privacy costs."""
  rows = [("non-private (best step on validation)", non_private), ("DP-AdaFEST", private)]
  lines = ["| run | AUC | log loss | constant predictor's log loss | ε | gradient-size reduction "
           "| steps/s |", "|---|---:|---:|---:|---:|---:|---:|"]
  for name, s in rows:
    epsilon = "∞" if s["epsilon"] is None else f"{s['epsilon']:.3f}"
    rate = "–" if s["steps_per_second"] is None else f"{s['steps_per_second']:.2f}"
    lines.append(f"| {name} | {s['auc']:.4f} | {s['eval_log_loss']:.4f} | "
                 f"{s['base_rate_log_loss']:.4f} | {epsilon} | "
                 f"{s['gradient_size_reduction']:.1f}× | {rate} |")
  return "\n".join(lines)
