"""The model and data of ``fit_worker.py``, shared with the one-process reference."""
import numpy as np
import tensorflow as tf

GLOBAL_BATCH, EPOCHS, WIDTH, DEPTH = 64, 2, 256, 6


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * 4, 32)).astype("float32")
    y = np.tanh(x @ rng.standard_normal((32, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def build(optimizer, seed):
    keras = tf.keras  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((32,))] + [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05) if optimizer == "SGD" else keras.optimizers.Adam(0.002)
    model.compile(optimizer=opt, loss="mse")
    return model
