"""Models whose class writes its own ``train_step``, planned from that step.

keras.io's "Customizing what happens in fit()" trains a GAN as a ``keras.Model`` subclass with
no ``call``: a discriminator and a generator as attributes, ``compile(d_optimizer, g_optimizer,
loss_fn)``, and a ``train_step`` with two ``GradientTape``s, each optimizer updating its own
sub-model, and ``Mean`` metrics of its own. A VAE's step computes its KL and reconstruction
losses itself. Planning such a model from its compiled loss (``capture_training_step``) calls the
model (a GAN has no ``call``: NotImplementedError) and traces a step the model never runs (one
loss, one optimizer). What ``fit`` runs is the model's ``train_step``, so that is what is planned:
it is traced on the first batch's specs as a custom loop's step function is
(``tofu_tf.tf.capture.capture_step_function``: buffer-less variables, each optimizer's
``apply_gradients`` redirected to a fresh copy while traced), with every optimizer the model holds
as an attribute (``d_optimizer``, ``g_optimizer``; the compiled ``optimizer`` when the step uses
it). This module decides which models that is and finds their optimizers; the strategy plans.
"""

from __future__ import annotations

from tofu_tf import ir
from tofu_tf.errors import TofuError
from tofu_tf.strategies import keras_hooks
from tofu_tf.strategies import pipelined
from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat import optimizers as compat_optimizers
from tofu_tf.tf.compat.registry import Applied, change

class UnsupportedStepError(TofuError, NotImplementedError):
    """A model's own ``train_step`` computes something no plan can run on DTensor."""


# Stateful random draws, by what a step writes to get each: DTensor has no layout propagation for
# them ("Stateful random operations are not supported in DTensor"), even replicated, from a
# constant shape (tests/test_dtensor_expanders.py re-checks each). Keras' own Dropout layers draw
# statelessly under the strategy (the change "dropout_step_seeded"), so in a model's own step these
# come from the step's code.
STATEFUL_DRAWS = {"RandomStandardNormal": "tf.random.normal", "RandomUniform": "tf.random.uniform",
                  "RandomUniformInt": "tf.random.uniform", "TruncatedNormal": "tf.random.truncated_normal",
                  "Multinomial": "tf.random.categorical"}

# Where Keras' own train_step lives (a model inheriting it trains its compiled loss), and
# keras-hub's task models, whose steps are Keras'.
_KERAS_MODULES = ("keras.", "tf_keras.", "keras_hub.")


def overrides_train_step(model) -> bool:
    """Whether ``model``'s class (or a base of it outside Keras) defines its own ``train_step``."""
    method = getattr(type(model), "train_step", None)
    module = getattr(method, "__module__", "") or ""
    return method is not None and not module.startswith(_KERAS_MODULES)


def compiled_with_several_optimizers(model) -> bool:
    """Whether ``model`` was compiled with a list of optimizers: tf-keras' ``WideDeepModel``
    takes one per sub-model (``compile(optimizer=[linear_opt, dnn_opt])``) and its own
    ``train_step`` (in tf-keras, so ``overrides_train_step`` does not see it) applies each to its
    sub-model's weights. Keras' one-optimizer step cannot be planned for it; that step can."""
    optimizer = getattr(model, "optimizer", None)
    return keras_adapter.is_sequence(optimizer) and len(optimizer) > 1


def plans_own_step(model) -> bool:
    """Whether the strategy plans ``model`` from its ``train_step`` (traced as ``fit`` runs it)
    rather than from its compiled loss and optimizer: a class that writes its own step, or a
    tf-keras premade model compiled with an optimizer per sub-model."""
    return overrides_train_step(model) or compiled_with_several_optimizers(model)


def optimizers_of(model) -> list:
    """The optimizers ``model`` holds as attributes, in the order they were set (a GAN's
    ``d_optimizer`` and ``g_optimizer``), the compiled ``optimizer`` among them (each of a
    compiled list: a WideDeepModel's); each once."""
    found, seen = [], set()
    compiled = getattr(model, "optimizer", None)
    compiled = list(compiled) if compiled_with_several_optimizers(model) else [compiled]
    candidates = list(vars(model).values()) + compiled
    for candidate in candidates:
        if keras_hooks.is_optimizer(candidate) and id(candidate) not in seen:
            seen.add(id(candidate))
            found.append(candidate)
    return found


def prepare_optimizers(optimizers, strategy) -> list:
    """What the strategy does to a compiled optimizer, done to each of a custom step's
    (``tofu_tf.tf.compat.optimizers``): a tf-keras one made before the scope adopted, slots made as
    shards, gradients relaid to their variables' layouts, a legacy optimizer's sparse updates rewritten,
    moving averages kept. The records of
    what changed (None where nothing did)."""
    changes = []
    for optimizer in optimizers:
        changes += [compat_optimizers.adopt_optimizer(optimizer, strategy),
                    compat_optimizers.defer_slot_zeros(optimizer),
                    compat_optimizers.relayout_gradients(optimizer),
                    compat_optimizers.sparse_updates_dense(optimizer),
                    compat_optimizers.unfuse_dense_updates(optimizer),
                    compat_optimizers.update_moving_averages(optimizer)]
    return changes


