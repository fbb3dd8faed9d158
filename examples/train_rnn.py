"""Train a multi-layer LSTM (Tofu's RNN workload) across --num_gpus devices with TofuStrategy.

TofuStrategy unrolls the recurrence (DTensor cannot expand Keras' While loop),
so keep --seq_len modest.

    python examples/train_rnn.py --layers=2 --hidden=256
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from examples import common  # noqa: E402

flags.DEFINE_integer("layers", 2, "LSTM layers.")
flags.DEFINE_integer("hidden", 256, "Hidden units per layer.")
flags.DEFINE_integer("seq_len", 16, "Time steps.")
flags.DEFINE_integer("input_dim", 64, "Features per time step.")
flags.DEFINE_enum("cell", "lstm", ["lstm", "gru"], "Recurrent cell.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from tofu_tf import models
    common.run(lambda: models.rnn(num_layers=FLAGS.layers, hidden=FLAGS.hidden, seq_len=FLAGS.seq_len,
                                  input_dim=FLAGS.input_dim, cell=FLAGS.cell))


if __name__ == "__main__":
    app.run(main)
