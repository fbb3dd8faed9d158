"""tf-keras's save/load harness for distribution strategies, with TofuStrategy.

tf-keras ships ``tf_keras/src/distribute/saved_model_test_base.py`` (the base of its
``keras_save_load_test.py`` and ``saved_model_save_load_test.py``) and the simple
functional, sequential and subclassed models those tests save
(``simple_models.py``). Each case trains a model for 100 steps, predicts, saves it
(``model.save`` in the TF SavedModel format, or ``tf.saved_model.save``), loads it
with or without a strategy and predicts again: the predictions must agree. The
loaders below follow the two upstream test files (keras-team/tf-keras); the
harness itself is used as installed.
"""

import pytest
import tensorflow as tf
import tf_keras as keras
from tf_keras.src.distribute import saved_model_test_base as harness
from tf_keras.src.distribute import simple_models

from tofu_tf.strategies import TofuStrategy

pytestmark = pytest.mark.slow   # tf-keras's own harness: every model and distribution combination it generates

MODELS = {"functional": simple_models.SimpleFunctionalModel, "sequential": simple_models.SimpleSequentialModel,
          "subclass": simple_models.SimpleSubclassModel}


class _KerasSaveLoad(harness.TestSavedModelBase):
    """keras_save_load_test: ``model.save(dir)``, ``keras.models.load_model(dir)``, ``predict``."""

    def _save_model(self, model, saved_dir):
        model.save(saved_dir, save_format="tf")

    def _load_and_run_model(self, distribution, saved_dir, predict_dataset, output_name="output_1"):
        restored = keras.models.load_model(saved_dir)
        return restored.predict(predict_dataset, steps=harness.PREDICT_STEPS)


class _SavedModelSaveLoad(harness.TestSavedModelBase):
    """saved_model_save_load_test: ``tf.saved_model.save``, ``tf.saved_model.load``, the
    serving signature."""

    def _save_model(self, model, saved_dir):
        tf.saved_model.save(model, saved_dir)

    def _load_and_run_model(self, distribution, saved_dir, predict_dataset, output_name="output_1"):
        return harness.load_and_run_with_saved_model_api(distribution, saved_dir, predict_dataset, output_name)


@pytest.fixture(params=[_KerasSaveLoad, _SavedModelSaveLoad], ids=["model_save", "saved_model_save"])
def case(request, tmp_path):
    test = request.param("run_test_save_strategy_restore_no_strategy")
    test.get_temp_dir = lambda: str(tmp_path)
    test.setUp()
    yield test
    test.tearDown()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("save_in_scope", [False, True])
def test_saved_under_tofu_restored_on_one_device(case, model, save_in_scope):
    case.run_test_save_strategy_restore_no_strategy(MODELS[model](), TofuStrategy(8), save_in_scope)


# tf.saved_model.load in the scope keeps the loaded variables as loaded (host, unpartitioned): the
# serving signature runs once per device on its shard (before: "no Keras model reachable"). Not yet:
# keras.models.load_model of a subclassed model, revived from its traced functions, has no model for
# the strategy to plan; it is refused before its first step, naming the way that works (the test below).
_NO_MODEL_TO_PLAN = {("model_save", "subclass")}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_saved_on_one_device_restored_under_tofu(case, model, request):
    flavor = "model_save" if isinstance(case, _KerasSaveLoad) else "saved_model_save"
    if (flavor, model) in _NO_MODEL_TO_PLAN:
        request.applymarker(pytest.mark.xfail(strict=True, reason="a revived SavedModel has no Keras model to plan"))
    case.run_test_save_no_strategy_restore_strategy(MODELS[model](), TofuStrategy(8))


def test_a_revived_subclassed_model_is_refused_before_its_step_naming_the_way_that_works(tmp_path):
    """keras_save_load_test's subclassed model loaded under the scope runs the functions saved with
    it, which hold the variables as loaded, not as the plan lays them out (before: DynamicShapeError
    from the revived call's traced shapes, then DTensor's 'In[1] is not a matrix' inside the step).
    Refused before any step, naming the way out; that way predicts as one device."""
    import numpy as np
    from tofu_tf.tf.keras_adapter import UnsupportedModelError

    model_fn = simple_models.SimpleSubclassModel()
    model = model_fn.get_model()
    features = np.random.default_rng(0).random((32, 3)).astype("float32")
    want = model.predict(features, batch_size=16, verbose=0)
    model.save(str(tmp_path / "saved"), save_format="tf")
    strategy = TofuStrategy(8)
    with strategy.scope():
        restored = keras.models.load_model(str(tmp_path / "saved"))
    with pytest.raises(UnsupportedModelError, match=r"loaded from a SavedModel as the functions saved with it.*"
                                                    r"model.load_weights\(<the SavedModel directory>/variables"):
        restored.predict(features, batch_size=16, verbose=0)
    with strategy.scope():
        rebuilt = model_fn.get_model()
        rebuilt.load_weights(str(tmp_path / "saved" / "variables" / "variables"))
    np.testing.assert_allclose(rebuilt.predict(features, batch_size=16, verbose=0), want, rtol=1e-5, atol=1e-6)
