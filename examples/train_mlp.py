"""Train an MLP (depth x Dense(width) + head) across --num_gpus devices with TofuStrategy.

    python examples/train_mlp.py                       # 8 devices, width 1024
    python examples/train_mlp.py --width=4096 --depth=4 --compare=data_parallel
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from examples import common  # noqa: E402

flags.DEFINE_integer("width", 1024, "Hidden width.")
flags.DEFINE_integer("depth", 4, "Hidden layers.")
flags.DEFINE_integer("input_dim", 1024, "Input features.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from tofu_tf import models
    common.run(lambda: models.mlp(input_dim=FLAGS.input_dim, width=FLAGS.width, depth=FLAGS.depth))


if __name__ == "__main__":
    app.run(main)
