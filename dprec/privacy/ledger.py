"""A persistent privacy ledger: every charge on disk, written atomically, budget enforced.

The file is JSON: the budget, δ, the accountant and the list of charges (mechanism, parameters,
time, ε so far). Each write goes to a temporary file in the same directory, is fsynced and renamed
over the ledger, so a crash leaves either the old or the new ledger, never a torn one. ε is always
recomputed from the charges (Gaussian periods in the accountant, selection charges added: see
`composition`), so a reloaded ledger knows exactly what was spent. One ledger has one writer at a
time; runs that share it stamp their charges with their `run_id`, and a run only ever counts its
own charges as paid (`charges_of`).

A ledger is the budget of one data set. Charges record which one in `dataset` ({"path", "id"}:
the output directory and the id its manifest carries, `dprec.data.identity`), and a
preprocessing job's charges say `stage: "preprocessing"`. A training run composes everything
recorded before its first charge on its data set (`spent_before`), refuses a ledger holding
charges for another data set (`check_dataset`), and reports the parts (`parts`).

A charge may say which `days` of the data set its release read (a row-level stream's period):
charges of disjoint days compose in parallel (`composition.compose_partitioned`: ε is the worst
day's, each day's charges composed with the charges that read every day, those without `days`).

A ledger's budget protects one privacy unit (`unit`: "row", or "user" for all of a person's
rows; a ledger written before units is "row"), and every charge records the unit it was charged
in (a charge without one reads as "row"). Charges of one ledger all share its unit: a user-level
guarantee bounds nothing about one row of a user who keeps others (add/remove adjacency), and a
row-level one bounds a user only as a group of rows, so a row-level charge on a user-level
budget is refused unless converted as a group of at most k rows per user (`group_size`):
Gaussian steps by the mixture of Gaussians of `accounting.TrainingPeriod`, selections by
`accounting.group_privacy` (docs/guide/privacy_accounting.md, "The privacy unit").
"""
import datetime
import json
import os

from dprec import atomic_io
from dprec.errors import BudgetExceededError
from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import composition

LEDGER_FORMAT = "dprec-privacy-ledger-v1"
GAUSSIAN = "poisson_gaussian"
PURE = "pure"
APPROXIMATE = "approximate"
PREPROCESSING = "preprocessing"
ROW, USER = "row", "user"
UNITS = (ROW, USER)


def _now():
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _gaussian_key(charge):
  return (charge["noise_multiplier"], charge["sampling_rate"], charge["poisson"],
          charge.get("group_size", 1), _days(charge))


def unit_of(charge):
  """The unit a charge protects ("row" for charges written before units)."""
  return charge.get("unit", ROW)


def _days(charge):
  """The days a charge's release read (None: every day)."""
  days = charge.get("days")
  return None if days is None else tuple(int(d) for d in days)


def same_dataset(a, b) -> bool:
  """Whether identities {"path", "id"} name one data set: the same id, or, when either has no
  id (raw TSV days, an output written before ids, a stream not yet started), the same path."""
  if a.get("id") and b.get("id"):
    return a["id"] == b["id"]
  return a.get("path") == b.get("path")


def _spent(charges):
  """The charges as `composition.Spent`: Gaussian periods grouped by (σ, q, group size)
  (composition commutes) and the selection charges."""
  steps = {}
  for charge in charges:
    if charge["mechanism"] == GAUSSIAN:
      key = _gaussian_key(charge)[:4]
      steps[key] = steps.get(key, 0) + charge["steps"]
  return composition.Spent(
      periods=tuple(accounting.TrainingPeriod(s, q, n, poisson, group)
                    for (s, q, poisson, group), n in steps.items()),
      selections=tuple((c["epsilon"], c.get("delta", 0.0)) for c in charges
                       if c["mechanism"] in (PURE, APPROXIMATE)))


def _days_field(days):
  return {} if days is None else {"days": [int(d) for d in days]}


