"""One GPU as 8: a keras-hub Llama that runs out of memory under MirroredStrategy trains under TofuStrategy.

The prepared device check of the project (bench/README.md records its figures). On a machine
with one large GPU it splits GPU 0 into 8 logical GPUs of ``--memory_gib`` each
(``tf.config.set_logical_device_configuration``), builds a keras-hub Llama whose training
state (fp32 weights, gradients and Adam's two slots: 16 bytes a parameter) is larger than one
logical GPU, and in a fresh process per side:

* trains it under ``tf.distribute.MirroredStrategy`` over the 8 logical GPUs: it is expected
  to run out of memory (the row says so, or gives its step if it fits);
* trains it under ``TofuStrategy(num_gpus=8, hardware=--profile)``, no layout written:
  steady step (median of steps 3..n), each logical GPU's peak memory
  (``tf.config.experimental.get_memory_info``) beside the plan's modeled per-device peak.

``--dry_run`` runs the same script on 8 virtual CPUs with a small Llama: the plan, the fit,
and the table, with the device's memory figures shown as n/a (TF keeps no per-device
allocator statistics on CPU). The test suite runs it that way; CI never needs a GPU.

    python bench/gpu_check.py [--memory_gib=12] [--num_layers=16] [--hidden_dim=2048]
    python bench/gpu_check.py --dry_run
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

flags.DEFINE_bool("dry_run", False, "8 virtual CPUs and a small Llama: the script's logic without a GPU.")
flags.DEFINE_float("memory_gib", 12.0, "Memory limit of each of the 8 logical GPUs, GiB.")
flags.DEFINE_integer("num_layers", 16, "Llama decoder layers.")
flags.DEFINE_integer("hidden_dim", 2048, "Llama hidden width (intermediate: 8/3 of it, rounded to 256).")
flags.DEFINE_integer("vocab", 32000, "Vocabulary size.")
flags.DEFINE_integer("seq_len", 256, "Tokens per sample.")
flags.DEFINE_integer("batch_size", 8, "Global batch size.")
flags.DEFINE_integer("steps", 8, "Steps of the measured fit.")
flags.DEFINE_string("profile", "h100-nvlink", "TofuStrategy's hardware profile.")
flags.DEFINE_string("side", None, "Internal: train under 'mirrored' or 'tofu' in this process and print JSON.")
FLAGS = flags.FLAGS

NUM_DEVICES = 8
DRY = dict(num_layers=2, hidden_dim=64, vocab=256, seq_len=16, batch_size=8, steps=4)


def _sizes() -> dict:
    if FLAGS.dry_run:
        return dict(DRY)
    return dict(num_layers=FLAGS.num_layers, hidden_dim=FLAGS.hidden_dim, vocab=FLAGS.vocab,
                seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, steps=FLAGS.steps)


def _devices():
    """8 logical GPUs on GPU 0 (before TensorFlow's runtime starts), or 8 virtual CPUs."""
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if FLAGS.dry_run or not gpus:
        if not FLAGS.dry_run:
            raise SystemExit("no GPU visible: run with --dry_run on a machine without one")
        from tofu_tf.tf import devices
        devices.provide_devices(NUM_DEVICES)
        return "CPU"
    limit_mib = int(FLAGS.memory_gib * 1024)
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)] * NUM_DEVICES)
    return "GPU"


