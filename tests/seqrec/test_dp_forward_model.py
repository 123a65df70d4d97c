"""SeqRecModel split by DP-Forward: the service's side reads only the noised representation."""
import numpy as np
import pytest
import tensorflow as tf

from dprec.layers.forward_noise import DPForwardConfig
from dprec.models.seqrec import SeqRecConfig, SeqRecModel

ITEMS = np.array([[0, 0, 3, 4, 5], [1, 2, 3, 4, 6]], np.int32)
OTHER = np.array([[0, 7, 7, 1, 2], [0, 0, 0, 0, 9]], np.int32)


def make_model(position, encoder_updates="none", **noise):
  forward = DPForwardConfig(noise_multiplier=noise.pop("noise_multiplier", 0.5), position=position,
                            encoder_updates=encoder_updates, **noise)
  config = SeqRecConfig(num_items=9, max_len=5, dim=8, num_blocks=2, ffn_dim=8, dropout=0.0,
                        loss_positions="last", dp_forward=forward)
  model = SeqRecModel(config, forward_noise_generator=tf.random.Generator.from_seed(0))
  model({"items": ITEMS})
  return model


@pytest.mark.parametrize("position", ["output", "attention"])
def test_service_side_depends_on_the_input_only_through_the_noise_layer(position, monkeypatch):
  """With the noise layer's output fixed, any two inputs (other items, other lengths) give the
  same scores: nothing after the noise re-reads the sequence or its padding mask."""
  model = make_model(position)
  layer = model.forward_noise
  fixed = lambda x, training=False: tf.sin(tf.reshape(tf.cast(tf.range(tf.size(x)), x.dtype),
                                                      tf.shape(x)))
  monkeypatch.setattr(layer, "call", fixed)
  np.testing.assert_allclose(model.score_items(ITEMS), model.score_items(OTHER))


@pytest.mark.parametrize("position", ["output", "attention"])
def test_user_side_gets_no_gradient_by_default(position):
  model = make_model(position)
  trainable = {id(v) for v in model.trainable_variables}
  user_side = model.positions.weights + model.blocks[0].attention.weights
  service_side = [model.item_embedding.embeddings, model.item_bias]
  if position == "output":
    assert trainable == {id(v) for v in service_side}
  else:  # the first block's attention is the user's; its feed-forward part the service's
    service_side += model.blocks[0].ffn_in.weights + model.blocks[1].weights
    assert trainable >= {id(v) for v in service_side}
  assert not trainable & {id(v) for v in user_side}
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model.score_items(ITEMS))
  grads = tape.gradient(loss, model.trainable_variables)
  assert all(g is not None for g in grads)


def test_trusted_encoder_updates_train_the_user_side():
  model = make_model("output", encoder_updates="trusted")
  assert any("block_0" in v.name for v in model.trainable_variables)


def test_noise_at_inference_is_optional():
  quiet = make_model("output", at_inference=False)
  np.testing.assert_allclose(quiet.score_items(ITEMS), quiet.score_items(ITEMS))
  loud = make_model("output")
  assert not np.allclose(loud.score_items(ITEMS), loud.score_items(ITEMS))


def test_dp_forward_refuses_all_position_labels():
  with pytest.raises(ValueError, match="loss_positions='last'"):
    SeqRecConfig(num_items=9, dp_forward=DPForwardConfig(noise_multiplier=1.0))


@pytest.mark.parametrize("position", ["output", "attention"])
def test_fits_with_ordinary_steps(position):
  model = make_model(position, reduced_dim=4)
  model.compile(optimizer=tf.keras.optimizers.Adam(1e-2))
  labels = np.zeros_like(ITEMS)
  labels[:, -1] = [6, 7]
  history = model.fit({"items": ITEMS}, labels, epochs=2, batch_size=2, verbose=0)
  assert np.isfinite(history.history["loss"]).all()
