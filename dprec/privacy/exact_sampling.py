"""Exact sampling from uniform random digits: the standard normal to a fixed number of binary
places, and geometric gaps whose rate is irrational.

No floating-point value ever stands for a random variable here. A uniform deviate in [0, 1) is a
*u-rand* (Karney): its binary digits are drawn only as far as a comparison needs them, so every
decision is the one the real-valued deviate would make, and the output distributions are exact
(not within rounding of the target). Arrays of samples are processed together (numpy), with the
rare comparisons that need more than one digit resolved element by element.

`floor_normal(n, places)` returns M = ⌊2^places · N⌋ for N ~ N(0, 1), the sign a fair bit and
|N| in two exact stages:
  1. its bin j of width w = 2^−6 by inversion: the number of CDF values
     F_i = Pr[|N| < i·w] = erf(i·w/√2) below U, a u-rand, read from a table of the F_i's first 64
     bits (`_half_normal_bins`, computed once in 256-bit mpmath); U's 64-bit prefix decides
     unless it equals a table entry (probability 2^−64), and then U and F_i are refined together;
  2. inside the bin, x = (j + u)·w for a u-rand u, accepted with probability
     φ(x)/φ(j·w) = exp(−c·u(u + 2j)), c = w²/2, by von Neumann's alternating-run method
     (Karney 2016's algorithm B with its rational factor replaced by c: mostly one comparison);
     a rejected u is redrawn in the same bin, so x has exactly the conditional law of |N| there.
Beyond 40 (probability 10^−349) |N| comes from Karney's algorithm N ("Sampling exactly from the
normal distribution", ACM TOMS 42(1), 2016, §3) by rejection, `karney_floor_normal`:
  k ≥ 0 with probability e^(−k/2)(1 − e^(−1/2)) (Bernoulli(e^(−1/2)) trials until failure);
  accepted with probability e^(−k(k−1)/2); x a u-rand accepted with probability e^(−x(x+2k)/2)
  (k + 1 trials of algorithm B); |N| = k + x. Bernoulli(e^(−1/2)) is von Neumann's method: the
  longest run 1/2 > U1 > U2 > … has even length.

`geometric(n, rate, cap)` returns G with Pr[G ≥ g] = (1 − p)^g, i.e. G = ⌊−ln U / c⌋ with
c = −ln(1 − p) held to 256 bits (`Rate`): U is refined until the floor is certain. The fast path
decides in float64 only when the answer is the same under a relative perturbation of 2^−40
(thousands of times libm's error bound of a few units in 2^−52); the rest are decided in mpmath
at 256 bits.
"""
import functools
import math

import mpmath
import numpy as np

PRECISION = 256  # bits of the mpmath arithmetic of `Rate` and the geometric slow path
_FAST_MARGIN = 2.0 ** -40  # relative slack of the float64 fast path of `geometric`
_SLOW_MARGIN = mpmath.mpf(2) ** -200  # relative slack of its mpmath slow path


BIN_BITS = 6  # |N| is first placed in a bin of width 2^−6 by exact inversion
TABLE_END = 40  # ... of Pr[|N| < i/2^BIN_BITS] for bins below 40 (beyond: Karney, 10^−349)


def _check_places(places):
  if not 0 <= places <= 40:
    raise ValueError(f"places must be in [0, 40], got {places}")


def _half_normal_cdf(i):
  """Pr[|N| < i/2^BIN_BITS] = erf(i/(2^BIN_BITS·√2)) at the current mpmath precision."""
  return mpmath.erf(mpmath.mpf(i) / (2 ** BIN_BITS * mpmath.sqrt(2)))


@functools.lru_cache(maxsize=1)
def _half_normal_bins():
  """⌊2^64·Pr[|N| < i/2^BIN_BITS]⌋ for i = 1 … TABLE_END·2^BIN_BITS (uint64): a 64-bit prefix
  p of U below entry i puts U below the irrational CDF value, above it above, and equal to it
  (probability 2^−64) leaves it to `_bin_exact`."""
  with mpmath.workprec(PRECISION):
    scale = mpmath.mpf(2) ** 64
    bins = [int(mpmath.floor(_half_normal_cdf(i) * scale))
            for i in range(1, TABLE_END * 2 ** BIN_BITS + 1)]
  return np.array([min(b, 2 ** 64 - 1) for b in bins], np.uint64)