def _llama(sizes):
    import keras
    import keras_hub
    hidden = sizes["hidden_dim"]
    intermediate = max(256, (hidden * 8 // 3) // 256 * 256) if not FLAGS.dry_run else 2 * hidden
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=sizes["vocab"], num_layers=sizes["num_layers"], num_query_heads=max(4, hidden // 128),
        num_key_value_heads=max(2, hidden // 512), hidden_dim=hidden, intermediate_dim=intermediate)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(sizes):
    import numpy as np
    rng = np.random.default_rng(0)
    samples = sizes["batch_size"] * sizes["steps"]
    tokens = rng.integers(1, sizes["vocab"], (samples, sizes["seq_len"])).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    return x, np.roll(tokens, -1, axis=1)


def _train_here(side: str) -> dict:
    """Trains under ``side`` in this process: steady step, per-device peaks, the plan's model."""
    device_type = _devices()
    import keras
    import tensorflow as tf
    from tofu_tf.strategies import TofuStrategy
    sizes = _sizes()
    if side == "mirrored":
        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices(device_type)])
    else:
        strategy = TofuStrategy(NUM_DEVICES, hardware=FLAGS.profile, plan_cache=False)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _llama(sizes)
    x, y = _data(sizes)
    ends = []

    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    start = time.perf_counter()
    try:
        model.fit(x, y, batch_size=sizes["batch_size"], shuffle=False, verbose=0, callbacks=[StepEnds()])
    except tf.errors.ResourceExhaustedError:
        return {"side": side, "params": model.count_params(), "out_of_memory": True}
    steps = [b - a for a, b in zip([start] + ends, ends)]
    row = {"side": side, "params": model.count_params(), "out_of_memory": False,
           "steady_ms": statistics.median(steps[2:]) * 1e3, "first_step_s": steps[0]}
    if device_type == "GPU":
        row["peak_bytes"] = [tf.config.experimental.get_memory_info(f"GPU:{i}")["peak"] for i in range(NUM_DEVICES)]
    if side == "tofu":
        row["modeled_peak_bytes"] = strategy.plan.peak_memory_bytes
        row["mesh"] = dict(strategy.plan.mesh_shape)
    return row


def _in_fresh_process(side: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), f"--side={side}", f"--memory_gib={FLAGS.memory_gib}",
            f"--num_layers={FLAGS.num_layers}", f"--hidden_dim={FLAGS.hidden_dim}", f"--vocab={FLAGS.vocab}",
            f"--seq_len={FLAGS.seq_len}", f"--batch_size={FLAGS.batch_size}", f"--steps={FLAGS.steps}",
            f"--profile={FLAGS.profile}"] + (["--dry_run"] if FLAGS.dry_run else [])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        tail = out.stderr[-2000:]
        if "ResourceExhausted" in tail or "OOM" in tail or "out of memory" in tail.lower():
            return {"side": side, "out_of_memory": True}
        raise RuntimeError(f"the {side} run failed (exit {out.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _mib(nbytes) -> str:
    return f"{nbytes / 2 ** 20:.1f}"


def main(argv):
    del argv
    if FLAGS.side:
        print(json.dumps(_train_here(FLAGS.side)), flush=True)
        return
    sizes = _sizes()
    print(f"keras-hub Llama {sizes['num_layers']} layers x {sizes['hidden_dim']}, vocab {sizes['vocab']}, "
          f"seq {sizes['seq_len']}, batch {sizes['batch_size']}, Adam fp32; 8 "
          + ("virtual CPUs (dry run)" if FLAGS.dry_run else f"logical GPUs of {FLAGS.memory_gib:g} GiB on GPU 0")
          + f"; plan profile {FLAGS.profile}", flush=True)
    print(f"{'strategy':<10}{'params':>14}{'steady ms':>11}{'peak MiB/dev (max)':>20}{'modeled MiB/dev':>17}  mesh")
    failed = False
    for side in ("mirrored", "tofu"):
        row = _in_fresh_process(side)
        params = f"{row['params']:,}" if "params" in row else "?"
        if row["out_of_memory"]:
            print(f"{side:<10}{params:>14}{'out of memory':>31}")
            failed |= side == "tofu"
            continue
        peak = _mib(max(row["peak_bytes"])) if "peak_bytes" in row else "n/a"
        modeled = _mib(row["modeled_peak_bytes"]) if "modeled_peak_bytes" in row else ""
        print(f"{side:<10}{params:>14}{row['steady_ms']:>11.1f}{peak:>20}{modeled:>17}  {row.get('mesh', '')}",
              flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
