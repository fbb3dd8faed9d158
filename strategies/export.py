"""SavedModel export of a TofuStrategy model: traced on a one-device copy, never on the mesh.

A model TofuStrategy trains computes with DTensor: its weights are DTensor
variables on the mesh and some layers relayout their inputs
(``tofu_tf.tf.compat.layers.relayout_layer_inputs``). A SavedModel traced from it holds
``Relayout`` ops and DTensor resources, and no one-device runtime (a fresh
process, TF Serving) can run it: ``No OpKernel was registered to support Op
'Relayout'``. So every SavedModel export of such a model is made from a
**one-device copy** instead: the model rebuilt from its config outside the
mesh, on the host, its state (weights, optimizer slots and step counter,
metric totals) copied in one variable at a time through the host
(``TofuVariable.numpy`` assembles each from its shards; no mesh device ever
holds a full weight), compiled as the user compiled it. What is saved is then
what one device would save: plain variables, the same signatures, checkpoint
keys, object graph and Keras metadata (a one-device run that trained also leaves
a trace of its optimizer's XLA update step in the graph; the copy never stepped).

The user's calls stay unchanged, each reaching the copy through a hook ``install``
puts on the model (``keras_hooks.prepare_for_dtensor`` installs them; the change
"savedmodel_from_copy" of ``tofu_tf.tf.compat.registry``):

* ``model._trackable_children``: for a SavedModel (and only then: checkpoints
  keep their format) the model lists the copy's children, so the copy's layers,
  variables and traced functions are what ``tf.saved_model.save(model, dir)`` and
  tf-keras ``keras.models.save_model(model, dir)`` save; the model itself stays the
  root. (tf-keras then writes the root's Keras metadata from the model: equal
  content, but its shared-object ids link to the model's layers, not the copy's.)
* tf-keras ``model.save`` to a SavedModel (also what ``ModelCheckpoint`` to a
  directory calls): the copy's own ``save``, so even that metadata is one device's.
* ``model.export``: Keras 3 (and tf-keras) trace the endpoints when the export
  archive is built, before any save starts, so ``export`` runs on the copy (every
  format: a TFLite or ONNX export traces the model too).

A signature the user traced on the strategy's model
itself (``signatures=model.call.get_concrete_function(...)``) captures its DTensor
variables, and a concrete function keeps no Python function to trace again on the copy.
tf-keras ``model.save(dir, signatures=...)`` wraps such a signature in a function of the copy that
calls it with the copy's variables, where its graph holds no op of the mesh, and refuses it with
``DTensorExportError`` naming it where it does (``signatures_for_copy``);
``tf.saved_model.save(model, dir, signatures=...)`` is not redirected: trace such signatures on
``one_device_copy(model)`` and save that copy with them. A SavedModel that would hold a DTensor
variable anyway (a Keras 3 ``ExportArchive`` tracking the model directly) stops
with ``tofu_tf.tf.variables.DTensorExportError``, which says the same.

This module touches Keras internals (the compile config, the compiled metric
containers); a Keras upgrade that moves them changes this file.
"""

from __future__ import annotations

import contextlib
import threading
import types

import tensorflow as tf
from tensorflow.python.checkpoint import graph_view as graph_view_lib

from tofu_tf.tf import devices, keras_adapter
from tofu_tf.tf.variables import DTensorExportError

__all__ = ["DTensorExportError", "install", "one_device_copy"]

_COPIES = object()  # key of this module's entry in a SavedModel save's serialization cache


def install(model) -> bool:
    """Route ``model``'s SavedModel exports through a one-device copy. True when it changed the model."""
    if getattr(model, "_tofu_exports_copy", False):
        return False
    children = model._trackable_children  # pylint: disable=protected-access
    model._trackable_children = types.MethodType(_children_for(children), model)  # pylint: disable=protected-access
    if callable(getattr(model, "export", None)):
        model.export = _export_from_copy(model, model.export)
    if keras_adapter.framework_of(model) == "tf_keras":
        model.save = _save_from_copy(model, model.save)
    model._tofu_exports_copy = True  # pylint: disable=protected-access
    return True


def _export_from_copy(model, export):
    def export_from_copy(*args, **kwargs):
        """Keras' ``export`` (every format traces the model), run on the one-device copy."""
        return one_device_copy(model).export(*args, **kwargs)
    export_from_copy.__wrapped__ = export
    return export_from_copy


