"""The transfer engine: every byte that moves between NVMe, host memory and the device goes through here.

The optimizer, the parameter streamer and activation offload say *what* must
move and *when it is needed*; a :class:`TransferEngine` decides how:

- host memory comes from one :class:`~nvoffload.transfer.HostSlab` (the
  budget is the real, page-locked footprint);
- host<->device copies run on the device's copy streams, one per direction,
  each queued behind an event (by default: the compute stream's work so far),
  and complete at an event of their own; :meth:`TransferEngine.wait` orders the
  compute stream after one without blocking the host on a GPU;
- NVMe<->device (:meth:`TransferEngine.save`, :meth:`TransferEngine.load`)
  goes through a slab buffer and a copy, chained on the engine's dispatcher
  thread so that the caller never waits for the NVMe half; or by GPUDirect
  Storage (kvikio, where it is not in compatibility mode, and the store keeps
  no checksums: :meth:`TransferEngine.direct`), started by the dispatcher once
  the device memory is ready (it waits for the event, the caller does not);
- the :class:`~nvoffload.io.TensorStore` is host-side: it lays tensors out in
  its swap files and moves host memory; device memory moves only here;
- every operation returns a :class:`~nvoffload.transfer.Future`.

The same code runs on a GPU and on the CPU stand-in
(:class:`~nvoffload.device.SimDevice`), whose copies land late on purpose, so a
missing wait is a wrong result in the tests rather than a corrupted run.
"""

from __future__ import annotations

import enum
import functools
import threading
import weakref
from collections.abc import Callable

import torch

from nvoffload.core.deferred import Deferred
from nvoffload.core.future import WAIT_LIMIT_S, Future
from nvoffload.core.workers import Worker
from nvoffload.device import ComputeDevice, Event, compute_device
from nvoffload.transfer.gds import GDSFile, gds_available
from nvoffload.transfer.slab import HostSlab

__all__ = ["Lane", "TransferEngine"]


class Lane(enum.Enum):
    """Which of the dispatcher's threads starts a chain's next step (:meth:`TransferEngine.then`): chains run in
    order within a lane, and never behind another lane's, so a copy that compute will wait for never queues behind
    a write-back whose store submit waits (for an earlier write of the same entry, for room in the I/O queue)."""

    FETCH = "fetch"  # what compute waits for: reads, copies to the device
    WRITE = "write"  # what nothing computes with: write-backs and saves to the store


class _EventPart:
    """A copy's completion event as a part of a :class:`Future`."""

    __slots__ = ("_event",)

    def __init__(self, event: Event):
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout_s: float) -> bool:
        return self._event.synchronize(timeout_s)

    def error(self, what: str | None) -> BaseException | None:
        error = self._event.error()
        if error is not None and what is not None:
            error.add_note(f"nvoffload: while copying {what}")
        return error


