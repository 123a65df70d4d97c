"""The pCTR model and the DP step of `DPModel`, behind the streaming trainer's `PeriodModel`.

Streaming adds two things to `dprec train ctr`'s model: tables that grow as the Beam job assigns
ids to new buckets (a new `CTRModel` with more rows; every learned row and optimizer slot
carried over, new rows freshly initialised; the noise generator is re-keyed by the trainer at
every step from the run's secret key), and a DP-FEST row set refreshed at
period boundaries (rows stay where they are, so buckets that stay selected keep what they
learned). Embedding widths are fixed by the first period's vocabulary so rows keep their shape.
"""
import dataclasses
from typing import Mapping, Optional

import numpy as np
import tensorflow as tf

from dprec.models import ctr
from dprec.models import ctr_cli
from dprec.optimizers.dp_optimizer import DPOptimizer
from dprec.training.streaming import PeriodModel


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


class CTRPeriodModel(PeriodModel):
  """`PeriodModel` of the pCTR model (seed 001 App. D.1.1) trained by `DPModel`'s step.

  Args:
    options: `dprec train ctr`'s options; the algorithm and model/step hyper-parameters are used
      (algorithm, l2_norm_clip, ratio, threshold, contribution_clip, learning_rate, optimizer,
      adambc_floor, hidden_units, eval_batch_size, seed: public, initialisation only).
    noise_multiplier: the plan's composed σ (split into σ1 = r·σ2 and σ2 for DP-AdaFEST).
    expected_batch_size: q · N_period, the normaliser of the noisy sum (DESIGN §4 step 5).
  """

  def __init__(self, options: ctr_cli.CTRTrainOptions, noise_multiplier: float,
               expected_batch_size: float):
    self.options = options
    self.expected_batch_size = expected_batch_size
    plan = ctr_cli.PrivacyPlan(noise_multiplier, None, noise_multiplier, 0.0, None, 0.0)
    if options.algorithm.startswith("dp_adafest"):
      from dprec import privacy  # pylint: disable=import-outside-toplevel
      sigma1, sigma2 = privacy.adafest_noise_multipliers(noise_multiplier, options.ratio)
      plan = dataclasses.replace(plan, sigma1=sigma1, sigma2=sigma2)
    self._plan = plan
    self.model = None
    self.optimizer = None
    self.embedding_dims = None
    self._compiled_for = None  # (model, selected rows) the train step was last compiled for

  def build(self, table_rows: Mapping[str, int]):
    names = tuple(table_rows)
    sizes = tuple(int(table_rows[n]) for n in names)
    if self.embedding_dims is None:
      self.embedding_dims = tuple(ctr.embedding_dim(max(v - 1, 1)) for v in sizes)
    tf.keras.utils.set_random_seed(self.options.seed + sum(sizes))  # fresh rows: reproducible
    model = ctr.build_ctr_model(sizes, table_names=names, embedding_dims=self.embedding_dims,
                                hidden_units=self.options.hidden_units)
    optimizer = ctr_cli.make_optimizer(self.options)
    optimizer.build(model.trainable_variables)
    if self.model is not None:  # same architecture, so variables correspond by position
      pairs = list(zip(self.model.trainable_variables, model.trainable_variables))
      pairs += list(zip(self.optimizer.variables, optimizer.variables))
      for old, new in pairs:
        transfer_variable(old.numpy(), new)
    self.model, self.optimizer = model, optimizer

  def trackables(self):
    return {"model": self.model, "optimizer": self.optimizer}

  def noise_generators(self):
    return {"dp step": self.model.dp_optimizer.generator}

  def set_selected_rows(self, selected_rows: Optional[Mapping[str, np.ndarray]]):
    key = (id(self.model), None if selected_rows is None
           else tuple((k, np.asarray(v).tobytes()) for k, v in sorted(selected_rows.items())))
    if key == self._compiled_for:
      return  # same step: keep the traced function (retracing costs seconds)
    self._compiled_for = key
    config = ctr_cli.algorithm_config(self.options, self._plan, selected_rows)
    # A secret generator, re-keyed by the trainer before every step (`noise_generators`).
    self.model.compile(optimizer=DPOptimizer(config, self.optimizer,
                                             expected_batch_size=self.expected_batch_size))

  def train_steps(self, batches, steps, on_step):
    def generate():
      for features, labels in batches:
        yield ({ctr.CAT_FEATURES: features[ctr.CAT_FEATURES].astype(np.int32),
                ctr.INT_FEATURES: features[ctr.INT_FEATURES].astype(np.float32)},
               labels.astype(np.int32))

    # A None batch dimension: one trace serves every Poisson batch size (no per-size retrace).
    self.model.fit(tf.data.Dataset.from_generator(generate, output_signature=self._signature),
                   steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[_OnStep(on_step)])

  def evaluate(self, features, labels):
    data = tf.data.Dataset.from_tensor_slices(
        ({k: features[k] for k in (ctr.CAT_FEATURES, ctr.INT_FEATURES)}, labels))
    return self.model.evaluate(data.batch(self.options.eval_batch_size), verbose=0,
                               return_dict=True)

  @property
  def _signature(self):
    config = self.model.config
    return ({ctr.CAT_FEATURES: tf.TensorSpec([None, len(config.vocab_sizes)], tf.int32),
             ctr.INT_FEATURES: tf.TensorSpec([None, config.num_integer_features], tf.float32)},
            tf.TensorSpec([None], tf.int32))


class _OnStep(tf.keras.callbacks.Callback):
  """Hands each step's logs to the streaming trainer (journal, progress)."""

  def __init__(self, on_step):
    super().__init__()
    self.on_step = on_step

  def on_train_batch_end(self, batch, logs=None):
    self.on_step({k: float(v) for k, v in (logs or {}).items()})
