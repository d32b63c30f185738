"""``Handle``: a collective in flight, completed by its engine with a result or an error."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import CollectiveTimeoutError

__all__ = ["Handle", "LinkedHandle"]


class Handle:
    """A collective in flight. ``wait()`` returns its result or raises its error."""

    __slots__ = ("name", "_event", "_result", "_error", "_callbacks", "_lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._event.wait(timeout):
            raise CollectiveTimeoutError(
                f"Collective {self.name!r} did not complete within timeout={timeout} s"
            )
        if self._error is not None:
            raise self._error
        return self._result

    def wait_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the collective has finished (no raise)."""
        return self._event.wait(timeout)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # Engines complete handles through these two methods.
    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class LinkedHandle(Handle):
    """A handle completed from another one (``inner``: the engine's, once known), e.g. a
    tensor's in a fusion bucket, or a compressed collective's cast back. A wait waits on
    ``inner`` first, since an engine may act on a wait (the ring tells its peers that
    this rank is blocked)."""

    __slots__ = ("inner",)

    def __init__(self, name: str, inner: Handle | None = None) -> None:
        super().__init__(name)
        self.inner = inner

    def wait(self, timeout: float | None = None) -> Any:
        inner = self.inner
        if inner is not None and not self.done():
            start = time.monotonic()
            try:
                inner.wait(timeout)
            except BaseException:  # noqa: BLE001 - delivered to this handle by its callback
                pass
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        return super().wait(timeout)
