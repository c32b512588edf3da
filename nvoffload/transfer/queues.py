"""Read-ahead and write-behind queues with byte budgets: what every engine keeps in flight, and the relay that
moves a sequence of items from reads to writes through a ring of buffers of its own."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import torch

from nvoffload.core.buffers import aligned_empty
from nvoffload.core.future import Future

__all__ = ["ReadAhead", "WriteBehind", "relay"]

T = TypeVar("T")


class WriteBehind:
    """Writes in flight, at most ``budget_bytes`` of them; the oldest are waited for to make room.

    ``submit(nbytes, start, done)`` waits until ``nbytes`` fit beside the writes
    in flight (oldest first), then calls ``start()`` for the write's
    :class:`~nvoffload.transfer.Future`. When a write finishes, ``done(error)``
    runs (releasing its buffer) on whichever thread reaps it. Errors are kept
    and raised by :meth:`drain`, so a failed write is never lost; with
    ``keep_errors=False`` a write's error goes to its ``done`` hook only, whose
    caller keeps it (and :meth:`drain` raises nothing).
    """

    def __init__(self, budget_bytes: int, what: str, *, keep_errors: bool = True):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"the write-behind budget must be a positive int of bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.what = what
        self._in_flight: collections.deque[tuple[Future, int, Callable | None]] = collections.deque()
        self._bytes = 0
        self._errors: list[BaseException] = []
        self._keep_errors = keep_errors
        self._lock = threading.RLock()

    @property
    def in_flight_bytes(self) -> int:
        return self._bytes

    def submit(self, nbytes: int, start: Callable[[], Future], done: Callable[[BaseException | None], None] | None = None) -> Future:
        with self._lock:
            while self._in_flight and self._bytes + nbytes > self.budget_bytes:
                self._finish_oldest()
            try:
                future = start()
            except BaseException as exc:
                if done is not None:
                    done(exc)
                raise
            self._in_flight.append((future, nbytes, done))
            self._bytes += nbytes
            return future

    def poll(self) -> None:
        """Reap the writes that finished, without waiting."""
        with self._lock:
            while self._in_flight and self._in_flight[0][0].done():
                self._finish_oldest()

    def wait_oldest(self) -> bool:
        """Wait for the oldest write in flight (its ``done`` hook runs); False when none is in flight."""
        with self._lock:
            if not self._in_flight:
                return False
            self._finish_oldest()
            return True

    def wait_for(self, future: Future) -> bool:
        """Wait for the writes in flight up to ``future``, oldest first (their ``done`` hooks run): for a buffer
        one of them holds that is needed back now. False when ``future`` is not in flight (never, or reaped)."""
        with self._lock:
            if not any(entry[0] is future for entry in self._in_flight):
                return False
            while self._finish_oldest() is not future:
                pass
            return True

    def drain(self) -> None:
        """Wait for every write; raise the first error of those reaped since the last drain."""
        with self._lock:
            while self._in_flight:
                self._finish_oldest()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _finish_oldest(self) -> Future:
        """Wait for the oldest write and reap it. A write still running after the wait limit raises TimeoutError
        and stays in flight: its ``done`` hook does not run, so its buffer is not released under it."""
        future, nbytes, done = self._in_flight[0]
        error = future.exception()
        self._in_flight.popleft()
        self._bytes -= nbytes
        if error is not None and self._keep_errors:
            self._errors.append(error)
        if done is not None:
            done(error)
        return future


class ReadAhead:
    """Reads started ahead of their use, in a planned order, with at most ``budget_bytes`` waiting to be taken.

    Args:
        budget_bytes: bytes of reads started and not yet taken (one read may
            start alone even when it is larger).
        size: ``size(key)``: the bytes a read of ``key`` would hold.
        start: ``start(key)`` begins the read of ``key`` and returns ``(future,
            nbytes)``, or None when it cannot start now (no memory: reading
            ahead stops until the next :meth:`pump`).
        drop: ``drop(key, future)`` releases a read that will not be taken (the
            plan changed, or :meth:`clear`); it frees the buffer only once the
            read ended, behind it (:class:`~nvoffload.transfer.FreeBehind`),
            not by a wait.
    """

    def __init__(
        self,
        budget_bytes: int,
        size: Callable[[Hashable], int],
        start: Callable[[Hashable], tuple[Future, int] | None],
        drop: Callable[[Hashable, Future], None],
    ):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"the read-ahead budget must be an int >= 0 of bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._size = size
        self._start = start
        self._drop = drop
        self._plan: list[Hashable] = []
        self._pos = 0
        self._started: collections.OrderedDict[Hashable, tuple[Future, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()

    @property
    def waiting_bytes(self) -> int:
        return self._bytes

    def waiting(self) -> list[Hashable]:
        """The keys of the reads started (or kept) and not taken yet, oldest first."""
        with self._lock:
            return list(self._started)

    def keep(self, key: Hashable, future: Future, nbytes: int) -> bool:
        """Count what the caller already has for ``key`` (its data kept where a read would bring it; ``future``
        its copy, or a completed one) as a read started ahead, to be taken or dropped like one, if the budget
        allows it as :meth:`pump` would; False (nothing counted, the caller keeps it) when it does not or a read
        of ``key`` is waiting."""
        with self._lock:
            if key in self._started or (self._started and self._bytes + nbytes > self.budget_bytes):
                return False
            self._started[key] = (future, nbytes)
            self._bytes += nbytes
            return True

    def plan(self, keys: Iterable[Hashable]) -> None:
        """Read in this order from now on; reads started for keys outside it are dropped."""
        with self._lock:
            self._plan, self._pos = list(keys), 0
            wanted = set(self._plan)
            for key in [k for k in self._started if k not in wanted]:
                self._release(key)

    def skip_to(self, key: Hashable) -> None:
        """Continue the plan after ``key`` (used in its place), when ``key`` is in it ahead of the position."""
        with self._lock:
            try:
                self._pos = max(self._pos, self._plan.index(key, self._pos) + 1)
            except ValueError:
                pass

    def take(self, key: Hashable) -> Future | None:
        """The read started for ``key`` (the caller owns it now), or None when none was started."""
        with self._lock:
            entry = self._started.pop(key, None)
            if entry is None:
                return None
            self._bytes -= entry[1]
            return entry[0]

    def pump(self) -> None:
        """Start the next planned reads while the budget allows."""
        with self._lock:
            while self._pos < len(self._plan):
                key = self._plan[self._pos]
                if key in self._started:
                    self._pos += 1
                    continue
                if self._started and self._bytes + self._size(key) > self.budget_bytes:
                    return
                started = self._start(key)
                if started is None:
                    return
                self._pos += 1
                if started[0] is None:  # nothing to read for this key
                    continue
                self._started[key] = started
                self._bytes += started[1]

    def clear(self) -> None:
        """Drop every read not taken."""
        with self._lock:
            for key in list(self._started):
                self._release(key)

    def _release(self, key: Hashable) -> None:
        future, nbytes = self._started.pop(key)
        self._bytes -= nbytes
        self._drop(key, future)


def relay(
    items: Sequence[T], buffer_bytes: int, max_bytes_in_flight: int,
    read: Callable[[T, torch.Tensor], Future], write: Callable[[T, torch.Tensor], Future],
) -> None:  # fmt: skip
    """Move every item, in order, from ``read(item, buffer)`` (the future of its read into ``buffer``, bytes of
    ``buffer_bytes``, 4 KiB-aligned) to ``write(item, buffer)`` (called once that read is done; the future of
    the writes from it), through a ring of ``max(2, min(len(items), max_bytes_in_flight // buffer_bytes))``
    buffers of its own: the reads run up to half the ring ahead of the writes, and a buffer is read into again
    once the writes from it are done. Returns when every write is done; raises the first error met (the
    buffers of writes still in flight then stay alive with their futures, not reused)."""
    if not items:
        return
    depth = max(2, min(len(items), max_bytes_in_flight // buffer_bytes))
    free = collections.deque(aligned_empty(buffer_bytes) for _ in range(depth))
    reads: collections.deque[tuple[T, torch.Tensor, Future]] = collections.deque()
    writes: collections.deque[tuple[torch.Tensor, Future]] = collections.deque()

    def hand_over() -> None:
        item, buffer, done = reads.popleft()
        done.result()
        writes.append((buffer, write(item, buffer)))

    for item in items:
        if not free:
            if not writes:
                hand_over()
            buffer, done = writes.popleft()
            done.result()
            free.append(buffer)
        buffer = free.popleft()
        reads.append((item, buffer, read(item, buffer)))
        if len(reads) > depth // 2:
            hand_over()
    while reads:
        hand_over()
    Future.all_of([done for _, done in writes]).result()
