"""Privacy ledger charge cost and σ calibration time, against `dp_accounting` used naively.

Table 1: a trainer charges the ledger every `--every` steps (Criteo-Kaggle: q = 2048/N, σ for
ε = 1 over one epoch). dprec's ledger (cached one-step PLD, merged charges, atomic write) against
re-accounting the whole run with a fresh `PLDAccountant` at each charge; ε must agree.
Table 2: σ calibrated for the same target with PLD and with RDP (the noise RDP's looser bound
costs), and the time each calibration takes, against dp_accounting's search on the PLD
accounting grid alone (dprec searches on a 10× coarser grid, then confirms on the fine one),
with CPU seconds (robust to a shared machine) and the load average printed.

  .venv/bin/python benchmarks/privacy_accounting.py --charges 10 --every 500
  .venv/bin/python benchmarks/privacy_accounting.py --charges 0   # the calibration table only
"""
import argparse
import math
import os
import tempfile
import time

import dp_accounting

from dprec import privacy

N = 45_840_617
Q = 2048 / N
DELTA = 1 / N
SIGMA = 0.5765


def _fresh_pld_epsilon(steps):
  accountant = privacy.make_accountant("pld")
  return accountant.compose(privacy.dp_sgd_event(SIGMA, Q, steps)).get_epsilon(DELTA)


def _ledger_table(charges, every):
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    ledger = privacy.PrivacyLedger(os.path.join(directory, "ledger.json"), 10.0, DELTA)
    for i in range(1, charges + 1):
      start = time.perf_counter()
      ours = ledger.charge_gaussian(SIGMA, Q, every, label="epoch 0")
      ours_s = time.perf_counter() - start
      start = time.perf_counter()
      naive = _fresh_pld_epsilon(i * every)
      naive_s = time.perf_counter() - start
      rows.append((i * every, ours, naive, ours_s, naive_s))
  print(f"Ledger charges every {every} steps (sigma {SIGMA}, q {Q:.4g}, delta 1/N)")
  print(f"{'steps':>7} {'eps ledger':>11} {'eps fresh':>11} {'ledger s':>9} {'fresh s':>8} "
        f"{'ratio':>6}")
  for steps, ours, naive, ours_s, naive_s in rows:
    print(f"{steps:>7} {ours:>11.6f} {naive:>11.6f} {ours_s:>9.3f} {naive_s:>8.3f} "
          f"{naive_s / ours_s:>6.1f}")
  later = rows[1:] or rows
  mean_ours = sum(r[3] for r in later) / len(later)
  mean_naive = sum(r[4] for r in later) / len(later)
  print(f"mean after the first charge: ledger {mean_ours:.3f} s, fresh {mean_naive:.3f} s, "
        f"ratio {mean_naive / mean_ours:.1f}x; max |eps diff| "
        f"{max(abs(r[1] - r[2]) for r in rows):.2e}")


def _calibration_table():
  steps = math.ceil(N / 2048)
  print("\nCalibration of sigma for eps 1, one epoch of Criteo-Kaggle (delta 1/N, rtol 1e-3)")
  print(f"load average {os.getloadavg()[0]:.1f}")
  print(f"{'search':<28} {'sigma':>8} {'eps at sigma':>13} {'seconds':>8} {'CPU s':>6}")
  rows = [(f"dprec {accountant}", accountant,
           lambda a=accountant: privacy.calibrate_noise_multiplier(1.0, DELTA, Q, steps,
                                                                  accountant=a))
          for accountant in privacy.accounting.ACCOUNTANTS]
  # The yardstick: dp_accounting's search on the accounting grid alone.
  rows.append(("dp_accounting pld, one grid", "pld", lambda: dp_accounting.calibrate_dp_mechanism(
      privacy.make_accountant, lambda s: privacy.dp_sgd_event(s, Q, steps), 1.0, DELTA,
      tol=1e-5)))
  for label, accountant, calibrate in rows:
    start, cpu = time.perf_counter(), time.process_time()
    sigma = calibrate()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    epsilon = privacy.compute_epsilon(sigma, Q, steps, DELTA, accountant=accountant).epsilon
    print(f"{label:<28} {sigma:>8.5f} {epsilon:>13.6f} {seconds:>8.2f} {cpu:>6.2f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--charges", type=int, default=10,
                      help="ledger charges to time (0: skip the ledger table)")
  parser.add_argument("--every", type=int, default=500, help="steps per charge")
  args = parser.parse_args()
  if args.charges > 0:
    _ledger_table(args.charges, args.every)
  _calibration_table()


if __name__ == "__main__":
  main()
