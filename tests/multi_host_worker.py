"""One client of the multi-host tests (``tests/test_multi_host.py``), started per client by
``tofu_tf.launch.launch_local`` with DTensor's environment, or alone as a one-process run.

    python -m tests.multi_host_worker --model=mlp --work_dir=DIR [--restore=CKPT] [--save=CKPT]

Reads ``DIR/initial.npz`` (the weights to start from, unless ``--restore`` or ``--seeded_initial``) and
``DIR/data.npz`` (the global batch stream, the same file for every client), trains
``--steps`` steps of ``--batch_size`` under ``TofuStrategy(--num_gpus)`` on a mesh
that splits the batch over clients and the weights within each, and writes the
weights every client holds after training to ``DIR/weights_<client>.npz``, with
the layouts the run used in ``DIR/layouts_<client>.txt``.
"""

import os
import sys

from absl import app, flags

flags.DEFINE_string("model", "mlp", "A model of tests.strategy_helpers.MODELS.")
flags.DEFINE_string("work_dir", None, "Where initial.npz and data.npz are and the results go.")
flags.DEFINE_integer("num_gpus", 4, "Devices per client.")
flags.DEFINE_integer("batch_size", 8, "Global batch size.")
flags.DEFINE_string("mesh", "batch=2,model=4", "Mesh axes, name=size, comma-separated.")
flags.DEFINE_string("method", "tofu", "Planner.")
flags.DEFINE_string("client1_mesh", None, "Client 1's mesh, when it must differ from --mesh.")
flags.DEFINE_string("save", None, "Write a checkpoint of the model and optimizer here after training.")
flags.DEFINE_string("restore", None, "Restore this checkpoint instead of reading initial.npz, then train.")
flags.DEFINE_bool("dataset", False, "Train from a tf.data.Dataset of the data instead of numpy arrays.")
flags.DEFINE_integer("steps", 3, "Steps to train (0: only restore/save).")
flags.DEFINE_bool("die_after_plan", False, "Client 1 exits at once after planning (a client that dies).")
flags.DEFINE_bool("seeded_initial", False, "Keep the weights the seeded initializers draw (no initial.npz).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import numpy as np
    from tensorflow.experimental import dtensor

    from tofu_tf import TofuStrategy
    from tests import strategy_helpers as h

    client = dtensor.client_id()
    text = FLAGS.client1_mesh if FLAGS.client1_mesh and client == 1 else FLAGS.mesh
    mesh = {name: int(size) for name, size in (item.split("=") for item in text.split(","))}
    strategy = TofuStrategy(FLAGS.num_gpus, mesh_shape=mesh, method=FLAGS.method)
    with strategy.scope():
        model = h.build(FLAGS.model)
        h.compile_model(model)
    strategy.plan_model(model, batch_size=FLAGS.batch_size)
    if FLAGS.die_after_plan and client == 1:
        os._exit(3)
    checkpoint = _checkpoint(model)
    if FLAGS.restore:
        model.optimizer.build(model.trainable_variables)   # its slots, for the restore to fill
        checkpoint.read(FLAGS.restore).assert_consumed()
    elif not FLAGS.seeded_initial:
        model.set_weights(list(np.load(os.path.join(FLAGS.work_dir, "initial.npz")).values()))
    if FLAGS.steps:
        data = np.load(os.path.join(FLAGS.work_dir, "data.npz"))
        n = FLAGS.batch_size * FLAGS.steps
        if FLAGS.dataset:
            import tensorflow as tf
            dataset = tf.data.Dataset.from_tensor_slices((data["x"][:n], data["y"][:n])).batch(FLAGS.batch_size)
            model.fit(dataset, epochs=1, verbose=0)
        else:
            model.fit(data["x"][:n], data["y"][:n], batch_size=FLAGS.batch_size, epochs=1, shuffle=False, verbose=0)
    if FLAGS.save:
        checkpoint.write(FLAGS.save)
    model.save_weights(os.path.join(FLAGS.work_dir, f"weights_{client}.h5"))   # every client, its own file
    np.savez(os.path.join(FLAGS.work_dir, f"weights_{client}.npz"), *model.get_weights(),
             *[v.numpy() for v in model.optimizer.variables()[1:]])
    with open(os.path.join(FLAGS.work_dir, f"layouts_{client}.txt"), "w") as out:
        out.write(f"# devices per node {strategy.extended._options.hardware.devices_per_node}\n")
        extended = strategy.extended       # what Model Garden and Orbit ask each client
        out.write(f"# checkpoint {extended.should_checkpoint} summary {extended.should_save_summary} "
                  f"init {extended.experimental_should_init}\n")
        for variable in model.weights:
            layout = h.keras_adapter.tf_variable(variable).layout
            out.write(f"{variable.name} {' '.join(layout.sharding_specs)}\n")


def _checkpoint(model):
    import tensorflow as tf
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
