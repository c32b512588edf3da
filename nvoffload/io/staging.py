"""Staging of CUDA tensors through one page-locked host slab, where GPUDirect Storage is not used.

A :class:`~nvoffload.io.TensorStore` moves a CUDA tensor without GPUDirect
Storage through a :class:`Stager`: a :class:`~nvoffload.transfer.HostSlab` of a
fixed size (``staging_bytes``, page-locked once, so the store's pinned
footprint is exactly that; nothing comes from torch's caching host allocator)
and one worker thread that moves the tensor in pieces of half the slab, so the
device copy of one piece overlaps the NVMe transfer of the other:

- write: each piece is copied device->host on the device's device-to-host copy
  stream, queued behind an event at which the tensor is final (by default the
  caller's current stream at ``put``); the worker waits for that copy, then
  writes the piece to NVMe.
- read: each piece is read from NVMe into the slab, then copied host->device on
  the host-to-device copy stream, queued behind an event at which the
  destination is no longer read (by default the caller's current stream at
  ``get``); the job ends once every copy has landed, so the data is visible to
  kernels launched after the store's future is done, on any stream.

The slab and the thread are created on the first staged transfer: a store that
only sees CPU tensors (or moves CUDA tensors by GPUDirect Storage) pins nothing.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable

import torch

from nvoffload._workers import Worker
from nvoffload.device import ComputeDevice, Event, compute_device
from nvoffload.io.buffers import byte_view
from nvoffload.io.checksum import crc32c
from nvoffload.io.config import ALIGNMENT_BYTES
from nvoffload.transfer.future import WAIT_LIMIT_S, Future
from nvoffload.transfer.slab import HostSlab

__all__ = ["DEFAULT_STAGING_BYTES", "Stager", "wait_for_device"]

DEFAULT_STAGING_BYTES = 64 << 20
"""The staging slab's default size: two 32 MiB pieces, enough to keep a PCIe link and an NVMe drive busy."""

PieceIO = Callable[[torch.Tensor, int], Future]
"""``io(buffer, at)``: the NVMe transfer of bytes ``[at, at + buffer.numel())`` of a tensor, to or from ``buffer``."""


def wait_for_device(event: Event, what: str) -> None:
    """Block the host until ``event`` completes, at most :data:`~nvoffload.transfer.WAIT_LIMIT_S` seconds.

    Raises:
        TimeoutError: naming ``what`` waited, when the limit passes first.
    """
    if not event.synchronize(WAIT_LIMIT_S):
        raise TimeoutError(
            f"{what}: the GPU work it waits for did not finish within {WAIT_LIMIT_S:g} s (NVOFFLOAD_WAIT_LIMIT_S)"
        )


class _Job:
    """A staged transfer run by the worker, as a part of a :class:`~nvoffload.transfer.Future`.

    ``value`` is the CRC32 of the bytes moved (when asked for) once the job is done.
    """

    __slots__ = ("_run", "_done", "_error", "value")

    def __init__(self, run: Callable[[], int | None]):
        self._run = run
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.value: int | None = None

    def __call__(self) -> None:
        try:
            self.value = self._run()
        except BaseException as exc:  # noqa: BLE001 - reported through error()
            self._error = exc
        self._run = None
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def error(self, what: str | None) -> BaseException | None:
        return self._error


