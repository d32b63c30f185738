"""The three modes a ``model_fn`` is called in."""
from __future__ import annotations

__all__ = ["ModeKeys"]


class ModeKeys:
    """Standard names for ``model_fn`` modes (the values match ``tf.estimator.ModeKeys``)."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"

    ALL = (TRAIN, EVAL, PREDICT)

    @classmethod
    def check(cls, mode: object) -> str:
        from ..errors import SpecError

        if mode not in cls.ALL:
            raise SpecError(f"`mode` must be one of {list(cls.ALL)}. Received: mode={mode!r}")
        return mode  # type: ignore[return-value]
