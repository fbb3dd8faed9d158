"""Plans handed to TofuStrategy are checked: the plan when adopted, each variable as it is
made, and the entries no variable took at the first training step; every problem named."""

import logging

import keras as keras3
import numpy as np
import pytest
import tf_keras

from tests import strategy_helpers as h
from tofu_tf import models, plan_check
from tofu_tf.plan import Plan
from tofu_tf.plan_check import PlanError
from tofu_tf.strategies import TofuStrategy

MESH = {"batch": 2, "model": 4}
BATCH = {"x": ("batch",)}


def _hand(layouts, mesh=None, inputs=None):
    return h.HandPlan(mesh_shape=dict(mesh or MESH), variable_layouts=layouts, input_layouts=inputs or BATCH)


def _mlp(keras=tf_keras):
    keras.utils.set_random_seed(3)
    model = models.mlp(width=32, depth=2, keras=keras)        # dense_0 (16, 32), dense_1 (32, 32), head (32, 10)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 16)).astype("float32"), rng.integers(0, 10, (16,)).astype("int32")


# -- the plan itself, when adopted: before any device or variable ---------------------------

def test_a_mesh_that_does_not_use_every_device_is_refused_with_the_sizes():
    with pytest.raises(PlanError, match="mesh \\(batch=2, model=2\\) has 4 devices and the strategy has 8; the axis "
                                        "sizes must multiply to 8"):
        TofuStrategy(8, plan=_hand({}, mesh={"batch": 2, "model": 2}))


def test_every_problem_of_a_hand_plan_comes_in_one_error_at_construction():
    plan = _hand({"dense_0/kernel": (None, "modle"), "dense_1/kernel": ("model", "model"),
                  "head/kernel": ("model", 1)}, inputs={"x": ("data",)})
    with pytest.raises(PlanError) as caught:
        TofuStrategy(8, plan=plan)
    assert caught.value.problems == (
        "variable_layouts['dense_0/kernel']: dim 1 names axis 'modle', which is not in mesh (batch=2, model=4)",
        "variable_layouts['dense_1/kernel']: axis 'model' splits two dims of ('model', 'model'); DTensor splits one "
        "dim per mesh axis",
        "variable_layouts['head/kernel']: dim 1 is 1; entries are mesh axis names or null",
        "input_layouts['x']: dim 0 names axis 'data', which is not in mesh (batch=2, model=4)")
    assert "Fix those entries, or plan the model again" in str(caught.value)


def test_a_plan_in_any_form_is_adopted_as_the_plan(tmp_path):
    strategy = TofuStrategy(8, method="megatron")
    with strategy.scope():
        model = _mlp()
    plan = strategy.plan_model(model, batch_size=8)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    for given in (plan.to_json(), str(path), plan.to_dict()):
        adopted = TofuStrategy(8, plan=given).plan
        assert isinstance(adopted, Plan) and adopted == plan


def test_a_plan_that_is_not_one_is_refused_before_devices():
    with pytest.raises(PlanError, match="plan= got a list, which has no mesh_shape"):
        TofuStrategy(8, plan=[("batch", 8)])


# -- each variable, as it is made -------------------------------------------------------------

def test_a_layout_of_the_wrong_rank_is_refused_naming_variable_shape_and_layout():
    strategy = TofuStrategy(8, plan=_hand({"dense_0/kernel": ("model",)}))
    with pytest.raises(PlanError, match="plan layout \\('model',\\) for variable 'dense_0/kernel' of shape \\(16, 32\\) "
                                        "is not legal on mesh \\(batch=2, model=4\\): it has 1 entries and the "
                                        "variable has rank 2"):
        with strategy.scope():
            _mlp()


def test_a_split_the_axis_does_not_divide_names_the_dim():
    strategy = TofuStrategy(8, plan=_hand({"head/kernel": (None, "model")}))
    with pytest.raises(PlanError, match="'head/kernel' of shape \\(32, 10\\) is not legal on mesh \\(batch=2, model=4\\): "
                                        "dim 1 \\(10\\) does not divide evenly over mesh axis 'model' of size 4"):
        with strategy.scope():
            _mlp()


# -- entries no variable took, at the first training step -------------------------------------

def test_renamed_variables_are_refused_before_the_first_step_runs():
    strategy = TofuStrategy(8, plan=_hand({"dense_zero/kernel": (None, "model"), "dense_0/bias": ("model",),
                                           "heads/kernel": (None, None)}))
    with strategy.scope():
        model = _mlp()
    initial = model.get_weights()
    x, y = _data()
    with pytest.raises(PlanError) as caught:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert caught.value.problems == (
        "variable_layouts['dense_zero/kernel'] (None, 'model') matches no variable of the model",
        "weights no entry matched (they run replicated): 'dense_1/kernel' (32, 32), 'dense_0/kernel' (16, 32), "
        "'head/kernel' (32, 10), 'dense_1/bias' (32,), 'head/bias' (10,)")
    assert "Name each entry by a variable's path" in str(caught.value)
    for got, want in zip(model.get_weights(), initial):   # the step never ran
        np.testing.assert_array_equal(got, want)


def test_a_keras3_suffix_of_the_wrong_rank_is_named_with_the_variable_it_missed():
    strategy = TofuStrategy(8, plan=_hand({"dense_0/kernel": ("model",)}))
    with strategy.scope():
        model = _mlp(keras3)
    x, y = _data()
    with pytest.raises(PlanError, match="variable_layouts\\['dense_0/kernel'\\] \\('model',\\) matches no variable of "
                                        "the model; 'mlp/dense_0/kernel' of shape \\(16, 32\\) ends with it but has "
                                        "another rank"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def test_slot_entries_wait_for_the_first_training_step():
    """A plan naming the momentum slot (made at the first training step): predict first is no error."""
    strategy = TofuStrategy(8, plan=_hand({"dense_0/kernel": (None, "model"), "SGD/m/dense_0/kernel": (None, "model")}))
    with strategy.scope():
        model = _mlp()
    x, y = _data()
    model.predict(x, batch_size=8, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert strategy.extended._entries_checked  # pylint: disable=protected-access


@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
def test_the_planners_own_plans_leave_no_entry_untaken(keras, caplog):
    """Adam's two slots per weight, named by capture, are taken by the slots Keras makes."""
    strategy = TofuStrategy(8, method="megatron")
    with strategy.scope():
        model = _mlp(keras)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    with caplog.at_level(logging.WARNING):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert any(any(a is not None for a in layout) for layout in strategy.plan.variable_layouts.values())
    assert strategy.extended._entries_checked  # pylint: disable=protected-access
    assert "no variable took" not in caplog.text


def test_unmatched_entries_that_split_nothing_are_no_loss():
    layouts = {"a": (None, "model"), "b": (None, None), "optimizer/iteration": (), "c": ("batch",)}
    assert plan_check.unmatched_entries(layouts, {"c"}) == ["a"]
