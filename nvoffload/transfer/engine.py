"""The transfer engine: every byte that moves between NVMe, host memory and the device goes through here.

The optimizer, the parameter streamer and activation offload say *what* must
move and *when it is needed*; a :class:`TransferEngine` decides how:

- host memory comes from one :class:`~nvoffload.transfer.HostSlab` (the
  budget is the real, page-locked footprint);
- host<->device copies run on the device's copy streams, one per direction,
  each queued behind an event (by default: the compute stream's work so far),
  and complete at an event of their own; :meth:`TransferEngine.wait` orders the
  compute stream after one without blocking the host on a GPU;
- NVMe<->device goes by GPUDirect Storage (kvikio) when the store can, else
  through a slab buffer and a copy, chained on the engine's dispatcher thread
  so that the caller never waits for the NVMe half;
- every operation returns a :class:`~nvoffload.transfer.Future`.

The same code runs on a GPU and on the CPU stand-in
(:class:`~nvoffload.device.SimDevice`), whose copies land late on purpose, so a
missing wait is a wrong result in the tests rather than a corrupted run.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import torch

from nvoffload._workers import Worker
from nvoffload.device import ComputeDevice, Event, compute_device
from nvoffload.transfer.future import WAIT_LIMIT_S, Future
from nvoffload.transfer.slab import HostSlab

__all__ = ["TransferEngine"]


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


class _Chained:
    """The second half of a two-stage transfer, known once the dispatcher has started it."""

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
        self._chains = Worker("nvoffload-transfer", _run_chain)
        self._stop_chains = weakref.finalize(self, self._chains.stop)
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
            if future.done():
                future.result()  # a failed stand-in copy raises here
        else:
            future.result()

    def record(self) -> Event:
        """An event at the end of the compute stream's work so far (queue a copy behind it with ``after=``)."""
        return self.device.record()

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, after: Event | None, what: str | None) -> Future:
        self._check_open(what)
        if after is None:
            after = self.device.record()
        event = self.device.copy_stream(direction).copy(dst, src, after, what)
        return Future(
            [_EventPart(event)], lambda error: dst, what=what, keepalive=src, event=event if direction == "h2d" else None
        )

    # ---------------------------------------------------------------- chains of transfers
    def then(self, first: Future, start_next: Callable[[object], Future], *, what: str | None = None) -> Future:
        """A future for ``start_next(first.result())``, started by the engine's dispatcher once ``first`` is done.

        If ``first`` fails, ``start_next`` is not called and the returned future
        raises that error. The returned future carries no device event: use it
        for host-side completion, or chain a copy whose event compute waits for
        with :meth:`load`.
        """
        self._check_open(what)
        chained = _Chained()
        self._chains.submit((first, start_next, chained))
        future = Future([chained], what=what)
        future.chain = chained
        return future

    def load(self, store, name: str, dst: torch.Tensor, staging: torch.Tensor | None, *, after: Event | None = None) -> Future:
        """Read ``name`` from ``store`` into device tensor ``dst``, once ``dst`` is free at ``after``
        (default: the compute stream's work so far).

        By GPUDirect Storage when the store can move ``dst`` directly (then
        ``staging`` is unused), else into the host buffer ``staging`` (``dst``'s
        dtype and size) and then to the device on the copy stream. The future
        completes when ``dst`` holds the data; :meth:`wait` before computing on it.
        """
        after = after or self.device.record()
        if staging is None or store.direct_to_device(dst):
            return store.get(name, out=dst, after=after)
        read = store.get(name, out=staging)
        return self.then(read, lambda _: self.to_device(dst.view(-1), staging.view(-1), after=after, what=name), what=name)

    def save(self, store, name: str, src: torch.Tensor, staging: torch.Tensor | None, *, after: Event | None = None) -> Future:
        """Write device tensor ``src`` to ``store`` under ``name``: directly by GPUDirect Storage when possible,
        else copied into the host buffer ``staging`` on the device-to-host stream and written from there.

        Queued behind ``after`` (default: the compute stream's work so far).
        ``src`` and ``staging`` must stay untouched until the future is done.
        """
        if staging is None or store.direct_to_device(src):
            return store.put(name, src, after=after)  # kvikio reads device memory once ``after`` completed
        copied = self.to_host(staging.view(-1), src.reshape(-1), after=after, what=name)
        return self.then(copied, lambda _: store.put(name, staging), what=name)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the dispatcher and the stand-in's copy threads; give back the slab if the engine made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_chains()
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
