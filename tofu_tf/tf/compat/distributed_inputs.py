"""A strategy's own distributed dataset, passed to tf-keras' ``fit`` as MirroredStrategy's is.

TensorFlow's guide to Keras with distribution strategies shows both ways of feeding ``fit``: a
``tf.data.Dataset`` (Keras distributes it), or one the user distributed already
(``strategy.experimental_distribute_dataset(ds)``, ``strategy.distribute_datasets_from_function``),
with ``steps_per_epoch`` given. tf-keras recognizes the second by type
(``data_adapter._is_distributed_dataset``: a ``tf.distribute.DistributedDataset`` or a
``DTensorDataset``), and TofuStrategy's distributed dataset (``tofu_tf.strategies.batches``) is
neither: ``fit`` stopped with "Failed to find data adapter that can handle input". The change
"distributed_batches_accepted" makes that check also accept a TofuStrategy's distributed dataset,
while a TofuStrategy is alive: tf-keras then takes it as it takes MirroredStrategy's (no second
distribution, ``steps_per_epoch`` required, one iterator over the epochs). tf-keras asks this of the
data of a ``fit``/``evaluate``/``predict`` before it makes its step function, so the dataset is told
then (its method named ``TAKEN_BY_KERAS``): the strategy prepares the model Keras is about to run, as
it does when Keras distributes a dataset itself. Keras 3 recognizes distributed datasets by
TensorFlow's class names and is not changed.
"""

from __future__ import annotations

import sys
from typing import Callable

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change

# The method that marks a TofuStrategy's distributed dataset, called when tf-keras takes it (this
# module cannot import the strategies, which depend on it).
TAKEN_BY_KERAS = "tofu_taken_by_keras"


def _tf_keras_data_adapter():
    if "tf_keras" not in sys.modules:        # a Keras 3 user does not pay tf-keras's import
        return None
    from tf_keras.src.engine import data_adapter
    return data_adapter, "_is_distributed_dataset"


def _accepting_marked(original: Callable) -> Callable:
    def _is_distributed_dataset(ds):
        taken = getattr(ds, TAKEN_BY_KERAS, None)
        if callable(taken):
            taken()
            return True
        return original(ds)
    return _is_distributed_dataset


DISTRIBUTED_INPUTS = patching.HeldPatch(change("distributed_batches_accepted"), _tf_keras_data_adapter, _accepting_marked)


def hold_distributed_inputs(strategy) -> None:
    """Let tf-keras' ``fit`` take ``strategy``'s distributed datasets while it is alive (the module
    docstring says why); installed once tf-keras is imported (``DISTRIBUTED_INPUTS.refresh()``)."""
    DISTRIBUTED_INPUTS.hold(strategy)
