"""A variable TofuStrategy makes while a ``tf.function`` traces its first call, recorded as the
function's own.

A ``tf.function`` traces its first call under a variable creator of its own
(``Function._initialize``'s ``variable_capturing_scope``) and, when that trace created
variables, traces the function again before running it, now with the variables in place: code
that read a layer's ``trainable_variables`` before the layer was built in that call (tf-keras's
``test_variable_run_argument``: ``strategy.run(step, (net.trainable_variables, features))``, the
Dense built inside ``step``) reads them in the second trace. TofuStrategy's creator makes its
variables itself (deferred, or laid out on the mesh, under ``tf.init_scope``) and never reaches
the function's creator, so the function saw no variable made, kept its first trace, and ran it
at every call: a step that applies no gradient, silently.

The change ``function_told_of_variables`` (during variable creation, TF-private): where the
strategy makes a variable inside a function's first trace, the variable is appended to that
function's list of created variables (the list the function's creator appends to, read from the
creator's closure on the tracing graph's creator stack), as the function's creator would have
appended it; the function then traces again, as for a variable it made itself. The variable is
already initialized (the strategy's own), so nothing needs lifting.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tofu_tf.tf.compat.registry import change

CHANGE = change("function_told_of_variables")
_CREATOR_NAME = "variable_capturing_scope"          # Function._initialize's creator
_LIST_NAME = "created_variables"                    # the list in its closure


def _created_list(creator) -> list | None:
    code = getattr(creator, "__code__", None)
    if getattr(creator, "__name__", "") != _CREATOR_NAME or code is None or _LIST_NAME not in code.co_freevars:
        return None
    contents = creator.__closure__[code.co_freevars.index(_LIST_NAME)].cell_contents
    return contents if isinstance(contents, list) else None


def tell_tracing_functions(variable) -> bool:
    """Record ``variable`` with every ``tf.function`` whose first trace is running on this thread
    (its creator on the current graph's creator stack); whether one was told. Keras builds a
    layer under ``tf.init_scope`` (eager), where the default graph is still the function's."""
    graph = tf.compat.v1.get_default_graph()
    told = False
    for _, creator in getattr(graph, "_variable_creator_stack", ()):   # pylint: disable=protected-access
        created = _created_list(creator)
        if created is not None:
            created.append(weakref.ref(variable))
            told = True
    return told
