"""TensorBoard scalars of an Estimator run, written by the chief: what
``RunConfig(save_summary_steps=N)`` asks for.

Training scalars (``loss``, ``global_step/sec``, ``examples/sec``) go to ``model_dir``,
evaluation results to ``model_dir/eval``, as ``tf.estimator`` laid them out, so that
``tensorboard --logdir model_dir`` shows both. The events are written with TensorFlow's
own summary op and the scalar plugin's metadata: TensorBoard reads them, and TensorFlow
does not need the ``tensorboard`` package to write them.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["SummaryWriter", "read_scalars"]

_SCALAR_PLUGIN = "scalars"
_DATA_CLASS_SCALAR = 1


def _metadata() -> bytes:
    import tensorflow as tf

    meta = tf.compat.v1.SummaryMetadata(
        plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name=_SCALAR_PLUGIN),
        data_class=_DATA_CLASS_SCALAR)
    return meta.SerializeToString()


class SummaryWriter:
    """Scalars into one TensorBoard log directory; a no-op where ``logdir`` is None."""

    def __init__(self, logdir: str | None) -> None:
        self.logdir = logdir
        self._writer: Any = None
        self._meta = b""

    @property
    def enabled(self) -> bool:
        return self.logdir is not None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write ``values`` (tag -> number) at ``step``; non-numbers are skipped."""
        if self.logdir is None:
            return
        import tensorflow as tf

        if self._writer is None:
            os.makedirs(self.logdir, exist_ok=True)
            with tf.init_scope():
                self._writer = tf.summary.create_file_writer(self.logdir)
            self._meta = _metadata()
        with self._writer.as_default():
            for tag, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    tf.summary.write(tag, tf.constant(float(value), tf.float32), step=step, metadata=self._meta)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``logdir`` (not its subdirectories):
    tag -> [(step, value), ...] in the order written."""
    import tensorflow as tf

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(f for f in os.listdir(logdir) if f.startswith("events.out.tfevents."))
    for name in files:
        for record in tf.data.TFRecordDataset(os.path.join(logdir, name)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.HasField("tensor"):
                    number = float(tf.make_ndarray(value.tensor))
                else:
                    number = float(value.simple_value)
                out.setdefault(value.tag, []).append((int(event.step), number))
    return out
