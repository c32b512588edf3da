"""Updates that ``step()`` queued and that land after it returns: deferred ones (:class:`DeferredUpdates`, at the
next backward's first hook) and delayed ones (:class:`DelayedUpdates`, at the next ``step()``).

Both keep the committed generation until they land (two generations in the store meanwhile), so an error
restores every parameter to the step before. Landing waits for the worker, raises an update's error (the updates
are dropped, the parameters and the committed state stay those from before them), commits, and for delayed ones
makes the staged new weights the parameters'. What a streamed parameter's weight home does meanwhile is
:class:`InFlightHome`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nvoffload.optim._chunk_io import WeightHome
from nvoffload.optim._generations import Generations, OffloadIOError
from nvoffload.optim._layout import Record
from nvoffload.transfer import Future


class InFlightHome(WeightHome, Protocol):
    """A :class:`~nvoffload.optim.WeightHome` that takes updates landing after ``step()``: its side of the
    deferred and delayed updates (the streamer is one)."""

    def updating(self, param: torch.Tensor, done: Future) -> None:
        """A deferred update rewrites the parameter's weights until ``done``: uses of them wait for it."""
        ...

    def settled(self) -> None:
        """Every update in flight landed or was undone."""
        ...

    def staging(self, param: torch.Tensor) -> None:
        """A delayed update will write the parameter's staged weights (``acquire(staged=True)``)."""
        ...

    def install_staged(self) -> None:
        """The delayed updates landed: the staged weights become the parameters' weights (refused, raising and
        changing nothing, while a forward or backward holds a block)."""
        ...

    def drop_staged(self) -> None:
        """The delayed updates were undone: forget the staged weights."""
        ...


def explained(mark: Future, name: str) -> Future:
    """``mark``, failing with an error that says what failed and how training goes on."""

    def explain(error: BaseException | None) -> None:
        if error is not None:
            kind = OffloadIOError if isinstance(error, OSError) else RuntimeError
            raise kind(
                f"nvoffload: the update of {name} that the last step() deferred failed: {error}. Call"
                " optimizer.synchronize() (or step()): it raises the error again and restores the weights of"
                " before that step, and training goes on from there"
            ) from error

    return Future.all_of([mark], what=mark.what, finish=explain)


class InFlight:
    """The updates of ``records`` (in the order ``step()`` queued them), landing later.

    ``home``: the weight home of the streamed ones (None: every parameter is on the device)."""

    lands_in_backward = False  # the first hook of the next backward lands them (else the next step() does)

    def __init__(self, gens: Generations, records: list[Record], home: InFlightHome | None):
        self._gens = gens
        self.records = records
        self._home = home
        self._covered = set(records)

    def covers(self, rec: Record) -> bool:
        return rec in self._covered

    def wait(self) -> None:
        """Wait for the updates; on an error, undo them and raise it."""
        self._gens.pipeline.wait_idle()
        try:
            self._gens.raise_error(self.records)
        except BaseException:
            self._drop()
            raise
        finally:
            if self._home is not None:
                self._home.settled()  # landed, or restored by the error

    def _drop(self) -> None:
        """The updates failed: forget what they staged."""

    def install(self) -> None:
        """Before the commit: make the new weights current where the weight home holds them (may refuse)."""

    def commit(self) -> None:
        """Commit the updates' generation (they are done)."""
        self._gens.commit(self.records, set(self.records))


class DeferredUpdates(InFlight):
    """Deferred updates (``defer_updates``): their new weights went into the weights themselves, and each
    streamed block's next copy to the device waited for its update (:meth:`InFlightHome.updating`); the first
    hook of the next backward (or ``step()``, ``synchronize()``, a state dict, ``close()``) lands them."""

    lands_in_backward = True


class DelayedUpdates(InFlight):
    """Delayed updates (``delayed_update``): their new weights went to a staged copy (a device parameter's
    ``ChunkIO.staged``, a streamed block's twin in the host cache) that the forward and backward in between do
    not read; the next ``step()`` (or ``synchronize()``, a state dict, a checkpoint, ``close()``) lands them."""

    def before_accumulate(self, rec: Record) -> None:
        """Backward is about to add into ``rec``'s gradient (not zeroed to None since the last ``step()``), which
        an update in flight may not have copied yet: wait for the updates first."""
        if rec.param.grad is not None and self.covers(rec):
            self._gens.pipeline.wait_idle()

    def _drop(self) -> None:
        if self._home is not None:
            self._home.drop_staged()

    def install(self) -> None:
        if self._home is not None:
            self._home.install_staged()  # first: a block in use refuses it, and the updates stay in flight

    def commit(self) -> None:
        super().commit()
        home = self._home
        on_device = [r for r in self.records if r.chunks and (home is None or not home.holds(r.param))]
        self._gens.io.install_staged(on_device)
