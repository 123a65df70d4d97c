"""SeqLDP accounting of DP-Forward training (Du et al., "DP-Forward: Fine-tuning and Inference on
Language Models with Differential Privacy in Forward Pass", arXiv:2309.06746, Du et al. 2023, §3.3,
§3.4).

Each epoch, every user releases their bounded representation f(X) + Z once (the encoder f may
change between epochs: adaptive composition). Z is i.i.d. N(0, (z·S)²) with S = 2C, so one release
is a Gaussian mechanism with noise multiplier z on a sensitivity-1 query, and E epochs are its
E-fold composition, accounted with PLD (`dp_accounting`; the paper used the PRV accountant, its
equivalent). As a sampled-Gaussian period that is rate q = 1, T = E: the ledger charges one such
step per epoch, and σ is calibrated for a target ε over E epochs the same way as for DP-SGD.

This is local DP for the sequence X given its label y (SeqLDP): the next-item label is sent in the
clear. For full LDP the label can go through randomized response with a prior (`label_rr`,
§3.4), once per user (reused every epoch): the pair is then (ε1 + ε2, δ)-LDP (Theorem 4, basic
composition), ε1 from the representations and ε2 from the label.
"""
import dataclasses
import math

from dprec.errors import DprecError
from dprec.privacy import accounting
from dprec.privacy import calibration
from dprec.privacy import composition

NOTION = "SeqLDP"
RELEASE_SAMPLING_RATE = 1.0  # every user's representation is released in every epoch
SEQLDP_NOTE = (
    "SeqLDP (local DP of each user's sequence given its label, Du et al. 2023, "
    "arXiv:2309.06746), not central DP: "
    "each user's noised representation is released once per epoch and the epochs compose; "
    "nothing about other users is assumed")
LABEL_CLEAR_NOTE = "the next-item label is sent in the clear: it is not protected"
LABEL_RR_NOTE = ("the next-item label went through randomized response with a prior once per "
                 "user (epsilon2 = label_epsilon): (epsilon1 + epsilon2, delta)-LDP")


def check_epochs(epochs):
  if int(epochs) != epochs or epochs < 1:
    raise DprecError(f"DP-Forward needs a whole number of epochs >= 1 (each one releases every "
                     f"user's representation once), got {epochs}")
  return int(epochs)


def release_period(noise_multiplier, epochs):
  """E releases of one user as the sampled-Gaussian period (z, q = 1, T = E)."""
  return accounting.TrainingPeriod(noise_multiplier, RELEASE_SAMPLING_RATE, check_epochs(epochs))


def seqldp_epsilon(noise_multiplier, epochs, delta, accountant="pld"):
  """ε1 at δ of E epoch releases with noise multiplier z (σ = z·2C)."""
  return accounting.gaussian_epsilon([release_period(noise_multiplier, epochs)], delta,
                                     accountant)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
  """The noise of a DP-Forward run and what it guarantees per user."""
  noise_multiplier: float  # z: σ = z·sensitivity
  norm_bound: float  # C
  epochs: int
  delta: float
  representation_epsilon: float  # ε1 over all epochs (PLD)
  label_epsilon: float = 0.0  # ε2 of randomized response (0: labels in the clear)
  accountant: str = "pld"

  @property
  def sensitivity(self):
    return 2.0 * self.norm_bound

  @property
  def sigma(self):
    return self.noise_multiplier * self.sensitivity

  @property
  def epsilon(self):
    return self.representation_epsilon + self.label_epsilon

  def to_dict(self):
    return {
        "privacy_notion": NOTION if not self.label_epsilon else "LDP",
        "privacy_note": SEQLDP_NOTE + "; " + (LABEL_RR_NOTE if self.label_epsilon
                                               else LABEL_CLEAR_NOTE),
        "epsilon": self.epsilon, "representation_epsilon": self.representation_epsilon,
        "label_epsilon": self.label_epsilon, "delta": self.delta,
        "noise_multiplier": self.noise_multiplier, "noise_stddev": self.sigma,
        "norm_bound": self.norm_bound, "sensitivity": self.sensitivity,
        "releases_per_user": self.epochs, "accountant": self.accountant,
    }


def plan_forward(target_epsilon, delta, epochs, norm_bound, label_epsilon=0.0, accountant="pld",
                 spent: composition.Spent = composition.Spent()):
  """Calibrates z (within rtol 1e-3) so that E releases, the label's ε2 and what a ledger spent
  on the data set before the run (`spent`: its periods composed with the releases in the
  accountant, its selections added) together spend exactly the target ε."""
  if not 0 <= label_epsilon < target_epsilon:
    raise DprecError(f"label epsilon {label_epsilon} leaves nothing of the target "
                     f"{target_epsilon} for the representations")
  if not norm_bound > 0:
    raise DprecError(f"the representation norm bound C must be positive, got {norm_bound}")
  if not math.isfinite(target_epsilon):
    raise DprecError("DP-Forward needs a finite epsilon")
  z = calibration.plan_training(target_epsilon, delta,
                                [(RELEASE_SAMPLING_RATE, check_epochs(epochs))],
                                selection_epsilon=label_epsilon, accountant=accountant,
                                spent=spent).noise_multiplier
  return ForwardPlan(z, float(norm_bound), check_epochs(epochs), delta,
                     seqldp_epsilon(z, epochs, delta, accountant), float(label_epsilon),
                     accountant)
