"""DP-Forward's noise layer (Du et al., "DP-Forward: Fine-tuning and Inference on Language Models
with Differential Privacy in Forward Pass", arXiv:2309.06746, Du et al. 2023, §4.2): where the
user's side ends.

Each example's representation x_i (all axes but the batch axis: a [d] user vector or an [L, d]
matrix) is optionally projected to d' by a trainable M1 (`reduced_dim`, §3.2), then bounded in
Frobenius norm: normalised to ‖x_i‖_F = C (`bound="normalize"`, the paper's experiments) or
clipped to ‖x_i‖_F ≤ C (`"clip"`, its released code). Either way ‖f(X) − f(X')‖_F ≤ 2C for any two
inputs X, X' (replace-one), the sensitivity S₂ the noise is calibrated to. Then i.i.d. Gaussian
noise N(0, σ²) with σ = noise_multiplier·2C is added (aMGM with identity covariances is i.i.d.,
Eq. 6; `dprec.privacy.analytic_gaussian` and `dprec.privacy.forward` calibrate the multiplier).
The noise is drawn in training and, with `at_inference`, in inference too (Theorem 5). With
`reduced_dim`, a trainable M2 on the service's side restores the input dimension after the noise.

By default no gradient flows back through the noise (`user_gradients=False`): the service cannot
compute one without the raw input, so the user's side (M1 included) is fixed, or changes only
through weights it shares with the service (a tied item table). `user_gradients=True` is what the
paper's experiments do (f updated through the noise); SeqLDP does not cover those gradients, which
need a trusted party or secure aggregation (Du et al. 2023, §3.3, §8.5).

The noise comes from the `tf.random.Generator` passed in, which the proof needs to be secret: by
default one keyed from the OS CSPRNG (`dprec.privacy.noise_key`); a run passes its own keyed
generator. The layer does not track it, so it is in no checkpoint.
"""
import dataclasses
from typing import Optional

import tensorflow as tf

BOUNDS = ("normalize", "clip")


class ForwardNoise(tf.keras.layers.Layer):
  """`call(x)` returns the noisy (and, with `reduced_dim`, restored) representation;
  `bounded(x)` the representation the user would noise: ‖·‖_F = C (or ≤ C) per example."""

  def __init__(self, norm_bound, noise_multiplier, bound="normalize", at_inference=True,
               reduced_dim=None, user_gradients=False, generator=None, **kwargs):
    super().__init__(**kwargs)
    if not norm_bound > 0:
      raise ValueError(f"norm_bound must be positive, got {norm_bound}")
    if not noise_multiplier >= 0:
      raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if bound not in BOUNDS:
      raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
    if reduced_dim is not None and reduced_dim < 1:
      raise ValueError(f"reduced_dim must be >= 1, got {reduced_dim}")
    self.norm_bound, self.noise_multiplier = float(norm_bound), float(noise_multiplier)
    self.bound, self.at_inference, self.reduced_dim = bound, at_inference, reduced_dim
    self.user_gradients = user_gradients
    if generator is None:
      from dprec.privacy.noise_key import NoiseKey
      generator = NoiseKey.fresh().tf_generator("forward noise")
    # Not tracked: its state is secret and stays out of weights and checkpoints (a run re-keys
    # it at every step from its key).
    object.__setattr__(self, "generator", generator)

  @property
  def sensitivity(self):
    """S₂ = 2C: any two bounded representations are at most 2C apart (Du et al. 2023)."""
    return 2.0 * self.norm_bound

  @property
  def stddev(self):
    return self.noise_multiplier * self.sensitivity

  def build(self, input_shape):
    if self.reduced_dim is not None:
      self.reduce = tf.keras.layers.Dense(self.reduced_dim, use_bias=False, name="reduce",
                                          trainable=self.user_gradients)
      self.restore = tf.keras.layers.Dense(input_shape[-1], use_bias=False, name="restore")
    super().build(input_shape)

  def bounded(self, x):
    """M1 (if any), then each example normalised (or clipped) to Frobenius norm C."""
    if self.reduced_dim is not None:
      x = self.reduce(x)
    axes = list(range(1, x.shape.rank))
    norms = tf.sqrt(tf.reduce_sum(tf.square(x), axis=axes, keepdims=True))
    if self.bound == "normalize":
      scale = self.norm_bound / tf.maximum(norms, 1e-12)
    else:
      scale = tf.minimum(1.0, self.norm_bound / tf.maximum(norms, 1e-12))
    return x * scale

  def call(self, x, training=False):
    x = self.bounded(x)
    if not self.user_gradients:
      x = tf.stop_gradient(x)
    if (training or self.at_inference) and self.noise_multiplier > 0:
      x = x + self.generator.normal(tf.shape(x), stddev=self.stddev, dtype=x.dtype)
    if self.reduced_dim is not None:
      x = self.restore(x)
    return x


POSITIONS = ("output", "attention")
ENCODER_UPDATES = ("none", "trusted")


@dataclasses.dataclass(frozen=True)
class DPForwardConfig:
  """Where a sequential recommender's user side ends and how its output is noised (Du et al. 2023).

  position: "output" noises the user representation (the last position's final hidden state,
    1×d: the paper's best position, Du et al. 2023); "attention" noises the first block's attention
    output (L×d, padding rows zeroed), with the residual removed so that the service never
    re-reads the input (§3.2), and the service then treats all L positions as items (the
    sequence length is private too).
  encoder_updates: "none" (the service trains only what follows the noise, and the tied item
    table through its scores: everything it sees is SeqLDP) or "trusted" (the paper's
    experiments: gradients flow into the user's side, which needs a trusted party).
  """
  noise_multiplier: float
  norm_bound: float = 1.0
  position: str = "output"
  bound: str = "normalize"
  at_inference: bool = True
  reduced_dim: Optional[int] = None
  encoder_updates: str = "none"

  def __post_init__(self):
    if self.position not in POSITIONS:
      raise ValueError(f"DP-Forward position must be one of {POSITIONS}, got {self.position!r}")
    if self.encoder_updates not in ENCODER_UPDATES:
      raise ValueError(f"encoder_updates must be one of {ENCODER_UPDATES}, got "
                       f"{self.encoder_updates!r}")

  def make_layer(self, generator=None, name="forward_noise"):
    return ForwardNoise(self.norm_bound, self.noise_multiplier, self.bound, self.at_inference,
                        self.reduced_dim, self.encoder_updates == "trusted", generator, name=name)
