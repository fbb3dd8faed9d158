"""keras-hub's ``generate()`` after training under TofuStrategy returns one device's tokens.

Before, the first ``generate`` failed: keras-hub calls its own compiled decoding program
outside ``strategy.run`` on host tensors, and DTensor refused them beside the plan's
variables ("got a regular tensor for input 0 ... but was expecting a DTensor"); with the
prompts on the mesh, the key/value cache's ``slice_update`` and the top-k sampler's
multinomial draw had no DTensor layout propagation (``tofu_tf.tf.compat.keras_ops``,
``tofu_tf.tf.compat.decoding``); and a sampler made after training kept
its seed state on the host, which every device's part of the program advanced (the seed moved
8 steps per token). ``tofu_tf.strategies.generation`` and ``tofu_tf.tf.compat.decoding``.

The reference is the same model built outside the strategy with the trained weights
(``get_weights``): tokens must be identical. The plan's mesh splits the MLP kernels, so the
decoding program runs on split weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf.compat import decoding

VOCAB, SEQ = 64, 12
MESH = {"batch": 2, "model": 4}


def _strategy():
    """On MESH, GPT-2's MLP kernels split over 'model' (column- then row-parallel) by a layout map,
    the rest planned (the batch split over 'batch'): decoding reads split weights beside layer-input
    hints that split the batch, which decoding keeps whole (``compat.layers.batch_whole``: without
    it, "EmitAllScatter requires slice on input axis 0 which is dynamic"). The planner's own plan
    for this small model on the CPU profile keeps every weight whole on this mesh."""
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*feedforward_intermediate_dense/kernel"] = (None, "model")
    layout_map[".*feedforward_intermediate_dense/bias"] = ("model",)
    layout_map[".*feedforward_output_dense/kernel"] = ("model", None)
    return TofuStrategy(num_gpus=8, layout_map=layout_map)


# -- the two changes, op by op (fast) ---------------------------------------------------------

def test_the_cache_update_keeps_a_split_cache_split():
    """The decoding loop's cache update runs as tofu_tf.tf.compat.keras_ops rewrites it (its own
    tests compare the values with XLA's op): a cache split over the batch and the heads stays so."""
    from tofu_tf.tf.compat import keras_ops
    mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
    split = dtensor.Layout(["batch", "unsharded", "model", "unsharded"], mesh)
    cache = dtensor.call_with_layout(tf.zeros, split, shape=(4, 6, 4, 2))
    update = dtensor.relayout(dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(mesh, 4),
                                                       shape=(4, 1, 4, 2)), split)

    @tf.function
    def step(cache, update, index):
        return keras_ops.slice_update_as_select(cache, tf.stack([0, index, 0, 0]), update)

    out = step(cache, update, dtensor.copy_to_mesh(tf.constant(3), dtensor.Layout.replicated(mesh, 0)))
    assert dtensor.fetch_layout(out).sharding_specs == ["batch", "unsharded", "model", "unsharded"]
    from tofu_tf.tf.variables import gather_to_host
    value = gather_to_host(out, dtensor.fetch_layout(out))
    assert value[:, 3].min() == 1 and value.sum() == 4 * 4 * 2


def test_an_enrolled_multinomial_draws_one_devices_values_from_a_split_batch():
    decoding.enroll_replicated_ops()
    mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
    logits = tf.random.stateless_normal((8, 10), seed=(1, 2))
    expected = tf.random.stateless_categorical(logits, 3, seed=(3, 4))
    split = dtensor.relayout(dtensor.copy_to_mesh(logits, dtensor.Layout.replicated(mesh, 2)),
                             dtensor.Layout.batch_sharded(mesh, "batch", 2))
    drawn = tf.function(lambda x: tf.random.stateless_categorical(x, 3, seed=(3, 4)))(split)
    for shard in dtensor.unpack(drawn):
        np.testing.assert_array_equal(shard.numpy(), expected.numpy())