def _save_from_copy(model, save):
    def save_from_copy(filepath, *args, **kwargs):
        """tf-keras ``save``; a SavedModel is the one-device copy's own save (its root
        metadata then comes from the copy too, exactly as one device writes it). The
        ``.keras`` and ``.h5`` formats read the weights host-side already: unchanged."""
        from tf_keras.src.saving import saving_api
        save_format = kwargs.get("save_format", args[1] if len(args) > 1 else None)
        if saving_api.get_save_format(filepath, save_format) != "tf":
            return save(filepath, *args, **kwargs)
        copy = one_device_copy(model)
        if kwargs.get("signatures") is not None:
            kwargs["signatures"] = signatures_for_copy(model, copy, kwargs["signatures"])
        return copy.save(filepath, *args, **kwargs)
    save_from_copy.__wrapped__ = save
    return save_from_copy


_MESH_OPS = frozenset({"Relayout", "RelayoutLike", "CopyToMesh", "CopyToMeshGrad"})


def signatures_for_copy(model, copy, signatures):
    """SavedModel ``signatures`` the user traced on ``model`` itself, as functions of its one-device ``copy``.

    A signature traced on the strategy's model (``serve_fn.get_concrete_function(spec)`` over a
    function that calls the model) captures the model's DTensor variables, and a concrete function
    keeps no Python function to trace again. Where its graph holds no op of the mesh (``Relayout``,
    ``CopyToMesh``: the ops it runs are one device's, on the variables' global shapes), it is
    wrapped in a function traced on the copy that calls it with the copy's variables in place of
    the model's; layers and other objects the user attached to the model after building it (a
    preprocessing model, a lookup layer) are attached to the copy too, so the SavedModel tracks
    what the signature reads. A signature that relays out is refused with ``DTensorExportError``
    naming it and the way that works (trace it on ``one_device_copy(model)``); TF's own refusal
    names an 'untracked' resource."""
    named = dict(signatures) if isinstance(signatures, dict) else {"serving_default": signatures}
    sources, targets = _variables_by_path(model), _variables_by_path(copy)
    copy_of = {id(keras_adapter.backing_variable(sources[path]).handle): keras_adapter.backing_variable(targets[path])
               for path in sources if path in targets}
    for name, signature in named.items():
        concrete = signature if hasattr(signature, "captured_inputs") else None
        if concrete is None and hasattr(signature, "get_concrete_function"):
            try:
                concrete = signature.get_concrete_function()
            except (TypeError, ValueError):   # a tf.function without an input_signature: TF refuses it itself
                continue
        if concrete is None or not any(id(t) in copy_of for t in concrete.captured_inputs):
            continue
        if _MESH_OPS & _op_types(concrete.graph):
            raise DTensorExportError(
                f"SavedModel signature {name!r} was traced on {model.name!r} as TofuStrategy lays it out (it relays "
                "out the model's variables on the DTensor mesh), so no one-device runtime could run it. Trace it on "
                "copy = tofu_tf.one_device_copy(model) (the same weights on the host) and save that copy with it: "
                "copy.save(dir, signatures=...).")
        named[name] = _called_with(concrete, copy_of)
    _attach_like(copy, model)
    return named if isinstance(signatures, dict) else named["serving_default"]


def _op_types(graph) -> set:
    """The op types of ``graph`` and of every function in its library."""
    definition = graph.as_graph_def()
    return ({node.op for node in definition.node}
            | {node.op for function in definition.library.function for node in function.node_def})


def _called_with(concrete, copy_of):
    """A concrete function that calls ``concrete`` with the variables of ``copy_of`` (the copy's, by
    the handle of the model's each replaces) in place of the model's; ``concrete`` keeps its own
    captures afterwards (the user's function still runs on the mesh)."""
    captured = list(concrete.captured_inputs)
    concrete.set_external_captures([copy_of[id(t)].handle if id(t) in copy_of else t for t in captured])
    try:
        args, kwargs = concrete.structured_input_signature
        wrapper = tf.function(lambda *a, **k: concrete(*a, **k))
        return wrapper.get_concrete_function(*args, **kwargs)
    finally:
        concrete.set_external_captures(captured)