class TransferEngine:
    """Moves tensors between NVMe, host memory and the compute device; see the module docs.

    Args:
        host: the host budget in bytes (a new :class:`HostSlab` of that size,
            closed with the engine), or a slab to carve from (a shared budget).
        device: the compute device (``"cuda"``, ``"cpu"`` for the stand-in, or a
            :class:`~nvoffload.device.ComputeDevice`); default: CUDA when present.
        what: what the engine's host memory is for, in error messages.
    """

    def __init__(self, host: int | HostSlab, device: torch.device | str | ComputeDevice | None = None, *, what: str = "host memory"):
        if isinstance(host, HostSlab):
            self.slab, self._owns_slab = host, False
        else:
            self.slab, self._owns_slab = HostSlab(host, what), True
        if device is None or isinstance(device, (str, torch.device)):
            self.device = compute_device(device)
            self._owns_device = True
        else:
            self.device, self._owns_device = device, False
        self._streams = {direction: self.device.copy_stream(direction) for direction in ("h2d", "d2h")}
        self._lanes = {lane: Worker(f"nvoffload-transfer-{lane.value}", _run_chain) for lane in Lane}
        self._stop_chains = weakref.finalize(self, _stop_all, list(self._lanes.values()))
        self._gds_files: dict[str, GDSFile] = {}  # swap file path -> its cuFile handle, open from its first use
        self._gds_lock = threading.Lock()
        self._closed = False

    # ---------------------------------------------------------------- host <-> device
    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: Event | None = None, what: str | None = None) -> Future:
        """Copy host ``src`` into device ``dst`` on the host-to-device stream.

        Queued behind ``after`` (default: the compute stream's work so far, so
        ``dst`` is no longer being read); ``result()`` returns ``dst``. ``src`` must stay unmodified until the
        future is done; compute must :meth:`wait` for it before reading ``dst``.
        """
        return self._copy("h2d", dst, src, after, what)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, after: Event | None = None, what: str | None = None) -> Future:
        """Copy device ``src`` into host ``dst`` on the device-to-host stream.

        Queued behind ``after`` (default: the compute stream's work so far,
        which produced ``src``); ``result()`` waits on the host for ``dst`` to
        be filled and returns it. ``src`` must not be modified or freed before then.
        """
        return self._copy("d2h", dst, src, after, what)

    def wait(self, future: Future) -> None:
        """Order the compute stream after ``future``: without a host wait for a device copy on a GPU.

        For a chain (:meth:`load` through host memory) the host waits until its
        last copy is queued (the NVMe read is done), then compute waits for the copy.
        """
        while future.chain is not None:
            if not future.chain.wait_started(WAIT_LIMIT_S):
                raise TimeoutError(f"transfer of {future.what or 'a tensor'} not started after {WAIT_LIMIT_S:g} s")
            future = future.chain.inner
        if future.event is not None:
            self.device.wait(future.event)
            if future.event.error() is not None:  # a failed stand-in copy raises here (CUDA's fail a later call)
                future.result()
        else:
            future.result()

    def record(self) -> Event:
        """An event at the end of the compute stream's work so far (queue a copy behind it with ``after=``)."""
        return self.device.record()

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, after: Event | None, what: str | None) -> Future:
        if self._closed:
            self._check_open(what)
        if after is None:
            after = self.device.record()
        event = self._streams[direction].copy(dst, src, after, what)
        return Future(
            [_EventPart(event)], lambda error: dst, what=what, keepalive=src, event=event if direction == "h2d" else None
        )

    # ---------------------------------------------------------------- chains of transfers
    def then(self, first: Future, start_next: Callable[[object], Future], *, what: str | None = None,
             lane: Lane = Lane.FETCH) -> Future:  # fmt: skip
        """A future for ``start_next(first.result())``, started by the engine's dispatcher once ``first`` is done,
        in order behind the chains of the same ``lane`` (:class:`Lane`: ``WRITE`` for a write nothing computes with).

        If ``first`` fails, ``start_next`` is not called and the returned future
        raises that error. The returned future carries no device event: use it
        for host-side completion, or chain a copy whose event compute waits for
        with :meth:`load`.
        """
        self._check_open(what)
        chained = Deferred()
        self._lanes[lane].submit((first, start_next, chained))
        future = Future([chained], what=what)
        future.chain = chained
        return future

    def direct(self, store, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` moves between ``store`` and device memory by GPUDirect Storage.

        That is: a contiguous CUDA tensor, a store without checksums (they are
        computed in host memory) whose ``config.use_gds`` is on, and kvikio
        installed and not in compatibility mode
        (:func:`nvoffload.transfer.gds.gds_available`: kvikio's POSIX fallback
        is slower than the path through the slab).
        """
        return (
            tensor.is_cuda and tensor.is_contiguous() and store.config.use_gds and not store.checksum and gds_available()
        )

    def load(self, store, name: str, dst: torch.Tensor, staging: torch.Tensor | None, *, after: Event | None = None) -> Future:
        """Read ``name`` from ``store`` into device tensor ``dst``, once ``dst`` is free at ``after``
        (default: the compute stream's work so far).

        By GPUDirect Storage when :meth:`direct` (``staging`` unused, may be
        None): the dispatcher starts the read once ``after`` has completed, the
        caller does not wait for it. Else into the host buffer ``staging``
        (``dst``'s dtype and size, from the slab) and then to the device on the
        copy stream, queued behind ``after``. The future completes when ``dst``
        holds the data; :meth:`wait` before computing on it.

        Raises:
            ValueError: no ``staging`` where GPUDirect Storage is not used.
        """
        after = after or self.device.record()
        if self.direct(store, dst):
            io = self._gds_io(store, dst, write=False)
            return self.then(self._reached(after, name), lambda _: store.get_by(name, dst, io), what=name)
        _need_staging("load", name, staging)
        read = store.get(name, out=staging)
        return self.then(read, lambda _: self.to_device(dst.view(-1), staging.view(-1), after=after, what=name), what=name)

    def save(self, store, name: str, src: torch.Tensor, staging: torch.Tensor | None, *, after: Event | None = None) -> Future:
        """Write device tensor ``src`` to ``store`` under ``name``, final at ``after`` (default: the compute
        stream's work so far).

        By GPUDirect Storage when :meth:`direct` (``staging`` unused, may be
        None): the dispatcher starts the write once ``after`` has completed,
        the caller does not wait for it. Else copied into the host buffer
        ``staging`` on the device-to-host stream, queued behind ``after``, and
        written from there once the copy has landed. ``src`` and ``staging``
        must stay untouched until the future is done.

        Raises:
            ValueError: no ``staging`` where GPUDirect Storage is not used.
        """
        if self.direct(store, src):
            io = self._gds_io(store, src, write=True)
            ready = self._reached(after or self.device.record(), name)
            return self.then(ready, lambda _: store.put_by(name, src, io), what=name, lane=Lane.WRITE)
        _need_staging("save", name, staging)
        copied = self.to_host(staging.view(-1), src.reshape(-1), after=after, what=name)
        return self.then(copied, lambda _: store.put(name, staging), what=name, lane=Lane.WRITE)

    @staticmethod
    def _reached(event: Event, what: str) -> Future:
        """A future done when ``event`` has completed: the dispatcher waits for it (bounded) before a GDS transfer,
        since kvikio reads and writes device memory outside stream order."""
        return Future([_EventPart(event)], what=what)

    def _gds_io(self, store, tensor: torch.Tensor, *, write: bool):
        """The :data:`~nvoffload.io.store.ExtentIO` that moves bytes of the contiguous CUDA ``tensor`` by cuFile,
        between it and ``store``'s swap files."""
        data = tensor.reshape(-1).view(torch.uint8)

        def io(path: str, offset: int, start: int, nbytes: int):
            return self._gds_file(store, path).submit(data[start : start + nbytes], offset, write=write)

        return io

    def _gds_file(self, store, path: str) -> GDSFile:
        """The cuFile handle of ``store``'s swap file ``path``, opened at its first use and closed when the store
        closes (:meth:`~nvoffload.io.TensorStore.on_close`: the removed file's disk space is freed then) or the engine
        does, whichever comes first."""
        with self._gds_lock:
            file = self._gds_files.get(path)
            opened = file is None
            if opened:
                file = self._gds_files[path] = GDSFile(path)
        if opened:  # outside the lock: a store closed meanwhile calls the hook at once
            store.on_close(functools.partial(_close_gds_file, weakref.ref(self), path))  # must not keep the engine
        return file

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the dispatcher and the stand-in's copy threads; give back the slab if the engine made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_chains()
        with self._gds_lock:
            files, self._gds_files = list(self._gds_files.values()), {}
        for file in files:
            file.close()
        if self._owns_device:
            self.device.close()
        if self._owns_slab:
            self.slab.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, what: str | None) -> None:
        if self._closed:
            raise RuntimeError(f"transfer of {what or 'a tensor'}: the TransferEngine is closed")


def _stop_all(workers: list[Worker]) -> None:
    for worker in workers:
        worker.stop()


def _close_gds_file(engine_ref: weakref.ref, path: str) -> None:
    """Close the cuFile handle of swap file ``path`` that the engine (if still alive) keeps, if it still keeps it."""
    engine = engine_ref()
    if engine is None:
        return
    with engine._gds_lock:
        file = engine._gds_files.pop(path, None)
    if file is not None:
        file.close()


def _run_chain(item: tuple) -> None:
    """Start the second step of a chain once its first is done, on the engine's worker thread."""
    first, start_next, chained = item
    try:
        value = first.result()
        nxt = start_next(value)
    except BaseException as exc:  # noqa: BLE001 - the chained future raises it
        nxt = Future.failed(exc)
    del first, start_next, item
    chained.set(nxt)


def _need_staging(op: str, name: str, staging: torch.Tensor | None) -> None:
    if staging is None:
        raise ValueError(
            f"{op}({name!r}): a host staging buffer (from the engine's slab) is needed where the tensor does not move"
            " by GPUDirect Storage (TransferEngine.direct is False)"
        )
