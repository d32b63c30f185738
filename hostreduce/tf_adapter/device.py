"""TF Adapter's device handle on hostreduce: ``npu.open().as_default()`` in a script
whose import line became ``import hostreduce as npu``.

There is no device to open: TensorFlow places the model as it would without
hostreduce, and the job (the ring under ``TF_CONFIG``/``hostreduce run``, MPI under
``mpirun``) is found at the first ``npu.distribute`` call. The handle keeps the device
id it was given, so a script that reads it back still runs.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError

__all__ = ["DeviceHandle", "open"]


class DeviceHandle:
    """What ``open`` returns; ``as_default()`` returns the handle itself."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    def as_default(self) -> "DeviceHandle":
        return self

    def __repr__(self) -> str:
        return f"DeviceHandle(device_id={self.device_id})"


def open(device_id: Any = None) -> DeviceHandle:  # noqa: A001 (TF Adapter's name)
    """A handle for ``device_id`` (default: ``ASCEND_DEVICE_ID``, else 0)."""
    if device_id is None:
        text = os.environ.get("ASCEND_DEVICE_ID", "0")
        try:
            device_id = int(text)
        except ValueError:
            raise ConfigError(f"`ASCEND_DEVICE_ID` must be an integer. Received: ASCEND_DEVICE_ID={text!r}") from None
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ConfigError(f"`device_id` must be a non-negative integer. Received: device_id={device_id!r}")
    return DeviceHandle(device_id)