def mark_built(model) -> Applied | None:
    """Mark a planned model with no ``call`` of its own built, when all its layers are.

    Under a distribution strategy Keras 3's ``fit`` builds an unbuilt model symbolically, by
    calling it (``_maybe_symbolic_build``), before its first step; a GAN has no ``call`` and is
    never built (its sub-models are), so ``fit`` stopped there ("Unable to automatically build the
    model"), as it does under MirroredStrategy. On one device Keras skips that build. The strategy
    plans such a model from its own ``train_step``, which makes whatever variables the step needs
    (optimizer state) as it is traced, and its layers hold their weights already: the model is
    marked built (the change "train_step_model_built") and Keras goes on to run that step."""
    call = getattr(type(model), "call", None)
    if not overrides_train_step(model) or getattr(model, "built", True) or not str(getattr(call, "__module__", "")).startswith(_KERAS_MODULES):
        return None
    layers = [layer for layer in model._flatten_layers(include_self=False)]  # pylint: disable=protected-access
    if not all(layer.built for layer in layers):
        return None
    model.built = True
    return Applied(change("train_step_model_built"), model.name, "built: it has no call; its layers are built")


def allow_global_mean_losses(model) -> list:
    """Let the tf-keras ``Loss`` objects a custom step holds reduce to the batch mean (``AUTO``).

    tf-keras refuses an ``AUTO`` or ``SUM_OVER_BATCH_SIZE`` loss called under any strategy outside
    ``compile``'s container ("Please use ... Reduction.SUM or ... NONE ... with
    tf.distribute.Strategy"): under MirroredStrategy each replica's mean would be over its own slice
    and the gradients summed over replicas. TofuStrategy runs one program over the global batch
    (one replica): the mean is the global batch's, one device's. Each such loss the model holds as
    an attribute (keras.io's GAN: ``self.loss_fn``) is marked as ``compile``'s container marks its
    losses (the change "custom_step_loss_marked")."""
    changes = []
    for name, value in list(vars(model).items()):
        if type(value).__module__.startswith("tf_keras") and hasattr(value, "_allow_sum_over_batch_size") \
                and not value._allow_sum_over_batch_size:  # pylint: disable=protected-access
            value._allow_sum_over_batch_size = True  # pylint: disable=protected-access
            changes.append(Applied(change("custom_step_loss_marked"), f"{model.name}.{name}",
                                   "reduces to the global batch's mean"))
    return changes


def prepare(model, strategy) -> list:
    """What the strategy changes, once, on a model that writes its own ``train_step`` and on the
    objects that step uses (its optimizers, its tf-keras losses; the model marked built when it has
    no ``call``); nothing for any other model. The records of what changed (None: nothing)."""
    if not plans_own_step(model):
        return []
    return (prepare_optimizers(optimizers_of(model), strategy) + allow_global_mean_losses(model)
            + [mark_built(model)])


def refuse_pipeline(model) -> None:
    """A pipelined strategy cuts a model's ``call`` into stages and runs Keras' own step over them;
    a model that writes its own ``train_step`` (a GAN: two tapes over sub-models, no ``call``) has
    no such step to cut. Refused before any stage is planned, naming the plan that trains it."""
    raise pipelined.PipelineError(
        f"{model.name} trains by its own train_step, and a pipelined TofuStrategy cuts a model's call into stages "
        "and runs Keras' own step over them: drop pipeline= (the strategy then plans the model from its "
        "train_step and shards it over all devices).")


def refuse_stateful_draws(graph: ir.Graph, model) -> ir.Graph:
    """``graph`` (the captured step of ``model``'s own ``train_step``), or an error naming each
    stateful random draw in it and its stateless form, before any step runs."""
    found = [op for op in graph.ops if op.type in STATEFUL_DRAWS]
    if not found:
        return graph
    lines = "\n".join(f"  * {STATEFUL_DRAWS[op.type]} ({op.type} {op.name!r}, layer {op.layer!r})" for op in found)
    raise UnsupportedStepError(
        f"{model.name}.train_step draws random numbers with stateful ops, which DTensor cannot run in any layout:\n"
        f"{lines}\nDraw them statelessly, seeded per step: tf.random.stateless_normal(shape, seed=...) (and "
        "stateless_uniform, stateless_truncated_normal, stateless_categorical), with a seed made from the step "
        "(e.g. tf.stack([tf.cast(optimizer.iterations, tf.int32), salt])), or in Keras 3 keras.random.normal(shape, "
        "seed=self.seed_generator) with a keras.random.SeedGenerator. TofuStrategy draws those whole, as one "
        "device draws them.")


def has_own_call(model) -> bool:
    """Whether ``model``'s class (or a base outside Keras) defines ``call``."""
    call = getattr(type(model), "call", None)
    return call is not None and not str(getattr(call, "__module__", "")).startswith(_KERAS_MODULES)


def has_call(model) -> bool:
    """Whether ``model`` can be called on its features: its class or a Keras class below ``Model``
    (a premade model, ``Sequential``) defines ``call``; a keras.io GAN's is ``Model.call``, which raises."""
    call = getattr(type(model), "call", None)
    return call is not None and getattr(call, "__qualname__", "") != "Model.call"


def plans_only_from_a_batch(model) -> bool:
    """Whether only ``model``'s own ``train_step``, traced on a batch, says what it trains: it has no
    ``call`` (a GAN), or its step applies an optimizer per sub-model (a WideDeepModel)."""
    return plans_own_step(model) and (not has_own_call(model) or compiled_with_several_optimizers(model))


def refuse_plan_without_data(model) -> None:
    """``strategy.plan_model`` of a model only its own ``train_step`` plans, with no batch to trace it on."""
    why = (f"is compiled with {len(model.optimizer)} optimizers, which its train_step applies each to its own "
           "sub-model" if compiled_with_several_optimizers(model) else "has no call and writes its own train_step")
    raise keras_adapter.UnsupportedModelError(
        f"{model.name} {why}: TofuStrategy plans that step by tracing it on a batch. Pass one to "
        "strategy.plan_model(model, batch_size=..., features=<a batch as fit passes it to train_step>), or let "
        "the first fit plan it.")