def test_the_switch_names_the_op_as_dtensor_reads_it():
    assert decoding.replicated_op_switch("tf.StatelessMultinomial") == \
        "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.STATELESSMULTINOMIAL"


# -- generate() end to end (keras-hub) --------------------------------------------------------

WORDS = ("the", "cat", "dog", "sat", "on", "mat", "ran", "a")


def _vocabulary() -> dict:
    vocabulary = {"<|endoftext|>": 0}
    for word in WORDS:
        vocabulary[word] = len(vocabulary)
        vocabulary["Ġ" + word] = len(vocabulary)
    for char in sorted(set("".join(WORDS))) + ["Ġ"]:
        vocabulary.setdefault(char, len(vocabulary))
        vocabulary.setdefault("Ġ" + char, len(vocabulary))
    return vocabulary


def _gpt2(with_preprocessor: bool):
    import keras_hub
    keras.utils.set_random_seed(1)
    vocabulary = _vocabulary()
    preprocessor = None
    if with_preprocessor:
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["Ġ c", "Ġc a"]
                                                   if "Ġca" in vocabulary else ["Ġ c"])
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=SEQ)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=len(vocabulary) if with_preprocessor else VOCAB,
                                             num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=128,
                                             max_sequence_length=SEQ)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def _sampler(name: str):
    import keras_hub
    return {"greedy": lambda: "greedy", "beam": lambda: keras_hub.samplers.BeamSampler(num_beams=3),
            "top_k": lambda: keras_hub.samplers.TopKSampler(k=5, seed=42),
            "top_p": lambda: keras_hub.samplers.TopPSampler(p=0.9, seed=3),
            "random": lambda: keras_hub.samplers.RandomSampler(seed=4),
            "contrastive": lambda: "contrastive"}[name]()


def _one_device(trained, with_preprocessor: bool, sampler: str):
    reference = _gpt2(with_preprocessor)
    reference.compile(sampler=_sampler(sampler))
    reference.set_weights(trained.get_weights())
    return reference


@pytest.fixture(scope="module")
def trained_lm():
    """A GPT-2 trained 2 steps under TofuStrategy, its token ids given as keras-hub's
    ``preprocessor=None`` docs give them."""
    strategy = _strategy()
    with strategy.scope():
        lm = _gpt2(with_preprocessor=False)
        lm.compile(optimizer=keras.optimizers.SGD(0.1),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    x = {"token_ids": rng.randint(0, VOCAB, (16, SEQ)), "padding_mask": np.ones((16, SEQ), "int32")}
    lm.fit(x, rng.randint(0, VOCAB, (16, SEQ)), batch_size=8, verbose=0)
    return strategy, lm


def _prompts(batch: int = 4):
    rng = np.random.RandomState(2)
    mask = np.zeros((batch, SEQ), bool)
    mask[:, :5] = True
    return {"token_ids": np.where(mask, rng.randint(1, VOCAB, (batch, SEQ)), 0).astype("int32"),
            "padding_mask": mask}


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["greedy", "top_k", "beam", "top_p", "random", "contrastive"])
def test_generate_after_training_returns_one_devices_tokens(trained_lm, sampler):
    strategy, lm = trained_lm
    split = [path for path, spec in strategy.plan.variable_layouts.items() if any(spec)]
    assert split, "the plan should split weights, so decoding runs on split weights"
    lm.compile(sampler=_sampler(sampler))              # after training, outside the scope, as keras-hub's guides do
    prompts = _prompts()
    tokens = lm.generate(prompts, stop_token_ids=None)
    expected = _one_device(lm, False, sampler).generate(prompts, stop_token_ids=None)
    np.testing.assert_array_equal(tokens["token_ids"], expected["token_ids"])
    np.testing.assert_array_equal(tokens["padding_mask"], expected["padding_mask"])
    assert tokens["padding_mask"][:, 5:].any(), "generation should have written past the prompt"
    for path in split:                                    # the weights were never relaid for decoding
        assert any(strategy.plan.variable_layouts[path])
    if sampler == "top_k":                               # the seed advanced once per token, as on one device
        assert lm.sampler.seed_generator.state.numpy().tolist() == [42, SEQ - 5]


