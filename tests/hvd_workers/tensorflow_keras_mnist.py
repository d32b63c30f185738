"""A script in the shape of Horovod's TensorFlow Keras MNIST example (``tensorflow.keras``
imports, ``model.fit`` on numpy arrays with validation data), with the same calls in the
same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod.keras as hvd``;
* TensorFlow 2 and Keras 3: ``tf.compat.v1.ConfigProto``; no ``K.set_session`` (Keras 3
  has no session); checkpoints end in ``.keras`` instead of ``.h5``;
* the data: scikit-learn's 8x8 digits scaled to MNIST's 28x28 (no download), and the
  epochs and checkpoint directory from the command line so that tests stay short.

At the end every rank prints a digest of its weights (``RESULT rank R/N: weights=...``).

Run: ``hostreduce run -np 2 -- python tensorflow_keras_mnist.py EPOCHS DIR``.
"""
import math
import os
import sys

import tensorflow as tf
from tensorflow import keras
from tensorflow.keras.models import Sequential
from tensorflow.keras.layers import Dense, Dropout, Flatten
from tensorflow.keras.layers import Conv2D, MaxPooling2D
from tensorflow.keras import backend as K

import hostreduce.horovod.keras as hvd

from tests.hvd_workers.digest import report
from tests.seed_workers import digits

EPOCHS = float(sys.argv[1]) if len(sys.argv) > 1 else 12.0
CHECKPOINT_DIR = sys.argv[2] if len(sys.argv) > 2 else "."

hvd.init()

# Pin the GPU of this process's local rank.
config = tf.compat.v1.ConfigProto()
config.gpu_options.allow_growth = True
config.gpu_options.visible_device_list = str(hvd.local_rank())

batch_size = 128
num_classes = 10

# The epochs divided by the number of workers.
epochs = int(math.ceil(EPOCHS / hvd.size()))

img_rows, img_cols = 28, 28

(x_train, y_train), (x_test, y_test) = digits.load_mnist()

if K.image_data_format() == "channels_first":
    x_train = x_train.reshape(x_train.shape[0], 1, img_rows, img_cols)
    x_test = x_test.reshape(x_test.shape[0], 1, img_rows, img_cols)
    input_shape = (1, img_rows, img_cols)
else:
    x_train = x_train.reshape(x_train.shape[0], img_rows, img_cols, 1)
    x_test = x_test.reshape(x_test.shape[0], img_rows, img_cols, 1)
    input_shape = (img_rows, img_cols, 1)

x_train = x_train.astype("float32")
x_test = x_test.astype("float32")
x_train /= 255
x_test /= 255
print("x_train shape:", x_train.shape)
print(x_train.shape[0], "train samples")
print(x_test.shape[0], "test samples")

y_train = keras.utils.to_categorical(y_train, num_classes)
y_test = keras.utils.to_categorical(y_test, num_classes)

model = Sequential()
model.add(Conv2D(32, kernel_size=(3, 3), activation="relu", input_shape=input_shape))
model.add(Conv2D(64, (3, 3), activation="relu"))
model.add(MaxPooling2D(pool_size=(2, 2)))
model.add(Dropout(0.25))
model.add(Flatten())
model.add(Dense(128, activation="relu"))
model.add(Dropout(0.5))
model.add(Dense(num_classes, activation="softmax"))

# Scale the learning rate by the number of workers.
opt = keras.optimizers.Adadelta(1.0 * hvd.size())

# Reduce the gradients over the job.
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1)

model.compile(loss=keras.losses.categorical_crossentropy, optimizer=opt, metrics=["accuracy"])

callbacks = [
    # Start every worker from rank 0's weights.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
]

# Only rank 0 writes checkpoints.
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(CHECKPOINT_DIR, "checkpoint-{epoch}.keras")))

model.fit(x_train, y_train, batch_size=batch_size, callbacks=callbacks, epochs=epochs,
          verbose=1 if hvd.rank() == 0 else 0, validation_data=(x_test, y_test))
score = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])

report(hvd.rank(), hvd.size(), model.variables + opt.variables)
