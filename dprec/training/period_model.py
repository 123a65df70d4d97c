"""What the streaming trainer needs from a model (`PeriodModel`), and `transfer_variable`, which
grows a model's tables keeping their learned rows."""
import abc
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

# {mechanism name: (its noise multiplier, or None when not private; a secret numpy Generator)}
Releases = Mapping[str, Tuple[Optional[float], np.random.Generator]]


class PeriodModel(abc.ABC):
  """What the streaming trainer needs from a model and its (DP) training step.

  `dprec.workflows.stream.CTRPeriodModel` implements it with the pCTR model and `DPModel`;
  anything with the same six methods can be streamed (`transfer_variable` helps to grow). A
  model whose shapes depend on more than its table rows (widths fixed when first built) says so
  in `shapes`, so that a resumed run rebuilds the checkpoint's shapes before restoring it.
  """

  @abc.abstractmethod
  def build(self, table_rows: Mapping[str, int]):
    """Creates the model, or grows its tables to `table_rows` keeping every learned row and
    optimizer slot (ids are stable across periods, so row i is the same bucket before and after)."""

  def shapes(self) -> Dict:
    """JSON of what shapes the built model besides its table rows (e.g. embedding widths), saved
    with every checkpoint and handed to `set_shapes` before a resumed run builds the model to
    restore it."""
    return {}

  def set_shapes(self, shapes: Mapping):
    """Makes the next `build` take the shapes `shapes()` returned (a checkpoint's)."""
    del shapes

  def shapes_in_checkpoint(self, prefix: str, table_rows: Mapping[str, int]) -> Dict:
    """`shapes()` of the model built for `table_rows` whose TensorFlow checkpoint is at `prefix`,
    read from its variables: for checkpoints written before they recorded `shapes`."""
    del prefix, table_rows
    return {}

  @abc.abstractmethod
  def trackables(self) -> Dict[str, tf.Module]:
    """Objects saved in checkpoints: model, optimizer (slots); never the noise generators."""

  @abc.abstractmethod
  def noise_generators(self) -> Dict[str, tf.random.Generator]:
    """{purpose: generator} of the step's secret noise; the trainer puts each on the state its
    run key derives for (purpose, period, step) before every step."""

  @abc.abstractmethod
  def set_selected_rows(self, selected_rows: Optional[Mapping[str, np.ndarray]]):
    """Sets the DP-FEST / DP-AdaFEST+ row set (None: the algorithm has no fixed set)."""

  @abc.abstractmethod
  def train_steps(self, batches: Iterable[Tuple[Mapping[str, np.ndarray], np.ndarray]],
                  steps: int, on_step: Callable[[Dict[str, float]], None]):
    """Runs one (DP) step per (features, labels) Poisson batch, in order, calling `on_step` with
    that step's logs (`loss`, `gradient_size_reduction`) after each."""

  @abc.abstractmethod
  def evaluate(self, features: Mapping[str, np.ndarray], labels: np.ndarray) -> Dict[str, float]:
    """Metrics on held-out data: at least `auc` and `loss` (log loss); `base_rate_log_loss`
    (of the constant the model starts from) if it has one."""

  def before_training(self, features, labels, releases: Releases) -> Dict[str, float]:
    """Called once before the first step of the first period (never again on resume), on its
    training rows, with the Gaussian mechanisms the plan releases once {name: (σ, secret rng)}
    (e.g. a DP base rate for the logit bias). Returns the released values (public: covered by
    ε). State it changes must be in `trackables`."""
    del features, labels, releases
    return {}

  def after_training(self, features, labels, releases: Releases) -> Dict[str, float]:
    """Called after the last step of every period on its training rows, with the mechanisms
    the plan releases in every period (e.g. DP Platt scaling, charged with the period), and
    again on a resume that replays the period's last steps (same rng: same release). Returns
    the released values."""
    del features, labels, releases
    return {}


def transfer_variable(old_value: np.ndarray, new_variable: tf.Variable):
  """Copies a variable into its (possibly grown) successor: leading rows from the old value, the
  rest keeps the successor's initialisation. Only the first axis may grow."""
  new_shape = tuple(new_variable.shape)
  if old_value.shape == new_shape:
    new_variable.assign(old_value)
    return
  if old_value.shape[1:] != new_shape[1:] or old_value.shape[0] > new_shape[0]:
    raise ValueError(f"cannot grow {new_variable.name} from {old_value.shape} to {new_shape}: "
                     "only rows may be added")
  value = new_variable.numpy()
  value[:old_value.shape[0]] = old_value
  new_variable.assign(value)
