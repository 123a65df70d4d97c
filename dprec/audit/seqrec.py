"""Canary audit of a `train seqrec` configuration (DPFormer): an empirical ε lower bound.

Canary user i (of m) has the two-item history (a_i, b_i) of fresh items only it holds (items
M + 2i + 1 and M + 2i + 2), so it trains "after a_i comes b_i". A random half of the canary users
join the training users; the model is trained by `train seqrec`'s model and DP step; a canary's
score is the rise of log softmax(b_i | history a_i) over all items from initialisation to the end
of training. Canary items get the public frequency of one user (1/N) in Re-Attention's p_i,
whether inserted or not. The bound is the one-run method of `bounds.py`, guesses pooled over runs.

    from dprec.audit import seqrec
    seqrec.audit_seqrec(SeqRecTrainOptions(model="dpformer", data=..., epsilon=2, epochs=5),
                       canaries=500)
"""
import dataclasses

import numpy as np
import tensorflow as tf

from dprec.audit import runner
from dprec.data.sequences import load_sequences
from dprec.data.sequences import make_examples
from dprec.errors import DprecError
from dprec.training import poisson
from dprec.workflows import seqrec as train_seqrec


def _with_canaries(examples, count, rng):
  """(examples with the included canaries and m new item pairs, canary histories [m, L],
  canary targets [m], included [m])."""
  m_items, length = examples.num_items, examples.items.shape[1]
  first = m_items + 1 + 2 * np.arange(count)
  histories = np.zeros([count, length], np.int32)
  histories[:, -1] = first
  labels = np.zeros([count, length], np.int32)
  labels[:, -1] = first + 1
  included = rng.random(count) < 0.5
  users = len(examples.items) + int(included.sum())
  frequencies = np.append(examples.item_frequencies, np.full(2 * count, 1.0 / users))
  grown = dataclasses.replace(
      examples, items=np.concatenate([examples.items, histories[included]]),
      labels=np.concatenate([examples.labels, labels[included]]), item_frequencies=frequencies)
  return grown, histories, first + 1, included


def _target_log_probabilities(model, histories, targets):
  scores = model.score_items(tf.constant(histories))
  log_probabilities = tf.nn.log_softmax(scores, axis=-1).numpy()
  return log_probabilities[np.arange(len(targets)), targets - 1]  # score column j: item j + 1


def audit_seqrec(options: train_seqrec.SeqRecTrainOptions, canaries: int = 500, runs: int = 1,
                 confidence: float = 0.95, data=None, scores_file=None,
                 summary_json=None) -> dict:
  """Runs the seqrec audit (of the transformer's DP-SGD training); returns (and writes) its
  JSON summary."""
  options.validate()
  if options.model != "dpformer":
    raise DprecError(f"the seqrec audit trains the transformer: give model='dpformer', got "
                     f"{options.model!r}")
  examples = make_examples(data or load_sequences(options.data), options.max_len)

  def train_and_score(rng):
    # Independent runs: a fresh secret key per run (build_model's default) for the noise, fresh
    # OS entropy for the batches, and a fresh public seed for the initialisation.
    run_options = dataclasses.replace(options, seed=int(rng.integers(2**31)))
    tf.keras.utils.set_random_seed(run_options.seed)
    grown, histories, targets, included = _with_canaries(examples, canaries, rng)
    plan = train_seqrec.plan_privacy(run_options, len(grown.items))
    model = train_seqrec.build_model(run_options, grown, plan)
    before = _target_log_probabilities(model, histories, targets)
    sampling = poisson.BatchSampling(options.batch_size,
                                     options.private and not options.fixed_batches)
    dataset = poisson.sampled_dataset({"items": grown.items}, grown.labels, sampling, plan.steps)
    model.fit(dataset, epochs=1, steps_per_epoch=plan.steps, verbose=0)
    rise = _target_log_probabilities(model, histories, targets) - before
    return {"log_probability_rise": rise}, included, plan

  delta = options.delta or 1.0 / len(examples.items)  # `train seqrec`'s default δ = 1/N
  result = runner.run_audit(train_and_score, runs, delta, confidence, np.random.default_rng())
  summary = {
      "algorithm": "dpformer_dp_sgd" if options.private else "non_private",
      "claimed_epsilon": options.epsilon if options.private else None,
      "delta": delta,
      "threat_model": "black_box",
      **result.summary_fields(),
      "confidence": confidence,
      "canaries": canaries,
      "runs": runs,
      "scores": ["log_probability_rise"],
      "noise_multiplier": result.plan.noise_multiplier,
      "steps": result.plan.steps,
      "batch_size": options.batch_size,
      "scores_file": scores_file,
      "note": runner.NOTE,
  }
  runner.write_outputs(summary, result.records, scores_file, summary_json)
  return summary