@functools.lru_cache(maxsize=1)
def _slot_starts():
  """For each 16-bit slot t, the number of table entries below t·2^48 (length 2^16 + 1)."""
  bins = _half_normal_bins()
  starts = np.searchsorted(bins, np.arange(2 ** 16, dtype=np.uint64) << np.uint64(48))
  return np.append(starts, bins.size)


def _entries_below(bins, prefix):
  """np.searchsorted(bins, prefix, "left"), through the 16-bit slot of each prefix: a slot
  holds at most one entry except near U = 1 (|N| > 4.4), searched in full there."""
  slot = (prefix >> np.uint64(48)).astype(np.intp)
  starts = _slot_starts()
  low, high = starts[slot], starts[slot + 1]
  count = low + ((high > low) & (bins[np.minimum(low, bins.size - 1)] < prefix))
  crowded = np.flatnonzero(high - low > 1)
  count[crowded] = np.searchsorted(bins, prefix[crowded], side="left")
  return count


class _URands:
  """u-rands: the first digit of each, and further digits (only after a tie) by id."""

  def __init__(self, first, ids):
    self.first, self.ids = first, ids

  def take(self, index):
    return _URands(self.first[index], self.ids[index])

  def put(self, index, other):
    self.first[index], self.ids[index] = other.first, other.ids