class PrivacyLedger:
  """Budgeted record of every privacy charge of a run, persisted at `path`.

  If `path` exists it is reloaded, and `epsilon_budget`/`delta`/`accountant`/`unit`, when
  given, must match it; otherwise `epsilon_budget` and `delta` are required, the accountant
  defaults to PLD, the unit to "row", and the file is created. `run_id`: the run this instance
  charges for, recorded in each of its charges; `marks`: more fields recorded in each charge
  (e.g. `private: False` for a run with insecure noise).
  """

  def __init__(self, path, epsilon_budget=None, delta=None, accountant=None, run_id=None,
               marks=None, unit=None):
    self.path = os.fspath(path)
    self.stamp = dict(marks or {}, **({"run_id": run_id} if run_id is not None else {}))
    if unit is not None and unit not in UNITS:
      raise DprecError(f"privacy unit must be one of {', '.join(UNITS)}, got {unit!r}")
    with atomic_io.locked(self.path):
      self._open(epsilon_budget, delta, accountant, unit)

  def _open(self, epsilon_budget, delta, accountant, unit):
    if os.path.exists(self.path):
      self._load(epsilon_budget, delta, accountant, unit)
      self._result = self._compose_loaded()
    else:
      if epsilon_budget is None or delta is None:
        raise DprecError(f"{self.path}: no ledger there; a new one needs a budget and a delta")
      if not epsilon_budget > 0:
        raise DprecError(f"epsilon budget must be > 0, got {epsilon_budget}")
      accounting.check_delta(delta)
      accountant = accountant or "pld"
      accounting.check_accountant(accountant)
      self.epsilon_budget, self.delta, self.accountant = float(epsilon_budget), delta, accountant
      self.unit = unit or ROW
      self.created = _now()
      self.charges = []
      self._result = self._compose(self.charges)
      self._save(self.charges)

  @classmethod
  def read(cls, path):
    """The ledger at `path`, read only: no lock is taken and nothing is written, so a ledger in a
    read-only place can be shown (writers replace the file by an atomic rename, so a reader
    always sees a whole ledger)."""
    ledger = cls.__new__(cls)
    ledger.path, ledger.stamp = os.fspath(path), {}
    ledger._load(tidy=False)
    ledger._result = ledger._compose_loaded()
    return ledger

  # -- persistence ---------------------------------------------------------------------------
  def _load(self, epsilon_budget=None, delta=None, accountant=None, unit=None, tidy=True):
    """Reads the file into this instance (the fields given must match it); not composed.
    `tidy` (only under the lock): also removes temporaries left by a killed writer."""
    try:
      with open(self.path) as f:
        data = json.load(f)
    except (OSError, ValueError) as error:
      raise DprecError(f"{self.path}: cannot read the privacy ledger ({error}); refusing to "
                       "continue without it (restore it from the latest checkpoint)") from error
    if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
      raise DprecError(f"{self.path}: not a dprec privacy ledger (format {LEDGER_FORMAT})")
    data.setdefault("privacy_unit", ROW)  # written before units
    if "epsilon_budget" in data and data["epsilon_budget"] is None:
      data["epsilon_budget"] = float("inf")  # strict JSON writes an unlimited budget as null
    for field, given in (("epsilon_budget", epsilon_budget), ("delta", delta),
                         ("accountant", accountant), ("privacy_unit", unit)):
      if given is not None and given != data.get(field):
        raise DprecError(
            f"{self.path}: field {field}: the ledger has {data.get(field)!r}, this run asks for "
            f"{given!r}. A ledger's budget, delta and accountant are fixed when it is created: "
            f"ask for {data.get(field)!r} as the run that created it did, or start a new budget "
            "with another ledger path (--ledger) or a new --run-dir")
    self.epsilon_budget, self.delta = data["epsilon_budget"], data["delta"]
    self.accountant, self.created = data["accountant"], data.get("created", "")
    self.unit, self.charges = data["privacy_unit"], data["charges"]
    for index, charge in enumerate(self.charges):
      if isinstance(charge, dict) and unit_of(charge) != self.unit:
        raise DprecError(f"{self.path}: charge {index} ({charge.get('label')}) has unit "
                         f"{unit_of(charge)!r} on a {self.unit}-level budget: a ledger holds "
                         "charges of one unit (restore the ledger from the latest checkpoint)")
    if tidy:  # Left by a writer killed before its rename (writers hold the lock): intact.
      atomic_io.remove_stale_temporaries(self.path)

  def _compose_loaded(self):
    try:
      return self._compose(self.charges)
    except (KeyError, TypeError) as error:
      raise DprecError(f"{self.path}: malformed charge in the privacy ledger ({error!r})"
                       ) from error

  def _state(self, charges):
    return {"format": LEDGER_FORMAT, "epsilon_budget": self.epsilon_budget, "delta": self.delta,
            "accountant": self.accountant, "privacy_unit": self.unit, "created": self.created,
            "charges": charges}

  def _save(self, charges):
    atomic_io.write_json(self.path, self._state(charges))

  def snapshot(self, path):
    """Write this ledger atomically to another path (e.g. into a checkpoint)."""
    atomic_io.write_json(path, self._state(self.charges))

  # -- accounting ----------------------------------------------------------------------------
  def composition(self):
    """What the recorded charges spent, both parts (kept from the last load or charge)."""
    return self._result

  def _compose(self, charges):
    """Gaussian periods (grouped by σ, q: composition commutes) with the selection charges; the
    charges of disjoint `days` in parallel (`composition.compose_partitioned`)."""
    by_days = {}
    for charge in charges:
      by_days.setdefault(_days(charge), []).append(charge)
    shared = _spent(by_days.pop(None, []))
    return composition.compose_partitioned(
        shared, [(days, _spent(group)) for days, group in by_days.items()], self.delta,
        self.accountant)

  def epsilon_spent(self):
    return self.composition().epsilon

  def remaining(self):
    return max(0.0, self.epsilon_budget - self.epsilon_spent())

  def _unit_fields(self, unit, group_size, what):
    """The fields recording a charge's unit on this budget: {"unit"}, and for a row-level
    release converted for a user of at most `group_size` rows, {"group_size", "converted_from"}.
    Refuses a charge of another unit that is not converted."""
    unit = self.unit if unit is None else unit
    if unit not in UNITS:
      raise DprecError(f"privacy unit must be one of {', '.join(UNITS)}, got {unit!r}")
    if group_size is not None:
      accounting.check_group_size(group_size)
    if unit == self.unit:
      if group_size is not None:
        raise DprecError(f"{self.path}: {what}: group_size converts a row-level charge for a "
                         f"user-level budget; this {unit}-level charge on a {unit}-level budget "
                         "takes none; nothing recorded")
      return {"unit": unit}
    if unit == ROW and group_size is not None:
      return {"unit": USER, "group_size": int(group_size), "converted_from": ROW}
    fix = ("convert it as a group of at most k rows per user (group_size=k, the bound on a "
           "user's rows)" if unit == ROW else
           "one user's guarantee does not bound one row of a user who keeps others: charge a "
           "user-level ledger (unit user)")
    raise DprecError(f"{self.path}: {what}: a {unit}-level charge on a {self.unit}-level budget "
                     f"is refused: {fix}; nothing recorded")

  def _with_gaussian(self, noise_multiplier, sampling_rate, steps, poisson, label, charges=None,
                     days=None, unit=None, group_size=None):
    """The charge list (default: the ledger's) after a Gaussian charge (reading `days` of the
    data set; None: every day) of `unit` (None: the ledger's; `_unit_fields`); merged into the
    last entry when identical."""
    charges = self.charges if charges is None else charges
    accounting.check_gaussian_parameters(noise_multiplier, sampling_rate, steps)
    units = self._unit_fields(unit, group_size, f"{label or 'Gaussian'} charge")
    if units.get("group_size") == 1:
      del units["group_size"]  # a user of one row: the row's own period
    charge = {"mechanism": GAUSSIAN, "noise_multiplier": float(noise_multiplier),
              "sampling_rate": float(sampling_rate), "steps": int(steps), "poisson": bool(poisson),
              "label": label, **_days_field(days), **units, **self.stamp}
    last = charges[-1] if charges else None
    if (last is not None and last["mechanism"] == GAUSSIAN and last["label"] == label
        and last.get("run_id") == charge.get("run_id")
        and _gaussian_key(last) == _gaussian_key(charge)):
      merged = dict(last, steps=last["steps"] + charge["steps"], merged=last["merged"] + 1,
                    updated=_now())
      return charges[:-1] + [merged]
    charge.update(time=_now(), updated=_now(), merged=1)
    return charges + [charge]

  def epsilon_if_charged(self, noise_multiplier, sampling_rate, steps, poisson=True, label="",
                         gaussian_mechanisms=(), days=None, approximate=(), unit=None,
                         group_size=None):
    """ε the ledger would reach after this Gaussian charge, preceded by the Gaussian mechanisms
    [(noise multiplier, label)] (`charge_gaussian_mechanism`), all reading `days`, and the
    `approximate` [(ε, δ, label)] releases (`charge_approximate`), all of `unit` (converted by
    `group_size` as they would be charged); nothing is recorded."""
    charges = self.charges + [self._approximate(epsilon, delta, approximate_label, unit,
                                                group_size)
                              for epsilon, delta, approximate_label in approximate]
    for mechanism_sigma, mechanism_label in gaussian_mechanisms:
      charges = self._with_gaussian(mechanism_sigma, 1.0, 1, True, mechanism_label, charges,
                                    days, unit, group_size)
    charges = self._with_gaussian(noise_multiplier, sampling_rate, steps, poisson, label, charges,
                                  days, unit, group_size)
    return self._compose(charges).epsilon

  def _commit(self, add, description):
    """Records `add(charges)` under the file's lock, on the charges on disk: a charge another
    process (a run sharing this ledger) recorded meanwhile is kept and counts in the budget."""
    with atomic_io.locked(self.path):
      known = self.charges
      self._load()
      if self.charges != known:
        self._result = self._compose_loaded()
      return self._commit_locked(add(self.charges), description)

  def _commit_locked(self, charges, description):
    result = self._compose(charges)
    if result.epsilon > self.epsilon_budget:
      spent_before = self.epsilon_spent()
      left = max(0.0, self.epsilon_budget - spent_before)
      raise BudgetExceededError(
          f"{self.path}: {description} would bring epsilon to {result.epsilon:.6g} (training "
          f"{result.training_epsilon:.6g} + selection {result.selection_epsilon:.6g}) at delta "
          f"{self.delta:g}, over the budget {self.epsilon_budget:g}; {spent_before:.6g} spent, "
          f"{left:.6g} left; nothing recorded")
    charges[-1] = dict(charges[-1], epsilon_so_far=result.epsilon)
    self._save(charges)
    self.charges, self._result = charges, result
    return result.epsilon

  def charge_gaussian(self, noise_multiplier, sampling_rate, steps, poisson=True, label="",
                      days=None, unit=None, group_size=None):
    """Record T sampled-Gaussian steps (on the data set's `days`; None: any row) protecting
    `unit` (None: the ledger's; a row-level release on a user-level budget needs `group_size`,
    the bound on a user's rows, and is recorded as a user's mixture of Gaussians); returns ε so
    far. Over budget or of another unit: raises, records nothing."""
    return self._commit(
        lambda charges: self._with_gaussian(noise_multiplier, sampling_rate, steps, poisson,
                                            label, charges, days, unit, group_size),
        f"charging {steps} steps (sigma {noise_multiplier:g}, q {sampling_rate:g}"
        f"{', ' + label if label else ''})")

  def charge_gaussian_mechanism(self, noise_multiplier, label="", days=None, unit=None,
                                group_size=None):
    """Record one release of the (unsampled) Gaussian mechanism, e.g. a DP histogram, composed
    with training in the accountant (`accounting.gaussian_mechanism_period`); returns ε so far."""
    period = accounting.gaussian_mechanism_period(noise_multiplier)
    return self.charge_gaussian(period.noise_multiplier, period.sampling_rate, period.steps,
                                period.poisson, label, days, unit, group_size)

  def charge_pure(self, epsilon, label="", unit=None, group_size=None):
    """Record a pure ε-DP release (e.g. DP top-k selection); returns ε so far."""
    return self.charge_approximate(epsilon, 0.0, label, unit, group_size)

  def _approximate(self, epsilon, delta, label, unit, group_size):
    """The charge of an (ε, δ)-DP release of `unit`, converted by `accounting.group_privacy`
    when a row-level release is charged for a user of at most `group_size` rows."""
    if not epsilon >= 0 or not 0 <= delta < self.delta:
      raise DprecError(f"selection charge needs epsilon >= 0 and 0 <= delta < {self.delta:g}, "
                       f"got ({epsilon}, {delta})")
    units = self._unit_fields(unit, group_size, f"{label or 'selection'} charge")
    if "converted_from" in units:
      units["converted_from"] = {"unit": ROW, "epsilon": float(epsilon), "delta": float(delta)}
      epsilon, delta = accounting.group_privacy(epsilon, delta, units["group_size"])
      if not delta < self.delta:
        raise DprecError(f"{self.path}: {label or 'selection'} charge: delta {delta:g} for a "
                         f"group of {units['group_size']} rows is not below the ledger's "
                         f"{self.delta:g}; nothing recorded")
    return {"mechanism": APPROXIMATE if delta else PURE, "epsilon": float(epsilon),
            "delta": float(delta), "label": label, **units, **self.stamp}

  def charge_approximate(self, epsilon, delta, label="", unit=None, group_size=None):
    """Record an (ε, δ)-DP release (e.g. zCDP-accounted top-k) protecting `unit` (as in
    `charge_gaussian`); training keeps δ − Σδ."""
    charge = dict(self._approximate(epsilon, delta, label, unit, group_size), time=_now())
    epsilon, delta = charge["epsilon"], charge["delta"]
    what = f"epsilon {epsilon:g}" + (f", delta {delta:g}" if delta else "")
    return self._commit(lambda charges: charges + [charge],
                        f"charging {what}{' (' + label + ')' if label else ''}")

  def charges_of(self, run_id, label=None):
    """The charges recorded by run `run_id` (with `label`, if given): what that run has paid."""
    return [c for c in self.charges if c.get("run_id") == run_id
            and (label is None or c.get("label") == label)]

  def spent_before(self, run_id):
    """What the charges recorded before run `run_id`'s first one (all, if it has none) spent,
    its own excluded (`composition.Spent`): what that run's plan composes with, every charge as
    if it read every day (an upper bound for charges of some `days`). Charges only
    ever append, so a resumed run finds what it found when it started; later charges of other
    runs still count against the budget (`epsilon_if_charged`, `_commit`)."""
    earlier = []
    for charge in self.charges:
      if charge.get("run_id") == run_id:
        break
      earlier.append(charge)
    return _spent(earlier)

  def check_dataset(self, dataset):
    """Refuses (DprecError) a ledger holding charges for a data set other than `dataset`
    ({"path", "id"}; None: the run cannot tell, and every charge counts)."""
    if dataset is None:
      return
    others = [c for c in self.charges if c.get("dataset") is not None
              and not same_dataset(c["dataset"], dataset)]
    if others:
      first, held = others[0], others[0]["dataset"]
      more = f" and {len(others) - 1} more" if len(others) > 1 else ""
      raise DprecError(
          f"{self.path}: holds charges for another data set: "
          f"{first.get('label') or first['mechanism']} (run {first.get('run_id')}) for "
          f"{held.get('path')} (id {held.get('id')}){more}; {dataset.get('path')} (id "
          f"{dataset.get('id')}) holds different rows, whose charges belong in their own ledger")

  def parts(self):
    """ε and δ split into the preprocessing selections (charges with `stage:
    "preprocessing"`, e.g. a DP top-k vocabulary) and training (everything else: the
    Gaussian periods composed in the accountant plus in-run selections; with charges of
    `days`, the worst day's, each day's ε in `by_days`). The parts add up to the total by basic
    composition (`composition`)."""
    result = self.composition()
    preprocessing = [c for c in self.charges if c.get("stage") == PREPROCESSING]
    epsilon = float(sum(c["epsilon"] for c in preprocessing))
    delta = float(sum(c.get("delta", 0.0) for c in preprocessing))
    training = [c for c in self.charges if c.get("stage") != PREPROCESSING]
    return {
        "preprocessing_selection": {
            "epsilon": epsilon, "delta": delta,
            "charges": [{"label": c.get("label"), "epsilon": c["epsilon"],
                         "delta": c.get("delta", 0.0), "dataset": c.get("dataset"),
                         "private": c.get("private", True)} for c in preprocessing]},
        "training": {
            "epsilon": result.epsilon - epsilon, "delta": result.delta - delta,
            "runs": sorted({c.get("run_id") or "(none recorded)" for c in training}),
            # Parallel composition: ε of each group of days (the total is the worst's).
            "by_days": result.partitions},
    }

  def summary(self):
    result = self.composition()
    return {"path": self.path, "epsilon_budget": self.epsilon_budget, "delta": self.delta,
            "accountant": self.accountant, "privacy_unit": self.unit,
            "epsilon_spent": result.epsilon,
            "training_epsilon": result.training_epsilon,
            "selection_epsilon": result.selection_epsilon,
            "training_delta": result.training_delta, "selection_delta": result.selection_delta,
            "remaining": max(0.0, self.epsilon_budget - result.epsilon), "note": result.note,
            "epsilon_parts": self.parts(), "charges": self.charges}
