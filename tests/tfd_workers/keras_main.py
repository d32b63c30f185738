"""TensorFlow's multi-worker Keras tutorial (``multi_worker_with_keras``) as one script:
its ``main.py`` (``fit`` on the global batch), then its sections on saving the model,
checkpoints and ``BackupAndRestore``, with the same calls in the same order. Changed:

* the strategy line: ``hostreduce.MultiWorkerStrategy()`` for
  ``tf.distribute.MultiWorkerMirroredStrategy()``;
* local data (``mnist_setup.py``), and the epochs, steps and paths from the command line;
* Keras 3 only: ``model.save`` needs a ``.keras`` file name (``MODEL_SUFFIX``).

Each worker prints its losses and ``RESULT rank R/N: weights=<digest>``.

Run: ``hostreduce run -np 2 -- python keras_main.py EPOCHS STEPS DIR``.
"""
import json
import os
import sys

import tensorflow as tf

import hostreduce
from tests.hvd_workers.digest import report
from tests.tfd_workers import mnist_setup

EPOCHS, STEPS, WORKDIR = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
MODEL_SUFFIX = "" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else ".keras"

per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = hostreduce.MultiWorkerStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()

history = multi_worker_model.fit(multi_worker_dataset, epochs=EPOCHS, steps_per_epoch=STEPS)
print("LOSSES", json.dumps(history.history["loss"]), flush=True)

# -- saving the model: the chief writes to the path, the others to a temporary one
model_path = os.path.join(WORKDIR, "keras-model" + MODEL_SUFFIX)


def _is_chief(task_type, task_id):
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)
multi_worker_model.save(write_model_path)
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

# -- checkpoints
checkpoint_dir = os.path.join(WORKDIR, "ckpt")
checkpoint = tf.train.Checkpoint(model=multi_worker_model)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = tf.train.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
checkpoint_manager.save()
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(write_checkpoint_dir)

latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=STEPS)

# -- BackupAndRestore: the training state is backed up at epoch boundaries
callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=os.path.join(WORKDIR, "backup"))]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks)

report(task_id, num_workers, multi_worker_model.weights)