def _attach_like(copy, model) -> None:
    """Attach to ``copy`` what the user attached to ``model`` after building it (a trackable public
    attribute the copy lacks), the same object: a signature reads it through the model."""
    from tensorflow.python.trackable import base as trackable
    for name, value in vars(model).items():
        if not name.startswith("_") and isinstance(value, trackable.Trackable) and not hasattr(copy, name):
            setattr(copy, name, value)


def _children_for(children):
    def trackable_children(self, save_type="checkpoint", **kwargs):
        """The model's children; in a SavedModel, its one-device copy's (``tofu_tf.strategies.export``)."""
        if save_type != "savedmodel":
            return children(save_type, **kwargs)
        copies = kwargs["cache"].setdefault(_COPIES, {})
        if id(self) not in copies:            # one copy per save, however often the saver asks
            copies[id(self)] = one_device_copy(self)
        return copies[id(self)]._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access
    return trackable_children


def one_device_copy(model):
    """A plain Keras model equal to ``model``, for exports: same config, weights, compile
    arguments, optimizer state and metric totals, every variable on the host and none
    on the mesh.

    Built in a fresh thread. TF and Keras keep their scopes per thread, and the copy
    must be made outside every scope the caller may be in, as a one-device model was:
    a strategy's scope (its variables would be the strategy's), the save context of
    a SavedModel save, tf-keras' shared-object saving scope (the copy's configs would
    take ids in the saved metadata that one device's save does not have).
    """
    result = {}

    def run():
        try:
            result["copy"] = _copy(model)
        except BaseException as error:  # pylint: disable=broad-except  # re-raised in the caller's thread
            result["error"] = error
    thread = threading.Thread(target=run, name="tofu_tf-one-device-copy")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["copy"]


def _copy(model):
    with tf.device(devices.host_device()):
        copy = _rebuild(model)
        _compile_like(copy, model)
        _copy_state(copy, model)
    return copy


def _rebuild(model):
    """``model``'s architecture with fresh variables, as its class: a functional or Sequential
    model cloned layer by layer (``clone_model``: custom layers need no registration, and
    every layer keeps its name); any other (a subclass) from its config, then called on the
    inputs the model was called with, so it makes its weights under its name as at its
    first call (Keras 3's ``clone_model`` builds it outside that name: other paths).
    """
    keras = keras_adapter.keras_of(model)
    try:
        if _cloned_layer_by_layer(model):
            copy = keras.models.clone_model(model)
        else:
            copy = type(model).from_config(model.get_config())
    except (NotImplementedError, TypeError, ValueError) as error:
        raise DTensorExportError(
            f"TofuStrategy exports {model.name!r} from a one-device copy rebuilt from its config, and "
            f"rebuilding it failed ({type(error).__name__}: {error}). A subclassed model needs get_config() "
            "(and from_config() when its constructor takes more than the config).") from error
    if len(copy.weights) != len(model.weights):          # a subclassed model makes them at its first call
        _call_on_inputs(copy, model)
    return copy


def _cloned_layer_by_layer(model) -> bool:
    return type(model).__name__ in ("Functional", "Sequential") and type(model).__module__.startswith(
        ("tf_keras.", "keras."))


def _input_specs(model):
    """``(args, kwargs)`` specs of the model's first call, as each Keras records it for export, or None."""
    if hasattr(model, "save_spec"):                                       # tf-keras
        return model.save_spec(dynamic_batch=False)
    from keras.src.export import export_utils                            # Keras 3: its first call's shapes
    try:
        signature = export_utils.get_input_signature(model)
    except ValueError:                                                    # never called
        return None
    return tf.nest.map_structure(export_utils.make_tf_tensor_spec, list(signature)), {}


def _call_on_inputs(copy, model):
    """The copy's outputs traced on the inputs the model was called with (nothing computed;
    an unbuilt copy makes its weights on the way, as at its first call)."""
    spec = _input_specs(model)
    if spec is None:
        raise DTensorExportError(
            f"the one-device copy of {model.name!r} has no weights and the model records no inputs "
            "to build it with; call the model once (fit does) before exporting it.")
    args, kwargs = spec
    forward = tf.function(lambda a, k: copy(*a, **k), autograph=False)
    return forward.get_concrete_function(list(args), dict(kwargs)).structured_outputs