class _Sampler:
  """Exact samplers over `source.words(n)` (uint64 from a CSPRNG stream). `digit_bits` is the
  width of a u-rand digit, cut from half a word: 32 in use (a tie between two digits has
  probability 2^−32 and is resolved digit by digit); tests use 1 bit, so that ties are frequent."""

  def __init__(self, source, digit_bits=32):
    if not 1 <= digit_bits <= 32:
      raise ValueError(f"digit_bits must be in [1, 32], got {digit_bits}")
    self.source, self.digit_bits = source, digit_bits
    self._extra = {}  # u-rand id -> its digits after the first (drawn on ties only)
    self._next_id = 0

  # ------------------------------------------------------------------ random digits, integers
  def _digits(self, n):
    halves = self.source.words((n + 1) // 2).view(np.uint32)[:n].astype(np.uint64)
    return halves >> np.uint64(32 - self.digit_bits)

  def _fresh(self, n):
    ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
    self._next_id += n
    return _URands(self._digits(n), ids)

  def _digit(self, uid, position):
    """Digit `position` (≥ 1) of u-rand `uid`, drawn when first asked for."""
    digits = self._extra.setdefault(int(uid), [])
    while len(digits) < position:
      digits.append(int(self._digits(1)[0]))
    return digits[position - 1]

  def bits(self, n):
    """n fair bits."""
    words = self.source.words((n + 63) // 64)
    return np.unpackbits(words.view(np.uint8))[:n].astype(bool)

  def below(self, modulus):
    """Uniform integers in [0, modulus[i]) (uint64 moduli ≥ 1), by rejection of 64-bit words."""
    modulus = np.asarray(modulus, dtype=np.uint64)
    out = np.empty(modulus.shape, np.uint64)
    todo = np.arange(modulus.size)
    while todo.size:
      m = modulus[todo]
      words = self.source.words(todo.size)
      # Accept words below the largest multiple of m that fits in 2^64: (2^64 mod m) = (−m) mod m.
      ok = words <= np.uint64(2 ** 64 - 1) - (np.uint64(0) - m) % m
      out[todo[ok]] = words[ok] % m[ok]
      todo = todo[~ok]
    return out

  # ------------------------------------------------------------------ u-rand comparisons
  def _less_fresh(self, than, index):
    """Fresh u-rands z for elements `index` of `than`, and whether z < than[index]."""
    z = self._fresh(index.size)
    y_first, y_ids = than.first[index], than.ids[index]
    less = z.first < y_first
    for i in np.flatnonzero(z.first == y_first):  # probability 2^−digit_bits each
      position = 1
      while True:
        a, b = self._digit(z.ids[i], position), self._digit(y_ids[i], position)
        if a != b:
          less[i] = a < b
          break
        position += 1
    return z, less

  # ------------------------------------------------------------------ Karney's algorithm N
  def _exp_half(self, n):
    """n independent Bernoulli(e^(−1/2)) (von Neumann; Karney's ExpProbH)."""
    result = np.ones(n, bool)
    start = self._fresh(n)
    below_half = (start.first >> np.uint64(self.digit_bits - 1)) == 0  # 1/2 > U1
    active = np.flatnonzero(below_half)
    previous, run = start, np.ones(n, np.int64)
    while active.size:
      z, less = self._less_fresh(previous, active)
      stopped = active[~less]
      result[stopped] = run[stopped] % 2 == 0
      active = active[less]
      previous.put(active, z.take(less))
      run[active] += 1
    return result

  def _all_exp_half(self, counts):
    """True with probability e^(−counts[i]/2): counts[i] Bernoulli(e^(−1/2)) trials."""
    ok = np.ones(counts.size, bool)
    remaining = counts.astype(np.int64).copy()
    active = np.flatnonzero(remaining > 0)
    while active.size:
      ok[active] = self._exp_half(active.size)
      remaining[active] -= 1
      active = active[ok[active] & (remaining[active] > 0)]
    return ok

  def _karney_b(self, x, k):
    """Algorithm B for every element: true with probability e^(−x(x+2k)/(2k+2)).

    n is the longest run x > U1 > … > Un whose every Vi < (x+2k)/(2k+2); the result is n even.
    Vi's test: with probability 2k/(2k+2) it passes, with 1/(2k+2) it fails, else (1/(2k+2))
    it is a fresh u-rand < x."""
    def vi_passes(active, going):
      choice = self.below(2 * k[active].astype(np.uint64) + 2).astype(np.int64)
      twice_k = 2 * k[active]
      going &= choice != twice_k + 1
      compare = np.flatnonzero(going & (choice == twice_k))
      if compare.size:
        going[compare] = self._less_fresh(x, active[compare])[1]
      return going
    return self._even_run(x, vi_passes)

  def _even_run(self, start, vi_passes):
    """von Neumann's run start > U1 > … > Un, extended while each Vi passes: whether n is even,
    per element. `vi_passes(active, going)` is called once per round, after the fresh Ui are
    compared (`going`: Ui below the previous one, for the elements `active`), and returns
    `going` with the elements whose Vi fails cleared."""
    n = start.first.size
    result = np.zeros(n, bool)
    previous = _URands(start.first.copy(), start.ids.copy())
    run = np.zeros(n, np.int64)
    active = np.arange(n)
    while active.size:
      z, going = self._less_fresh(previous, active)
      going = vi_passes(active, going)
      stopped = active[~going]
      result[stopped] = run[stopped] % 2 == 0
      active = active[going]
      previous.put(active, z.take(going))
      run[active] += 1
    return result

  def floor_normal(self, n, places):
    """M = ⌊2^places · N⌋, N ~ N(0, 1), exactly (int64; places ≤ 40): |N| by table inversion and
    rejection inside the bin (module docstring), the sign a fair bit."""
    _check_places(places)
    bins = _half_normal_bins()
    magnitude = np.empty(n, np.int64)
    prefix = self.source.words(n)
    j = _entries_below(bins, prefix)  # entries below U for sure (ties: see below)
    for i in np.flatnonzero((j < bins.size) & (bins[np.minimum(j, bins.size - 1)] == prefix)):
      j[i] = self._bin_exact(int(prefix[i]), int(j[i]), int(np.searchsorted(
          bins, prefix[i], side="right")))
    active = np.flatnonzero(j < bins.size)
    while active.size:  # inside bin j: x = (j + u)/2^BIN_BITS, accepted w.p. φ(x)/φ(j/2^BIN_BITS)
      u = self._fresh(active.size)
      accepted = self._bin_accept(u, j[active])
      done = active[accepted]
      if places >= BIN_BITS:
        magnitude[done] = ((j[done] << (places - BIN_BITS))
                           + self._leading_bits(u.take(accepted), places - BIN_BITS))
      else:  # ⌊(j + u)/2^d⌋ = ⌊j/2^d⌋ for 0 ≤ u < 1
        magnitude[done] = j[done] >> (BIN_BITS - places)
      active = active[~accepted]
    tail = np.flatnonzero(j == bins.size)  # |N| ≥ TABLE_END: probability 10^−349
    while tail.size:
      draw = self._karney_magnitudes(tail.size, places)
      beyond = draw >= TABLE_END << places
      magnitude[tail[beyond]] = draw[beyond]
      tail = tail[~beyond]
    # ⌊−2^p|N|⌋ = −⌊2^p|N|⌋ − 1: 2^p|N| is an integer with probability 0.
    return np.where(self.bits(n), -magnitude - 1, magnitude)

  def _bin_accept(self, u, j):
    """True w.p. exp(−c·u(u + 2j)), c = 2^−(2·BIN_BITS+1) (= φ(x)/φ(left end) in bin j):
    von Neumann's run u > U1 > … > Un with every Vi < c(u + 2j), accepted when n is even.
    Vi's test reads I = ⌊2^(2·BIN_BITS+1)·Vi⌋: I < 2j passes, I > 2j fails, I = 2j compares the
    rest of Vi (a fresh u-rand) with u."""
    def vi_passes(active, going):
      tested = np.flatnonzero(going)
      whole = (self.source.words(tested.size) >> np.uint64(63 - 2 * BIN_BITS)).astype(np.int64)
      twice_j = 2 * j[active[tested]]
      passes = whole < twice_j
      ties = np.flatnonzero(whole == twice_j)
      if ties.size:
        passes[ties] = self._less_fresh(u, active[tested[ties]])[1]
      going[tested] = passes
      return going
    return self._even_run(u, vi_passes)

  def _bin_exact(self, prefix, low, high):
    """The bin of U when its 64-bit `prefix` ties table entries low..high−1: U refined 64 bits
    at a time against Pr[|N| < i/2^BIN_BITS] in mpmath until the count of entries ≤ U is sure."""
    places = 64
    while low < high:
      prefix = (prefix << 64) | int(self.source.words(1)[0])
      places += 64
      with mpmath.workprec(places + 64):
        scale, slack = mpmath.mpf(2) ** places, mpmath.mpf(2) ** -40
        below = equal = 0
        for i in range(low, high):
          value = _half_normal_cdf(i + 1) * scale
          if mpmath.floor(value + slack) < prefix:
            below += 1
          elif mpmath.floor(value - slack) <= prefix:
            equal += 1
      low, high = low + below, low + below + equal
    return low

  def karney_floor_normal(self, n, places):
    """M = ⌊2^places · N⌋ by Karney's algorithm alone (the tail sampler of `floor_normal`)."""
    _check_places(places)
    negative = self.bits(n)
    magnitude = self._karney_magnitudes(n, places)
    return np.where(negative, -magnitude - 1, magnitude)

  def _karney_magnitudes(self, n, places):
    """⌊2^places·|N|⌋ from Karney's algorithm N (module docstring)."""
    out = np.empty(n, np.int64)
    todo = np.arange(n)
    while todo.size:
      m = todo.size
      k = np.zeros(m, np.int64)  # step 1
      active = np.arange(m)
      while active.size:
        success = self._exp_half(active.size)
        active = active[success]
        k[active] += 1
      accepted = self._all_exp_half(k * (k - 1))  # step 2
      candidates = np.flatnonzero(accepted)
      x = self._fresh(candidates.size)  # step 3: k + 1 trials of algorithm B
      kc = k[candidates]
      trial = np.zeros(candidates.size, np.int64)
      alive = np.ones(candidates.size, bool)
      pending = np.flatnonzero(trial <= kc)
      while pending.size:
        alive[pending] = self._karney_b(x.take(pending), kc[pending])
        trial[pending] += 1
        pending = pending[alive[pending] & (trial[pending] <= kc[pending])]
      done = np.flatnonzero(alive)
      if kc[done].size and kc[done].max() >= 2 ** 22:
        raise OverflowError("a normal deviate beyond 2^22 (probability below e^(-2^43))")
      out[todo[candidates[done]]] = (kc[done] << places) + self._leading_bits(x.take(done),
                                                                               places)
      todo = np.delete(todo, candidates[done])
    return out

  def _leading_bits(self, urands, places):
    """⌊2^places · x⌋ of u-rands x: the first digits, read where ties drew them, else fresh."""
    digits = max(1, -(-places // self.digit_bits))
    value = urands.first.copy()
    drawn = np.isin(urands.ids, np.fromiter(self._extra, np.int64, len(self._extra)))
    for position in range(1, digits):
      digit = self._digits(value.size)
      for i in np.flatnonzero(drawn):  # u-rands that tied: their own further digits
        digit[i] = self._digit(urands.ids[i], position)
      value = (value << np.uint64(self.digit_bits)) | digit
    return (value >> np.uint64(digits * self.digit_bits - places)).astype(np.int64)

  # ------------------------------------------------------------------ geometric gaps
  def geometric(self, n, rate, cap):
    """G with Pr[G ≥ g] = (1 − p)^g for `rate` (a `Rate`), as min(G, cap) (int64)."""
    words = self.source.words(n)
    # U ∈ [lo, lo + 2^−53): its first 53 bits (exact in float64); E = −ln U ∈ (−ln hi, −ln lo].
    lo = (words >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    with np.errstate(divide="ignore"):
      e_hi = -np.log(lo)
    e_lo = -np.log(lo + 2.0 ** -53)
    c = float(rate.log_keep)
    g_lo = np.floor(np.minimum(e_lo * (1 - _FAST_MARGIN) / (c * (1 + _FAST_MARGIN)), cap))
    g_hi = np.floor(np.minimum(e_hi * (1 + _FAST_MARGIN) / (c * (1 - _FAST_MARGIN)), cap))
    out = g_lo.astype(np.int64)
    for i in np.flatnonzero(g_lo != g_hi):
      out[i] = self._geometric_exact(int(words[i]), rate.log_keep, cap)
    return out

  def _geometric_exact(self, prefix, log_keep, cap):
    """⌊−ln U / c⌋ capped, U's first 64 bits `prefix`, refined 64 bits at a time in mpmath."""
    places = 64
    with mpmath.workprec(PRECISION):
      while True:
        scale = mpmath.mpf(2) ** -places
        candidates = []
        for end, margin in ((prefix + 1, 1 - _SLOW_MARGIN), (prefix, 1 + _SLOW_MARGIN)):
          if end == 0:
            candidates.append(cap)
            continue
          quotient = -mpmath.log(end * scale) * margin / log_keep
          candidates.append(min(int(mpmath.floor(quotient)), cap))
        if candidates[0] == candidates[1]:
          return candidates[0]
        prefix = (prefix << 64) | int(self.source.words(1)[0])
        places += 64


class Rate:
  """A Bernoulli rate p ∈ (0, 1) for geometric gaps, with c = −ln(1 − p) to `PRECISION` bits.
  `Rate(p)`: p a float (taken as the exact binary fraction it is); `Rate.gaussian_tail(θ)`:
  p = Pr[N(0, 1) ≥ θ] for a binary fraction θ."""

  def __init__(self, probability):
    with mpmath.workprec(PRECISION):
      self._set(mpmath.mpf(probability))

  def _set(self, probability):
    if not 0 < probability < 1:
      raise ValueError(f"a rate must be in (0, 1), got {probability}")
    self.probability = float(probability)
    self.log_keep = -mpmath.log1p(-probability)

  @classmethod
  def gaussian_tail(cls, threshold):
    rate = cls.__new__(cls)
    with mpmath.workprec(PRECISION):
      rate._set(mpmath.erfc(mpmath.mpf(threshold) / mpmath.sqrt(2)) / 2)
    return rate

  def __float__(self):
    return self.probability

  def __repr__(self):
    return f"Rate({self.probability!r})"


def bernoulli_positions(sampler, length, rate):
  """Sorted positions of the ones among `length` i.i.d. Bernoulli(p) bits (`rate` a `Rate`),
  from exact geometric gaps, drawn in chunks until they pass the end."""
  length = int(length)
  if length <= 0:
    return np.zeros([0], np.int64)
  mean = length * rate.probability
  chunk = int(math.ceil(mean + 6.0 * math.sqrt(mean) + 16.0))
  found, last = [], -1
  while last < length - 1:
    gaps = sampler.geometric(chunk, rate, length)
    positions = last + np.cumsum(gaps + 1)
    found.append(positions[positions < length])
    last = int(positions[-1])
  return np.concatenate(found)