@pytest.mark.slow
def test_generate_with_a_partial_batch_of_prompts_and_stop_tokens(trained_lm):
    _, lm = trained_lm
    lm.compile(sampler="greedy")
    prompts = _prompts(batch=3)                          # 3 prompts: the batch axis (2) does not divide them
    tokens = lm.generate(prompts, stop_token_ids=(7, 11))
    expected = _one_device(lm, False, "greedy").generate(prompts, stop_token_ids=(7, 11))
    np.testing.assert_array_equal(tokens["token_ids"], expected["token_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["greedy", "top_k"])
def test_generate_with_a_preprocessor_returns_one_devices_text(sampler):
    strategy = _strategy()
    with strategy.scope():
        lm = _gpt2(with_preprocessor=True)
        lm.compile(optimizer=keras.optimizers.SGD(0.1), sampler=_sampler(sampler))
    texts = ["the cat sat on the mat", "a dog ran", "the dog sat", "a cat ran on a mat"] * 4
    lm.fit(texts, batch_size=8, verbose=0)
    prompts = ["the cat", "a dog"]
    reference = _one_device(lm, True, sampler)
    generated = lm.generate(prompts, max_length=10, stop_token_ids=None)
    assert generated == reference.generate(prompts, max_length=10, stop_token_ids=None)
    assert all(text.startswith(prompt) for text, prompt in zip(generated, prompts))
    # keras-hub's default: stop at the tokenizer's end token
    assert lm.generate(prompts, max_length=10) == reference.generate(prompts, max_length=10)
    assert any(change.change.name == "generate_function_placed" for change in strategy.changes)


@pytest.mark.slow
def test_generate_after_a_data_parallel_fit_decodes_a_batch_the_plan_would_split():
    """GPT-2 with its tokenizer, trained under the default plan (data parallel on 8 CPUs), asked
    for 8 prompts, which the plan's batch axis divides. The prompts went to the decoding program
    split over it, and DTensor failed in keras-hub's loop, whose tensors of a dynamic batch size it
    cannot split ("EmitAllScatter requires slice on input axis 0 which is dynamic"); they go
    replicated now."""
    strategy = TofuStrategy(num_gpus=8)
    with strategy.scope():
        lm = _gpt2(with_preprocessor=True)
        lm.compile(optimizer=keras.optimizers.SGD(0.1), sampler="greedy")
    lm.fit(["the cat sat on the mat", "a dog ran", "the dog sat", "a cat ran on a mat"] * 4, batch_size=8, verbose=0)
    batch_axes = {layout[0] for layout in strategy.plan.input_layouts.values()}
    assert batch_axes == {"batch"} and strategy.plan.mesh_shape["batch"] == 8, strategy.plan.input_layouts
    prompts = ["the cat", "a dog", "the", "a cat ran", "dog", "the mat", "a", "sat on"]
    reference = _one_device(lm, True, "greedy")
    assert lm.generate(prompts, max_length=10, stop_token_ids=None) == \
        reference.generate(prompts, max_length=10, stop_token_ids=None)


@pytest.mark.slow
def test_generate_before_any_step_plans_from_the_prompts():
    strategy = _strategy()
    with strategy.scope():
        lm = _gpt2(with_preprocessor=False)
        lm.compile(sampler="greedy")
    prompts = _prompts()
    tokens = lm.generate(prompts, stop_token_ids=None)
    assert strategy.plan is not None and any(any(spec) for spec in strategy.plan.variable_layouts.values())
    expected = _one_device(lm, False, "greedy").generate(prompts, stop_token_ids=None)
    np.testing.assert_array_equal(tokens["token_ids"], expected["token_ids"])


@pytest.mark.slow
def test_generate_on_a_pipelined_strategy_is_refused_naming_the_way():
    from tofu_tf.strategies.pipelined import PipelineError
    strategy = TofuStrategy(num_gpus=8, pipeline=2)
    with strategy.scope():
        lm = _gpt2(with_preprocessor=False)
        lm.compile(sampler="greedy")
    with pytest.raises(PipelineError, match="without pipeline="):
        lm.generate(_prompts(), stop_token_ids=None)


@pytest.mark.slow
def test_a_seq2seq_model_generates_one_devices_tokens():
    import keras_hub

    def bart():
        keras.utils.set_random_seed(1)
        backbone = keras_hub.models.BartBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
                                                 intermediate_dim=128, max_sequence_length=SEQ)
        return keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)

    strategy = _strategy()
    with strategy.scope():
        lm = bart()
        lm.compile(optimizer=keras.optimizers.SGD(0.1),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    ones = np.ones((16, SEQ), bool)
    lm.fit({"encoder_token_ids": rng.randint(0, VOCAB, (16, SEQ)), "encoder_padding_mask": ones,
            "decoder_token_ids": rng.randint(0, VOCAB, (16, SEQ)), "decoder_padding_mask": ones},
           rng.randint(0, VOCAB, (16, SEQ)), batch_size=8, verbose=0)
    lm.compile(sampler=_sampler("top_k"))
    started = np.zeros((4, SEQ), bool)
    started[:, :2] = True
    prompts = {"encoder_token_ids": rng.randint(0, VOCAB, (4, SEQ)).astype("int32"),
               "encoder_padding_mask": np.ones((4, SEQ), bool),
               "decoder_token_ids": np.where(started, 2, 0).astype("int32"), "decoder_padding_mask": started}
    reference = bart()
    reference.compile(sampler=_sampler("top_k"))
    reference.set_weights(lm.get_weights())
    np.testing.assert_array_equal(lm.generate(prompts, stop_token_ids=None)["decoder_token_ids"],
                                  reference.generate(prompts, stop_token_ids=None)["decoder_token_ids"])


@pytest.mark.slow
def test_a_decoding_program_dtensor_refuses_is_named_with_the_way_that_works():
    """keras-hub Gemma trained under its own layout map (every attention kernel split over
    'model'): keras-hub's decoding loop transposes the head-split cache, which DTensor's
    expander refuses ("TransposeOp SPMD needs communication is not supported yet"). That came as
    DTensor's UnknownError and a page of MLIR; it is refused by name now, and the way the error
    names, a one-device copy's generate, gives one device's tokens."""
    import keras_hub
    from tofu_tf import hub_models
    from tofu_tf.strategies.export import one_device_copy
    from tofu_tf.strategies.generation import GenerationNotRunnableError

    def build():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(vocabulary_size=hub_models.VOCAB, num_layers=2, num_query_heads=4,
                                                  num_key_value_heads=4, hidden_dim=32, intermediate_dim=64,
                                                  head_dim=8)
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.SGD(0.1), sampler="greedy",
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return lm
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    strategy = TofuStrategy(8, layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh))
    with strategy.scope():
        lm = build()
    x, y = hub_models.data(hub_models.FAMILIES["gemma"], 16)
    lm.fit(x, y, batch_size=8, verbose=0)
    trained = lm.get_weights()
    rng = np.random.RandomState(2)
    mask = np.zeros((4, SEQ), bool)
    mask[:, :5] = True
    prompts = {"token_ids": np.where(mask, rng.randint(1, hub_models.VOCAB, (4, SEQ)), 0).astype("int32"),
               "padding_mask": mask}
    with pytest.raises(GenerationNotRunnableError, match=r"a Transpose op of global shape .*one_device_copy\(model\)"):
        lm.generate(prompts, stop_token_ids=None)
    assert all(np.array_equal(a, b) for a, b in zip(lm.get_weights(), trained))
    reference = build()
    reference.set_weights(trained)
    np.testing.assert_array_equal(one_device_copy(lm).generate(prompts, stop_token_ids=None)["token_ids"],
                                  reference.generate(prompts, stop_token_ids=None)["token_ids"])
