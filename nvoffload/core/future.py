"""The one future type of nvoffload: every transfer (NVMe, host-device copy, GPUDirect) returns a :class:`Future`."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["Future", "Part", "WAIT_LIMIT_S", "deadline_after"]


def _wait_limit_s() -> float:
    raw = os.environ.get("NVOFFLOAD_WAIT_LIMIT_S", "600")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"NVOFFLOAD_WAIT_LIMIT_S must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"NVOFFLOAD_WAIT_LIMIT_S must be positive, got {raw!r}")
    return value


WAIT_LIMIT_S = _wait_limit_s()
"""The longest any wait in nvoffload lasts before it raises ``TimeoutError`` saying what it waited for
(``NVOFFLOAD_WAIT_LIMIT_S``, default 600 s)."""


def deadline_after(timeout_s: float | None) -> float:
    """The monotonic time a wait of ``timeout_s`` (None: :data:`WAIT_LIMIT_S`) ends."""
    return time.monotonic() + (WAIT_LIMIT_S if timeout_s is None else timeout_s)


class Part(Protocol):
    """One piece of work a :class:`Future` waits for: a native I/O ticket, a copy's event, a kvikio request."""

    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds; True when finished."""
        ...

    def error(self, what: str | None) -> BaseException | None:
        """The part's failure, as an exception naming ``what`` (the tensor), once finished; else None."""
        ...


class Future:
    """The pending result of a transfer: ``done()`` and ``result(timeout)``.

    A future waits for its parts (native I/O tickets, copy events, other
    futures), then runs its completion step once (``finish(error)``: copy out of
    a bounce buffer, verify a checksum, release a buffer) and keeps its value or
    error: ``result()`` returns or raises the same every time. Errors name the
    tensor (``what``). A wait longer than ``timeout`` (default
    :data:`WAIT_LIMIT_S`) raises ``TimeoutError`` saying what is still running;
    the future stays pending and can be waited for again.

    ``event`` is set for a copy that lands in device memory: the compute stream
    orders itself after it (:meth:`nvoffload.transfer.TransferEngine.wait`)
    without the host waiting.
    """

    __slots__ = ("_parts", "_finish", "what", "_keepalive", "_lock", "_resolved", "_value", "_error", "event", "chain")

    def __init__(
        self,
        parts: Iterable[Part] = (),
        finish: Callable[[BaseException | None], Any] | None = None,
        *,
        what: str | None = None,
        keepalive: Any = None,
        event: Any = None,
    ):
        self._parts = list(parts)
        self._finish = finish
        self.what = what
        self._keepalive = keepalive  # memory a native thread or a copy engine still reads or writes
        self._lock = threading.Lock()
        self._resolved = False
        self._value: Any = None
        self._error: BaseException | None = None
        self.event = event
        self.chain = None  # set by TransferEngine.then: the stage that starts the second transfer

    @classmethod
    def completed(cls, value: Any = None) -> Future:
        future = cls()
        future._resolved, future._value = True, value
        return future

    @classmethod
    def failed(cls, error: BaseException) -> Future:
        future = cls()
        future._resolved, future._error = True, error
        return future

    @classmethod
    def all_of(
        cls, futures: Iterable[Future], *, what: str | None = None, finish: Callable[[BaseException | None], Any] | None = None
    ) -> Future:
        """A future done when every one of ``futures`` is; it raises the first error once all finished (``finish``:
        its completion step, given that error)."""
        return cls([_Nested(f) for f in futures], finish, what=what)

    def done(self) -> bool:
        if self._resolved:
            return True
        for part in self._parts:
            if not part.done():
                return False
        return True

    def result(self, timeout: float | None = None) -> Any:
        if not self._resolved:
            self._resolve(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def _resolve(self, timeout: float | None) -> None:
        """Wait for the parts and run the completion step, once (under the lock: one thread runs it)."""
        with self._lock:
            if not self._resolved:
                self._wait(timeout)
                error = next((e for e in (p.error(self.what) for p in self._parts) if e is not None), None)
                try:
                    self._value = self._finish(error) if self._finish is not None else None
                except BaseException as exc:  # the completion step's own failure wins
                    error = exc
                self._error, self._resolved = error, True
                self._parts, self._finish, self._keepalive = [], None, None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`result` and return its error (None when it succeeded). What interrupts the wait itself
        (its time limit's TimeoutError, a KeyboardInterrupt delivered to this thread) is raised, not returned: it
        is not the transfer's error, and a caller that records errors must not swallow a Ctrl-C as one."""
        if not self._resolved:
            self._resolve(timeout)  # what interrupts the wait propagates
        return self._error

    def _wait(self, timeout: float | None) -> None:
        if self.done():
            return
        deadline = deadline_after(timeout)
        for part in self._parts:
            if not part.wait(max(0.0, deadline - time.monotonic())):
                limit = WAIT_LIMIT_S if timeout is None else timeout
                raise TimeoutError(f"transfer of {self.what or 'a buffer'} still running after {limit:g} s")


class _Nested:
    """A future as a part of another."""

    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float) -> bool:
        try:
            self._future.result(timeout_s)
        except TimeoutError:
            if not self._future.done():
                return False
        except BaseException:  # noqa: BLE001 - reported by error()
            pass
        return True

    def error(self, what: str | None) -> BaseException | None:
        return self._future.exception(0)
