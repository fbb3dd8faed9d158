"""``bench/compared_models.global_load_balancing``: under MirroredStrategy, keras-hub's
mixture-of-experts load-balancing loss computed over the global batch, as one device computes it.

``bench/vs_mirrored.py`` compares TofuStrategy's data parallel with the MirroredStrategy step that
computes the same thing; for Mixtral and the Qwen MoE families that step needs the loss's token
fractions and router means over every replica's tokens (by default each replica takes its own).
Checked here on keras-hub's own function, value and gradient, against one device on the global
batch; the unpatched function is checked to differ, so the comparison can fail."""

import numpy as np
import pytest
import tensorflow as tf

from bench import compared_models
from tests.conftest import NUM_DEVICES

mixtral_decoder = pytest.importorskip("keras_hub.src.models.mixtral.mixtral_decoder")

TOKENS_PER_REPLICA, EXPERTS, TOP_K, SEQ = 8, 4, 2, 4


@pytest.fixture(scope="module")
def mixtral():
    """A real keras-hub Mixtral (small, random weights): the patch finds its module through the
    model's layers."""
    from tofu_tf import hub_models
    return hub_models.mixtral(16)


@pytest.fixture(scope="module")
def mirrored():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:NUM_DEVICES]
    return compared_models.mirrored_strategy(devices)


def test_a_mirrored_strategy_after_another_process_group_of_the_same_key_runs():
    """Two MirroredStrategies of 4 and 8 devices, the 4's all-gather first: numbering their groups
    from the same key (as every MirroredStrategy does from 1), the 8's would be refused."""
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    gathered = tf.function(lambda: tf.distribute.get_replica_context().all_gather(tf.ones([1]), 0))
    four = compared_models.mirrored_strategy(cpus[:4])
    eight = compared_models.mirrored_strategy(cpus[:NUM_DEVICES])
    assert four.experimental_local_results(four.run(gathered))[0].shape == (4,)
    assert eight.experimental_local_results(eight.run(gathered))[0].shape == (NUM_DEVICES,)


def _global_inputs():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(NUM_DEVICES * TOKENS_PER_REPLICA, EXPERTS)).astype("float32")
    mask = (rng.random(size=(NUM_DEVICES * TOKENS_PER_REPLICA // SEQ, SEQ)) > 0.25).astype("int32")
    return logits, mask


def _per_replica_loss_and_gradient(strategy, logits, mask):
    """Each replica's loss and the gradient to its own logits, through the module's function as
    the MoE layer calls it (a module global, looked up at the call)."""
    logits_per_replica = tf.split(logits, NUM_DEVICES)
    mask_per_replica = tf.split(mask, NUM_DEVICES)

    def replica_fn():
        index = tf.distribute.get_replica_context().replica_id_in_sync_group
        local_logits = tf.gather(tf.stack(logits_per_replica), index)
        local_mask = tf.gather(tf.stack(mask_per_replica), index)
        with tf.GradientTape() as tape:
            tape.watch(local_logits)
            loss = mixtral_decoder.compute_load_balancing_loss(local_logits, EXPERTS, TOP_K, local_mask)
        return loss, tape.gradient(loss, local_logits)

    losses, gradients = strategy.run(tf.function(replica_fn))
    return ([v.numpy() for v in strategy.experimental_local_results(losses)],
            [v.numpy() for v in strategy.experimental_local_results(gradients)])


def _one_device(logits, mask):
    logits = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = mixtral_decoder.compute_load_balancing_loss(logits, EXPERTS, TOP_K, tf.constant(mask))
    return loss.numpy(), tape.gradient(loss, logits).numpy()


def test_every_replica_computes_one_devices_loss_and_its_share_of_the_gradient(mirrored, mixtral):
    logits, mask = _global_inputs()
    expected_loss, expected_gradient = _one_device(logits, mask)
    with compared_models.global_load_balancing(mixtral) as patched:
        assert patched == 1
        losses, gradients = _per_replica_loss_and_gradient(mirrored, logits, mask)
    np.testing.assert_allclose(losses, [expected_loss] * NUM_DEVICES, rtol=1e-6)
    # Every replica's loss holds every token's term, so all_gather's gradient (the replicas'
    # upstream gradients summed, then this replica's slice) is NUM_DEVICES times one device's;
    # the optimizer's mean over replicas brings it back.
    np.testing.assert_allclose(np.concatenate(gradients) / NUM_DEVICES, expected_gradient, rtol=1e-5, atol=1e-7)


def test_unpatched_replicas_take_their_own_tokens_and_the_patch_is_undone(mirrored, mixtral):
    logits, mask = _global_inputs()
    expected_loss, _ = _one_device(logits, mask)
    with compared_models.global_load_balancing(mixtral):
        pass
    losses, _ = _per_replica_loss_and_gradient(mirrored, logits, mask)
    assert max(abs(loss - expected_loss) for loss in losses) > 1e-3
