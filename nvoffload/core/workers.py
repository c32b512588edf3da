"""nvoffload's background threads and native pools: each finishes what it was given before the interpreter finalizes.

A daemon thread that is inside a torch operation (which releases the GIL)
when the interpreter finalizes is ended by CPython as it takes the GIL back,
with a forced unwind that aborts the whole process ("terminate called without
an active exception", SIGABRT); and one that is still reading into a host slab
when the slab's finalizer unmaps it at exit faults (SIGSEGV) -- a script that
never closes nvoffload's objects, or drops them unclosed, would die at exit.

So everything that runs beside the training thread is registered here while it
runs (:func:`start_thread` for threads, :class:`Worker` for those that run
queued items, :func:`finish_before_exit` for the native I/O pools), and at exit
each is finished, newest first (what was made later uses what was made before:
an optimizer's worker its transfer engine's dispatcher, that one the device's
copy threads), before any ``weakref.finalize`` callback runs: those unmap the
host slabs and remove the swap files. ``atexit`` runs its handlers last
registered first; ``weakref.finalize`` registers the one that runs the pending
finalizers when the first finalizer is made, so this module makes one on import,
before it registers its own handler. Handlers registered later (an optimizer's,
which closes it) run before both.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable

__all__ = ["Worker", "finish_before_exit", "finished", "start_thread"]

_STOP = object()
_live: dict[object, Callable[[], None]] = {}  # what runs now, oldest first -> how to finish it (stop, then wait)


def finish_before_exit(key: object, finish: Callable[[], None]) -> None:
    """Call ``finish()`` at interpreter exit unless :func:`finished` (``key``) was called first: it must stop
    what ``key`` runs and return once nothing of it runs any more (a bounded wait)."""
    _live[key] = finish


def finished(key: object) -> None:
    """What ``key`` ran has ended (or was finished): nothing to do for it at exit."""
    _live.pop(key, None)


def start_thread(name: str, target: Callable[[], None], stop: Callable[[], None]) -> threading.Thread:
    """Start a daemon thread running ``target()``; at interpreter exit, if it still runs, ``stop()`` (which must
    make ``target`` return without help from the training thread, and may be called again) and join it."""
    thread = threading.Thread(target=_run_until_finished, args=(target,), name=name, daemon=True)
    finish_before_exit(thread, lambda: _stop_and_join(thread, stop))
    thread.start()
    return thread


class Worker:
    """A daemon thread that calls ``handle(item)`` for each :meth:`submit`-ted item, in order, until :meth:`stop`.

    Holds nothing of its owner: an owner stops it from a ``weakref.finalize``
    (:meth:`stop` takes no lock and does not wait).
    """

    def __init__(self, name: str, handle: Callable[[object], None]):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = start_thread(name, lambda: _run_items(self._queue, handle), self.stop)

    def submit(self, item: object) -> None:
        if self._stopped:
            raise RuntimeError(f"{self.name} has stopped (closed, or the interpreter is exiting)")
        self._queue.put(item)

    def stop(self) -> None:
        """Finish what is queued, then end; later :meth:`submit` calls raise."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)


def _run_until_finished(target: Callable[[], None]) -> None:
    try:
        target()
    finally:
        finished(threading.current_thread())


def _run_items(items: queue.SimpleQueue, handle: Callable[[object], None]) -> None:
    while (item := items.get()) is not _STOP:
        handle(item)
        del item  # the idle thread must not keep the last item's tensors alive


def _stop_and_join(thread: threading.Thread, stop: Callable[[], None]) -> None:
    from nvoffload.core.future import WAIT_LIMIT_S

    stop()
    thread.join(WAIT_LIMIT_S)


def _finish_all_at_exit() -> None:
    while _live:
        key, finish = _live.popitem()  # the newest
        finish()


weakref.finalize(_finish_all_at_exit, int).atexit = False  # see the module docs: registers weakref's exit handler first
atexit.register(_finish_all_at_exit)
