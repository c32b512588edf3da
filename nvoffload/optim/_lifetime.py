"""An offloaded optimizer's lifetime: one open optimizer per parameter, and closing, collection and interpreter
exit, which all stop the worker and release the state.

Neither the worker nor these callbacks hold the optimizer, so a dropped optimizer is collected: its finalizer
lets the worker finish what is queued, then remove the hooks, delete the state from the store and end. At
interpreter exit the worker of an optimizer still open is stopped and joined before the interpreter finalizes
(a daemon thread still inside native I/O then aborts the process).
"""

from __future__ import annotations

import atexit
import functools
import gc
import weakref
from collections.abc import Callable

import torch

from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._layout import Record
from nvoffload.optim._pipeline import Pipeline

_OPEN: weakref.WeakSet = weakref.WeakSet()  # the optimizers not closed: each one's hooks update its parameters


def refuse_held_elsewhere(opt: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Raise ValueError when a parameter of ``groups`` is held by another open offload optimizer (an unreachable
    one not collected yet, in a reference cycle, holds nothing)."""
    if _held_elsewhere(opt, groups) is not None:
        gc.collect()
    held = _held_elsewhere(opt, groups)
    if held is not None:
        raise ValueError(
            f"a parameter of shape {tuple(held.shape)} ({held.dtype}) is held by another OffloadOptimizer that"
            " is still open: its hooks would update it in every backward as well. Close that one first"
            " (opt.close(), or build it in a with block)"
        )


def _held_elsewhere(opt: torch.optim.Optimizer, groups: list[dict]) -> torch.Tensor | None:
    """A parameter of ``groups`` that another open offload optimizer holds, or None."""
    mine = {id(p) for g in groups for p in g["params"]}  # all alive while we look: ids are unique
    for other in list(_OPEN):
        if other is not opt:
            for g in other.param_groups:
                for p in g["params"]:
                    if id(p) in mine:
                        return p
    return None


class Lifetime:
    """Whether ``opt`` is open, and its end (see the module docs): ``shutdown`` or the optimizer's collection lets
    ``pipeline``'s worker finish, then release ``records``' hooks and state (closing the store when the optimizer
    opened it, ``owns_store``) and give back the host memory (``close_transfer``)."""

    def __init__(self, opt: torch.optim.Optimizer, pipeline: Pipeline, records: list[Record], io: ChunkIO,
                 owns_store: bool, close_transfer: Callable[[], None]):  # fmt: skip
        self.closed = False
        self._opt = weakref.ref(opt)
        self._pipeline = pipeline
        release = functools.partial(_release, records, io, owns_store, close_transfer)
        exit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
        self._finalizer = weakref.finalize(opt, _stop_worker, pipeline, release, exit_hook)
        self._finalizer.atexit = False  # exit_hook joins the worker at exit instead
        atexit.register(exit_hook)
        _OPEN.add(opt)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the OffloadOptimizer is closed")

    def shutdown(self) -> bool:
        """Let the worker finish what is queued, delete the state from the store (closing a store the optimizer
        opened) and end; False if that already happened."""
        if self.closed:
            return False
        self.closed = True
        opt = self._opt()
        if opt is not None:
            _OPEN.discard(opt)
        self._finalizer()
        self._pipeline.join()
        return True


def _release(records: list[Record], io: ChunkIO, owns_store: bool, close_transfer) -> None:
    """Remove the hooks and delete every generation from the store; close the store if the optimizer opened it,
    and give back its host memory. Runs on the worker thread, after its last update."""
    for rec in records:
        for handle in rec.hooks:
            handle.remove()
        rec.hooks = ()
        for c in rec.chunks:
            io.chunks.discard(c)
    if owns_store:
        io.chunks.store.close()
    close_transfer()


def _stop_worker(pipeline: Pipeline, release, exit_hook) -> None:
    """The optimizer's finalizer (also called by ``shutdown``): the worker releases the state and ends.
    Takes no lock and does not wait, so that it is safe wherever garbage collection runs it."""
    atexit.unregister(exit_hook)
    pipeline.stop(then=release)


def _shutdown_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, stop and join the worker of an optimizer that was not closed: a daemon thread
    still inside native I/O when the interpreter finalizes aborts the process."""
    life = ref()
    if life is not None:
        life.shutdown()
