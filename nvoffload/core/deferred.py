"""A part of a :class:`~nvoffload.transfer.Future` whose transfer is known only later.

The second stage of a chain (:meth:`nvoffload.transfer.TransferEngine.then`,
started by the engine's dispatcher once the first is done), or the native
requests of a :class:`~nvoffload.io.TensorStore` transfer, submitted after the
store's lock is released (a submit blocks while the native queue is full).
"""

from __future__ import annotations

import threading
import time

from nvoffload.core.future import Future

__all__ = ["Deferred"]


class Deferred:
    """A :class:`Future` part that waits for :meth:`set` to name the future it stands for, then for that future."""

    __slots__ = ("_started", "inner")

    def __init__(self):
        self._started = threading.Event()
        self.inner: Future | None = None

    def set(self, inner: Future) -> None:
        self.inner = inner
        self._started.set()

    def wait_started(self, timeout_s: float) -> bool:
        return self._started.wait(timeout_s)

    def done(self) -> bool:
        return self._started.is_set() and self.inner.done()

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self._started.wait(timeout_s):
            return False
        exc = None
        try:
            self.inner.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError as e:
            exc = e
        except BaseException:  # noqa: BLE001 - reported by error()
            pass
        return exc is None or self.inner.done()

    def error(self, what: str | None) -> BaseException | None:
        return self.inner.exception(0)
