"""Where training's progress lines go (step, loss, checkpoints, evaluation results, ps
tasks serving), on the ``hostreduce.estimator`` logger."""
from __future__ import annotations

import logging
from typing import Any

__all__ = ["logger", "progress"]

logger = logging.getLogger("hostreduce.estimator")


def progress(message: str, *args: Any) -> None:
    """Log at INFO on ``hostreduce.estimator``.

    Scripts ported from ``tf.estimator`` turn progress on with
    ``tf.compat.v1.logging.set_verbosity(INFO)``. When the application configured no
    handler for hostreduce's logger, such a script still sees its progress, through
    TensorFlow's logger as before; also when the only handler is one that drops INFO
    (``logging.info`` called anywhere, TensorFlow's checkpoint code does, installs a
    root handler at WARNING).
    """
    if not (logger.hasHandlers() and logger.isEnabledFor(logging.INFO)):
        tf_logger = logging.getLogger("tensorflow")
        if tf_logger.handlers and tf_logger.isEnabledFor(logging.INFO):
            tf_logger.info(message, *args)
            return
    logger.info(message, *args)
