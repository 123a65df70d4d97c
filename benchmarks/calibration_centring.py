"""`train ctr`'s DP Platt scaling: its uncentred feature against `stream`'s centred one.

    dprec synth criteo --rows 150000 --days 3 --seed 0 --out DATA    # `dprec demo`'s data
    python benchmarks/calibration_centring.py --data DATA [--seeds 0 1] [--steps 200]

Each seed trains `dprec demo`'s DP-AdaFEST run (B = 1024, ε = 1, `train ctr`'s defaults) twice
with the noise drawn from the public seed (NOT private), so both runs train the same model and
differ only in the feature DP Platt scaling fits on: `uncentred` (`train ctr`'s: z clipped to
±10) or `centred` (`stream`'s: z − logit(DP base rate) clipped to ±1). Prints held-out log loss
per run (JSON lines).
"""
import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
from unittest import mock

from dprec import demo
from dprec import privacy
from dprec.training import output_layer
from dprec.workflows import ctr


def centred(logits, labels, sigma, rate, rng, **kwargs):
  """`dp_platt_scaling` on `stream`'s feature: z − logit(rate) clipped to ±1."""
  return privacy.dp_platt_scaling(logits, labels, sigma, rate, rng, **kwargs,
                                  center=math.log(rate / (1 - rate)), logit_bound=1.0)


def run(data_dir, seed, steps, centre):
  patch = mock.patch.object(output_layer.privacy, "dp_platt_scaling", centred)
  with tempfile.TemporaryDirectory() as out, patch if centre else contextlib.nullcontext():
    options = dataclasses.replace(  # a fresh ledger for each run
        demo.demo_options(data_dir, out, steps, 1024, 1.0, seed=0, insecure_noise_seed=seed),
        progress=False)
    summary = ctr.run(options)
  return {"seed": seed, "feature": "centred" if centre else "uncentred",
          "eval_log_loss": summary["eval_log_loss"], "auc": summary["auc"],
          "base_rate_log_loss": summary["base_rate_log_loss"],
          "calibration_scale": summary["calibration_scale"],
          "calibration_shift": summary["calibration_shift"]}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", required=True)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args(argv)
  for seed in args.seeds:
    for centre in (False, True):
      print(json.dumps(run(args.data, seed, args.steps, centre)), flush=True)


if __name__ == "__main__":
  sys.exit(main())
