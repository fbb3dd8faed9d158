"""Train a Wide ResNet (Tofu's CNN workload) across --num_gpus devices with TofuStrategy.

    python examples/train_wresnet.py --depth=10 --width=2 --image_size=32
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from examples import common  # noqa: E402

flags.DEFINE_integer("depth", 10, "Network depth (6n + 4).")
flags.DEFINE_integer("width", 2, "Width multiplier.")
flags.DEFINE_integer("image_size", 32, "Input height and width.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from tofu_tf import models
    common.run(lambda: models.wide_resnet(depth=FLAGS.depth, width=FLAGS.width, image_size=FLAGS.image_size))


if __name__ == "__main__":
    app.run(main)
