"""The planner's plans do not change unnoticed: each small model's plan (mesh, every
variable's and tensor's layout, strategies, modeled costs and memory) hashes to the
fingerprint stored in tests/plan_fingerprints.json.

Work that only makes planning faster must keep every fingerprint. A change meant to
change plans (the cost model, the strategies) rewrites the file:
    TOFU_UPDATE_PLAN_FINGERPRINTS=1 python -m pytest tests/test_plan_fingerprints.py
and the diff says which plans moved."""

import hashlib
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORED = os.path.join(ROOT, "tests", "plan_fingerprints.json")

MODELS = {
    "mlp": (32, lambda m: m.mlp(input_dim=64, width=256, depth=2)),
    "gpt": (8, lambda m: m.gpt(num_layers=2, d_model=64, num_heads=4, seq_len=16, vocab_size=128)),
    "rnn": (16, lambda m: m.rnn(num_layers=1, hidden=32, seq_len=4, unroll=True)),
}
SETTINGS = {
    "cpu-virtual 8": dict(num_devices=8, hardware="cpu-virtual"),
    "h100 8": dict(num_devices=8, hardware="h100-nvlink"),
    "h100 64": dict(num_devices=64, hardware="h100-nvlink"),
    "ideal 8": dict(num_devices=8, hardware="h100-nvlink", target="ideal"),
}


def _fingerprint(plan) -> str:
    fields = json.loads(plan.to_json())
    fields.pop("search_seconds", None)          # the only field that is not the plan
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def graphs():
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    import tf_keras
    out = {}
    for name, (batch, build) in MODELS.items():
        tf_keras.utils.set_random_seed(0)
        out[name] = capture_training_step(build(models), batch_size=batch, loss="sparse_categorical_crossentropy",
                                          optimizer="adam")
    return out


@pytest.mark.slow   # captures three models with TensorFlow, plans each four ways
def test_plans_keep_their_fingerprints(graphs):
    from tofu_tf.search import plan_graph
    found = {f"{model} {setting}": _fingerprint(plan_graph(graph, **options))
             for model, graph in graphs.items() for setting, options in SETTINGS.items()}
    if os.environ.get("TOFU_UPDATE_PLAN_FINGERPRINTS"):
        with open(STORED, "w", encoding="utf-8") as handle:
            json.dump(found, handle, indent=1, sort_keys=True)
            handle.write("\n")
    with open(STORED, encoding="utf-8") as handle:
        stored = json.load(handle)
    moved = sorted(key for key in found if stored.get(key) != found[key])
    assert not moved and set(stored) == set(found), (
        f"plans changed: {moved}; if meant, rewrite tests/plan_fingerprints.json (see this module's docstring)")