def _compile_like(copy, model) -> None:
    """Compile the copy with the model's compile arguments: a fresh optimizer of the same
    config (the model's holds DTensor variables), fresh metric objects, the same losses;
    then build what the model has built (optimizer slots, metric containers), so the
    copy holds every variable the model does.

    tf-keras' ``save(include_optimizer=False)`` detaches the optimizer from the model
    while it saves; the copy, made then, is compiled and detached alike.
    """
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    if config is None:                                   # not compiled
        return
    framework = keras_adapter.framework_of(model)
    arguments = dict(config)
    optimizer = getattr(model, "optimizer", None)
    source = optimizer if optimizer is not None else arguments.get("optimizer")
    if source is not None and not isinstance(source, str):
        arguments["optimizer"] = keras_adapter.fresh_optimizer(framework, source)
    for key in ("metrics", "weighted_metrics"):
        arguments[key] = tf.nest.map_structure(_fresh_metric, arguments.get(key))
    copy.compile(**arguments)
    if optimizer is None:
        copy.optimizer = None
        copy._delete_tracking("optimizer")  # pylint: disable=protected-access
    elif keras_adapter.optimizer_built(optimizer) and not keras_adapter.optimizer_built(copy.optimizer):
        _build_optimizer(copy.optimizer, _built_for(copy, model, optimizer), framework)
    _build_metrics_like(copy, model)


def _built_for(copy, model, optimizer) -> list:
    """The copy's variables its optimizer is built for: the copy's trainable weights, or, where the
    model's optimizer was built for weights the model no longer holds (float kernels
    ``model.quantize`` replaced by int8 ones after training), the list it was built for, each
    weight the model still holds as the copy's and each replaced one as a host stand-in of its
    path, shape and dtype. One device's quantized model keeps those references and their slots
    (Keras 3's ``_trainable_variables``); so does the copy, and its state pairs with the model's."""
    built_for = list(getattr(optimizer, "_trainable_variables", None) or ())  # pylint: disable=protected-access
    index = {id(keras_adapter.tf_variable(w)): i for i, w in enumerate(model.weights)}
    if not built_for or all(id(keras_adapter.tf_variable(v)) in index for v in built_for):
        return copy.trainable_variables
    import keras                                   # only Keras 3 models quantize
    from keras.src import backend
    variables = []
    for variable in built_for:
        position = index.get(id(keras_adapter.tf_variable(variable)))
        if position is not None:
            variables.append(copy.weights[position])
            continue
        *scopes, name = variable.path.split("/")
        with contextlib.ExitStack() as stack:          # the replaced weight's path, scope by scope
            for scope in scopes:
                stack.enter_context(backend.name_scope(scope))
            variables.append(keras.Variable(tf.zeros(variable.shape, variable.dtype), dtype=variable.dtype,
                                            name=name, trainable=True))
    return variables


def _build_optimizer(optimizer, variables, framework: str) -> None:
    """Make the optimizer's slots as its first ``apply_gradients`` makes them: under its
    name scope (tf-keras names a slot ``Adam/m/dense/kernel``); a loss-scale optimizer
    applies through its inner optimizer, whose scope that is."""
    if keras_adapter.is_legacy_optimizer(optimizer):
        keras_adapter.build_legacy_optimizer(optimizer, variables)
        return
    name = getattr(optimizer, "inner_optimizer", optimizer).name
    if framework == "tf_keras":
        with tf.name_scope(name or "optimizer"), tf.init_scope():
            optimizer.build(variables)
        return
    from keras.src import backend
    with backend.name_scope(name, caller=optimizer):
        optimizer.build(variables)


def _fresh_metric(metric):
    if hasattr(metric, "update_state") and hasattr(metric, "get_config"):   # a Metric object: its own variables
        return type(metric).from_config(metric.get_config())
    return metric


def _build_metrics_like(copy, model) -> None:
    """Build the copy's tf-keras compiled loss and metric containers when the model's are built.

    tf-keras builds them at the first step from (labels, predictions) and saves their
    totals in a SavedModel (``keras_api/metrics``). Only structure and shapes matter to
    the build; the labels' rank decides what a string metric (``"accuracy"``) means,
    and the model's built metrics tell which it became.
    """
    if keras_adapter.framework_of(model) != "tf_keras":
        return
    # pylint: disable=protected-access
    losses, metrics = getattr(model, "compiled_loss", None), getattr(model, "compiled_metrics", None)
    if losses is None or not (losses.built or metrics is not None and metrics.built):
        return
    predictions = _output_specs(copy, model)
    if losses.built:
        copy.compiled_loss.build(predictions)
    if metrics is not None and metrics.built:
        flat = tf.nest.flatten(predictions)
        per_output = list(metrics._metrics or [[]] * len(flat))
        weighted = list(metrics._weighted_metrics or [[]] * len(flat))
        labels = [_label_spec(spec, list(built or []) + list(extra or []))
                  for spec, built, extra in zip(flat, per_output, weighted)]
        copy.compiled_metrics.build(predictions, tf.nest.pack_sequence_as(predictions, labels))


