"""The δ a batch cap costs (`dprec.privacy.truncation`): the chance some step's Poisson batch
exceeds B_max equals a brute-force sum over every inclusion pattern and exact Binomial
arithmetic; the smallest cap the plan allows is the smallest affordable one; a plan with a cap
calibrates a larger σ and reports a larger ε at the same σ."""
import dataclasses
import itertools
import math
from fractions import Fraction

import pytest

from dprec.errors import DprecError
from dprec.privacy import truncation
from dprec.workflows import plan as plan_lib


def test_the_exceed_probability_equals_a_brute_force_sum_over_inclusion_patterns():
  # N = 4 training examples: a neighbour has at most 5; T = 2 steps, q = 1/3, B_max = 2.
  examples, steps, q, cap = 5, 2, Fraction(1, 3), 2
  exceeds = Fraction(0)
  for pattern in itertools.product((0, 1), repeat=examples * steps):
    sizes = [sum(pattern[t * examples:(t + 1) * examples]) for t in range(steps)]
    chance = math.prod(q if bit else 1 - q for bit in pattern)
    exceeds += chance if max(sizes) > cap else 0
  assert truncation.exceed_probability(examples - 1, float(q), steps, cap) == pytest.approx(
      float(exceeds), rel=1e-12)


@pytest.mark.parametrize("n, q, steps, cap", [(600, 0.02, 300, 30), (300, 0.1, 40, 50)])
def test_the_exceed_probability_equals_exact_binomial_arithmetic(n, q, steps, cap):
  exact_q = Fraction(q).limit_denominator(100)
  tail = sum(math.comb(n + 1, k) * exact_q ** k * (1 - exact_q) ** (n + 1 - k)
             for k in range(cap + 1, n + 2))
  exceeds = 1 - (1 - tail) ** steps
  assert truncation.exceed_probability(n, float(exact_q), steps, cap) == pytest.approx(
      float(exceeds), rel=1e-9)
  assert truncation.truncation_delta(n, float(exact_q), steps, cap, 1.5) == pytest.approx(
      (1 + math.exp(1.5)) * float(exceeds), rel=1e-9)


def test_the_smallest_cap_is_the_smallest_affordable_one_and_a_lower_one_is_refused():
  n, q, steps, epsilon, delta = 10_000, 0.01, 300, 1.0, 1e-4
  allowed = truncation.MAX_DELTA_SHARE * delta
  cap = truncation.smallest_max_batch_size(n, q, steps, epsilon, allowed)
  assert truncation.truncation_delta(n, q, steps, cap, epsilon) <= allowed
  assert truncation.truncation_delta(n, q, steps, cap - 1, epsilon) > allowed
  assert truncation.checked_delta(n, q, steps, cap, epsilon, delta) <= allowed
  with pytest.raises(DprecError, match=f"the plan allows a cap of at least {cap}$"):
    truncation.checked_delta(n, q, steps, cap - 1, epsilon, delta)


def test_a_capped_plan_charges_its_delta_a_larger_sigma_and_a_larger_epsilon_at_equal_sigma():
  exact = plan_lib.plan_privacy(1.0, 1e-4, 10_000, 100, 300, accountant="rdp")
  capped = plan_lib.plan_privacy(1.0, 1e-4, 10_000, 100, 300, accountant="rdp",
                                 max_batch_size=170)
  assert capped.truncation_delta == truncation.truncation_delta(10_000, 0.01, 300, 170, 1.0) > 0
  assert capped.noise_multiplier > exact.noise_multiplier
  assert capped.planned_epsilon() == pytest.approx(1.0, rel=1e-3)
  same_sigma = dataclasses.replace(capped, noise_multiplier=exact.noise_multiplier)
  assert same_sigma.planned_epsilon() > exact.planned_epsilon()
  assert any("truncated to 170 rows" in note for note in capped.notes)
  with pytest.raises(DprecError, match="fixed-size batches have B rows"):
    plan_lib.plan_privacy(1.0, 1e-4, 10_000, 100, 300, poisson=False, max_batch_size=170)
