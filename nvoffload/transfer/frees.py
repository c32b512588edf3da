"""Memory let go while a transfer still uses it: freed once that transfer ended, never by a host wait.

A buffer a copy reads (a host copy going to the device) or writes (device
memory a copy fills) may be let go before the copy has run: a block leaves the
device, a read ahead is dropped, a saved tensor is released. Waiting on the
host for the copy there would stall the thread that lets it go (on a GPU, the
training thread behind the whole queue of device work). Instead the buffer's
release is queued behind the copy's :class:`~nvoffload.transfer.Future`, as
FSDP2 keeps the copied-in buffer until the next group's copy starts: the owner
gives it back the next time it looks (:meth:`FreeBehind.reap`, never waiting),
and an owner that needs the room now waits for the oldest release (bounded,
:meth:`FreeBehind.wait_oldest`). Until a release runs, whatever it gives back
(device budget bytes, a slab buffer, a pinned host copy) is still counted as
used, because it is.

Each engine keeps one :class:`FreeBehind` and reaps it on its own thread, under
its own lock, so a release touches only state its owner guards.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from nvoffload.core.future import Future

__all__ = ["FreeBehind"]


class FreeBehind:
    """Releases queued behind the transfers that last use their memory; see the module docs.

    ``free(after, release, nbytes)`` runs ``release()`` once ``after`` is done
    (at once when it is, or None). A failed transfer frees its memory too: its
    error belongs to whoever holds the transfer. Releases run on the thread that
    reaps them, outside this queue's lock, oldest first among those done.
    """

    def __init__(self, what: str):
        self.what = what
        self._pending: collections.deque[tuple[Future, Callable[[], None], int]] = collections.deque()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def pending_bytes(self) -> int:
        """The bytes (as given to :meth:`free`) of the releases still waiting for their transfers."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._pending)

    def free(self, after: Future | None, release: Callable[[], None], nbytes: int = 0) -> None:
        """Run ``release()`` once ``after`` (the last transfer using the memory) is done, without waiting for it;
        run the releases already due first."""
        if after is None or after.done():
            self.reap()
            release()
            return
        with self._lock:
            self._pending.append((after, release, nbytes))
            self._bytes += nbytes

    def reap(self) -> int:
        """Run the releases whose transfers are done, without waiting; the bytes they gave back."""
        if not self._pending:  # the usual case, checked without the lock (a release queued meanwhile waits a reap)
            return 0
        with self._lock:
            due, waiting = [], collections.deque()
            for entry in self._pending:
                (due if entry[0].done() else waiting).append(entry)
            if not due:
                return 0
            self._pending = waiting
            self._bytes -= sum(entry[2] for entry in due)
        for _, release, _ in due:
            release()
        return sum(entry[2] for entry in due)

    def wait_oldest(self) -> bool:
        """Wait (bounded by ``WAIT_LIMIT_S``: ``TimeoutError`` naming the transfer, the release stays queued) for the
        oldest queued release's transfer, then run every release due; False when none is queued."""
        with self._lock:
            if not self._pending:
                return False
            oldest = self._pending[0][0]
        oldest.exception()  # its error is its holder's; a transfer still running past the limit raises
        self.reap()
        return True

    def drain(self) -> None:
        """Wait for every queued release's transfer (each bounded) and run them all."""
        while self.wait_oldest():
            pass
