"""Train a GPT-style decoder across --num_gpus devices with TofuStrategy.

    python examples/train_gpt.py --layers=2 --d_model=128
    python examples/train_gpt.py --plan_only --layers=12 --d_model=768
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from examples import common  # noqa: E402

flags.DEFINE_integer("layers", 2, "Transformer blocks.")
flags.DEFINE_integer("d_model", 128, "Model width.")
flags.DEFINE_integer("heads", 8, "Attention heads.")
flags.DEFINE_integer("seq_len", 64, "Sequence length.")
flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from tofu_tf import models
    common.run(lambda: models.gpt(num_layers=FLAGS.layers, d_model=FLAGS.d_model, num_heads=FLAGS.heads,
                                  seq_len=FLAGS.seq_len, vocab_size=FLAGS.vocab))


if __name__ == "__main__":
    app.run(main)
