"""Training pieces the benchmarks share inside their worker processes: TensorFlow's
thread pools, TensorFlow's collective ring strategy, the project's examples, and an
Estimator ``model_fn`` that applies Adam on the host to the reduced gradients
(hostreduce's ``host_call``)."""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

from benchmarks.harness.jobs import REPO_ROOT

__all__ = ["tf_threads", "tf_ring_strategy", "example_module", "host_adam_model_fn"]


def tf_threads(plan: dict) -> None:
    """TensorFlow's intra- and inter-op pools as the plan says (before any op runs)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(plan["intra_op_threads"])
    tf.config.threading.set_inter_op_parallelism_threads(plan["inter_op_threads"])


def tf_ring_strategy() -> Any:
    """TensorFlow's ``MultiWorkerMirroredStrategy`` with its collective ring
    (``CommunicationImplementation.RING``), on the cluster of ``TF_CONFIG``."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def example_module(example: str, module: str) -> Any:
    """``examples/<example>/<module>.py`` of the project, imported (its model and data)."""
    path = str(REPO_ROOT / "examples" / example)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(module)


def host_adam_model_fn(build: Callable[[dict], Any], learning_rate: Callable[[dict], float]) -> Callable[..., Any]:
    """A ``model_fn`` for hostreduce's Estimator: the Keras model ``build(params)`` makes,
    sparse softmax cross-entropy on its logits, and Adam (``learning_rate(params)``)
    applied on the host to the reduced gradients."""

    def model_fn(features: Any, labels: Any, mode: str, params: dict) -> Any:
        import keras
        import tensorflow as tf

        from hostreduce.estimator import EstimatorSpec, compute_gradients

        model = build(params)
        logits = model(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        optimizer = keras.optimizers.Adam(learning_rate(params))
        grads = compute_gradients(loss, model.trainable_variables)

        def host_apply(*reduced: Any) -> None:
            optimizer.apply_gradients(zip(reduced, model.trainable_variables))

        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_apply, grads))

    return model_fn
