"""nvoffload's background threads: each runs the items put on its queue, in order, and all end before the interpreter finalizes.

A daemon thread that is inside a torch operation (which releases the GIL)
when the interpreter finalizes is ended by CPython as it takes the GIL back,
with a forced unwind that aborts the whole process ("terminate called without
an active exception", SIGABRT) -- a script that never closes nvoffload's
objects would die at exit. So at exit every live :class:`Worker` finishes
what was queued and is joined (``atexit`` runs before finalization; this
module's handler is registered on import, so it runs after the handlers of
objects made later, such as an optimizer's), and refuses new work.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable

__all__ = ["Worker"]

_STOP = object()
_live: dict[threading.Thread, Callable[[], None]] = {}  # running workers' threads and their stop()


class Worker:
    """A daemon thread that calls ``handle(item)`` for each :meth:`submit`-ted item, in order, until :meth:`stop`.

    Holds nothing of its owner: an owner stops it from a ``weakref.finalize``
    (:meth:`stop` takes no lock and does not wait).
    """

    def __init__(self, name: str, handle: Callable[[object], None]):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=_run, args=(self._queue, handle), name=name, daemon=True)
        _live[self._thread] = self.stop
        self._thread.start()

    def submit(self, item: object) -> None:
        if self._stopped:
            raise RuntimeError(f"{self.name} has stopped (closed, or the interpreter is exiting)")
        self._queue.put(item)

    def stop(self) -> None:
        """Finish what is queued, then end; later :meth:`submit` calls raise."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)


def _run(items: queue.SimpleQueue, handle: Callable[[object], None]) -> None:
    try:
        while (item := items.get()) is not _STOP:
            handle(item)
            del item  # the idle thread must not keep the last item's tensors alive
    finally:
        _live.pop(threading.current_thread(), None)


def _stop_all_at_exit() -> None:
    from nvoffload.core.future import WAIT_LIMIT_S

    running = list(_live.items())
    for _, stop in running:
        stop()
    for thread, _ in running:
        thread.join(WAIT_LIMIT_S)


atexit.register(_stop_all_at_exit)