def _output_specs(copy, model):
    """Specs of what the model returns, in its structure (what a step hands the containers)."""
    outputs = getattr(model, "_nested_outputs", None)                     # functional, Sequential
    if outputs is None:
        outputs = _call_on_inputs(copy, model)
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), outputs)


def _label_spec(prediction: tf.TensorSpec, built_metrics) -> tf.TensorSpec:
    sparse = any("sparse_categorical" in getattr(getattr(m, "_fn", None), "__name__", "") for m in built_metrics)
    return tf.TensorSpec(prediction.shape[:-1] if sparse else prediction.shape, prediction.dtype)


def _copy_state(copy, model) -> None:
    """Assign the model's state to the copy, variable by variable, through the host.

    Variables are paired by their path in the checkpoint object graph
    (``layer_with_weights-0/kernel``, ``optimizer/_variables/3``), which both
    models have alike, and checked by shape and dtype, and by name where the copy's
    layers took the model's names (cloned layer by layer; a subclass's layers are
    named anew by its constructor, ``dense_7`` becoming ``dense``): an export must
    never pair the wrong weights silently. Metric totals (not in checkpoints)
    follow by metric name.
    """
    sources, targets = _variables_by_path(model), _variables_by_path(copy)
    if set(sources) != set(targets):
        missing, extra = sorted(set(sources) - set(targets)), sorted(set(targets) - set(sources))
        raise DTensorExportError(
            f"the one-device copy of {model.name!r} does not hold the same variables as the model "
            f"(only in the model: {missing[:5]}; only in the copy: {extra[:5]}), so it cannot be "
            "exported as the model. Export one_device_copy(model) after fixing what differs.")
    pairs = [(sources[path], targets[path], path) for path in sorted(sources)]
    copied = {id(target) for _, target, _ in pairs}
    for source_metric, target_metric in _metric_pairs(copy, model):
        for source, target in zip(source_metric.variables, target_metric.variables):
            if id(target) not in copied:
                pairs.append((source, target, f"metric {target_metric.name}"))
    names_match = _cloned_layer_by_layer(model)
    for source, target, path in pairs:
        _assign(target, source, path, names_match=names_match)


def _variables_by_path(root) -> dict:
    objects, paths = graph_view_lib.ObjectGraphView(root).breadth_first_traversal()
    return {"/".join(ref.name for ref in paths[obj]): obj for obj in objects if _is_variable(obj)}


def _is_variable(obj) -> bool:
    return isinstance(obj, tf.Variable) or isinstance(getattr(obj, "value", None), tf.Variable)  # Keras 3 wraps one


def _metric_pairs(copy, model):
    by_name = {metric.name: metric for metric in getattr(copy, "metrics", [])}
    for metric in getattr(model, "metrics", []):
        if metric.name in by_name:
            yield metric, by_name[metric.name]


def _assign(target, source, path: str, *, names_match: bool) -> None:
    """``target = source`` (Keras variables or tf.Variables), after checking they are the same
    weight: the same shape, dtype and (``names_match``) Keras path (a Keras 3 variable's
    ``path``, a tf-keras variable's name)."""
    name, expected = keras_adapter.variable_path(target), keras_adapter.variable_path(source)
    target, source = keras_adapter.tf_variable(target), keras_adapter.tf_variable(source)
    if target.shape != source.shape or target.dtype != source.dtype or names_match and name != expected:
        raise DTensorExportError(
            f"the one-device copy pairs {path!r} with a different variable ({expected} {source.shape} "
            f"{source.dtype.name} vs {name} {target.shape} {target.dtype.name}); refusing to export a model "
            "whose weights might be permuted.")
    target.assign(source.numpy())     # TofuVariable.numpy: assembled from the shards on the host
