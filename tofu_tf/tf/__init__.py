"""The only part of tofu_tf that touches TensorFlow and Keras internals:
capture (tf.function -> IR), and later lowering and profiling."""