class Stager:
    """A fixed page-locked host slab and a worker thread that move CUDA tensors to and from NVMe in pieces.

    Args:
        capacity_bytes: the slab's size (at least 8 KiB: two 4 KiB-aligned pieces).
        what: what the slab is for, in error messages.

    Raises:
        ValueError: ``capacity_bytes`` is not an int of at least 8 KiB.
    """

    def __init__(self, capacity_bytes: int, what: str = "the store's staging slab"):
        least = 2 * ALIGNMENT_BYTES
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < least:
            raise ValueError(f"staging_bytes must be an int of at least {least} (two 4 KiB pieces), got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.what = what
        self.piece_bytes = capacity_bytes // 2 // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        self._slab: HostSlab | None = None
        self._devices: dict[torch.device, ComputeDevice] = {}
        self._jobs: Worker | None = None
        self._stop = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory held: the slab once a transfer was staged, else 0."""
        slab = self._slab
        return slab.capacity_bytes if slab is not None and slab.page_locked else 0

    def device(self, device: torch.device) -> ComputeDevice:
        """The device layer's view of ``device``: its current stream and the copy streams the stager uses.

        A CUDA device, or the CPU stand-in (:class:`~nvoffload.device.SimDevice`,
        whose copies land late on purpose: the tests run the staging logic on it).
        """
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            found = self._devices.get(device)
            if found is None:
                found = self._devices[device] = compute_device(device)
        return found

    def ready_event(self, tensor: torch.Tensor, after: Event | None) -> Event:
        """``after``, or the end of the work queued so far on the current stream of ``tensor``'s device."""
        return after if after is not None else self.device(tensor.device).record()

    def write(self, src: torch.Tensor, after: Event, io: PieceIO, *, checksum: bool, what: str) -> _Job:
        """Queue the write of the bytes of the contiguous device tensor ``src``, final at ``after``, piece by piece through ``io``.

        ``src`` must stay alive and unmodified until the job is done.
        """
        data = byte_view(src)
        stream = self.device(src.device).copy_stream("d2h")

        def run() -> int | None:
            crc = 0
            writes: collections.deque = collections.deque()  # (slab buffer, its copy's event or its NVMe write)
            try:
                for at in range(0, data.numel(), self.piece_bytes):
                    if len(writes) == 2:
                        self._retire(writes)
                    piece = data[at : at + self.piece_bytes]
                    buf = self._slab.allocate(piece.numel(), what)
                    writes.append((buf, copied := stream.copy(buf, piece, after, what)))
                    wait_for_device(copied, f"copy of {what} from the GPU")
                    if checksum:
                        crc = crc32c(buf, crc)
                    writes[-1] = (buf, io(buf, at))
                while writes:
                    self._retire(writes)
            finally:
                self._abandon(writes)
            return crc if checksum else None

        return self._queue(run)

    def read(self, dst: torch.Tensor, after: Event, io: PieceIO, *, checksum: bool, what: str) -> _Job:
        """Queue the read of a tensor into the device tensor ``dst`` (any layout), piece by piece through ``io``.

        The copies into ``dst`` are queued behind ``after``; ``dst`` must not be
        read before the job is done.
        """
        contiguous = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        data = byte_view(contiguous)
        stream = self.device(dst.device).copy_stream("h2d")

        def run() -> int | None:
            crc = 0
            copies: collections.deque = collections.deque()  # (slab buffer, its NVMe read or its copy's event)
            try:
                for at in range(0, data.numel(), self.piece_bytes):
                    if len(copies) == 2:
                        self._land(copies, what)
                    piece = data[at : at + self.piece_bytes]
                    buf = self._slab.allocate(piece.numel(), what)
                    copies.append((buf, read := io(buf, at)))
                    read.result()
                    if checksum:
                        crc = crc32c(buf, crc)
                    copies[-1] = (buf, stream.copy(piece, buf, after, what))
                while copies:
                    self._land(copies, what)
                if contiguous is not dst:
                    wait_for_device(stream.copy(dst, contiguous, after, what), f"copy of {what} into its destination")
            finally:
                self._abandon(copies)
            return crc if checksum else None

        return self._queue(run)

    def close(self) -> None:
        """Stop the worker and the devices' copy threads (the stand-in's), give the slab back; every job must be done.

        Idempotent.
        """
        with self._lock:
            stop, slab, devices = self._stop, self._slab, list(self._devices.values())
            self._stop = self._slab = None
            self._devices.clear()
            self._closed = True
        if stop is not None:
            stop()
        for device in devices:
            device.close()
        if slab is not None:
            slab.close()

    # ---------------------------------------------------------------- internals
    def _queue(self, run: Callable[[], int | None]) -> _Job:
        job = _Job(run)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.what} was closed")
            if self._jobs is None:
                self._slab = HostSlab(self.capacity_bytes, self.what)
                self._jobs = Worker("nvoffload-staging", _Job.__call__)
                self._stop = weakref.finalize(self, self._jobs.stop)
            self._jobs.submit(job)
        return job

    def _retire(self, writes: collections.deque) -> None:
        """Wait for the oldest piece's NVMe write (raising its error), then free its buffer."""
        buf, write = writes[0]
        write.result()
        writes.popleft()
        self._slab.free(buf)

    def _land(self, copies: collections.deque, what: str) -> None:
        """Wait for the oldest piece's copy to the GPU, then free its buffer."""
        buf, event = copies[0]
        wait_for_device(event, f"copy of {what} to the GPU")
        copies.popleft()
        self._slab.free(buf)

    def _abandon(self, pending: collections.deque) -> None:
        """After a failure: wait for what is still in flight, and free the buffers nothing touches any more.

        A buffer whose copy or NVMe transfer did not end within the wait limit
        stays allocated: the copy engine or an I/O thread may still touch it.
        """
        while pending:
            buf, work = pending.popleft()
            try:
                if isinstance(work, Future):
                    work.exception()
                elif not work.synchronize(WAIT_LIMIT_S):
                    continue
            except TimeoutError:
                continue
            self._slab.free(buf)
