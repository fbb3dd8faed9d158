"""tf.distribute strategies built on the tofu_tf engine.

Dependencies flow one way: strategies import tofu_tf, never the reverse
(``tofu_tf.TofuStrategy`` is a lazy re-export resolved at attribute access).
"""

from strategies.tofu_strategy import TofuStrategy

__all__ = ["TofuStrategy"]
