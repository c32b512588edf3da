"""The thin device layer: everything CUDA-specific in nvoffload goes through here.

The transfer engine sees the compute device through one small interface,
:class:`ComputeDevice`: an event recorded on the compute stream, a wait of the
compute stream on an event, and copy streams (one per direction) on which a
copy is queued after an event and completes at an event of its own.

- :class:`CudaDevice`: torch's CUDA streams and events. A wait of the compute
  stream never blocks the host; copies from page-locked memory run on the copy
  engines while kernels run.
- :class:`SimDevice`: the CPU standing in for a GPU, with CUDA's ordering rules.
  A copy returns at once and runs later on its stream's worker thread, in
  order, after the event it was queued behind; it lands no sooner than
  ``NVOFFLOAD_SIM_COPY_DELAY_US`` microseconds after it was issued, and takes at
  least its bytes over ``NVOFFLOAD_SIM_COPY_GBPS`` (a PCIe-like rate), so a
  missing wait reads a buffer before its copy landed and gives a wrong result.
  Compute is the host thread itself: an event recorded on it is complete at
  once, and waiting on an event blocks the host until the event completes.

Page-locking (:func:`register_host_memory`) is a no-op without CUDA:
``tensor.pin_memory()`` raises on a CPU-only torch.
"""

from __future__ import annotations

import _thread
import concurrent.futures
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from nvoffload import trace
from nvoffload.core import future
from nvoffload.core.workers import Worker

__all__ = [
    "ComputeDevice",
    "CopyStream",
    "CudaDevice",
    "Event",
    "SimDevice",
    "cuda_available",
    "compute_device",
    "register_host_memory",
    "side_stream",
    "unregister_host_memory",
    "untracked",
]


@functools.cache
def cuda_available() -> bool:
    """True when torch was built with CUDA and a GPU is visible."""
    return torch.cuda.is_available()


def register_host_memory(tensor: torch.Tensor) -> bool:
    """Page-lock the host memory behind a contiguous CPU ``tensor`` in place.

    Registered memory lets device copies run asynchronously. Returns True when
    the memory was registered, False without CUDA (nothing to do). Pair every
    successful call with :func:`unregister_host_memory` before the memory is freed.
    """
    if not cuda_available():
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("register_host_memory needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
    return True


def unregister_host_memory(tensor: torch.Tensor) -> None:
    """Undo :func:`register_host_memory` for ``tensor``."""
    err = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {int(err)}")


class Event(Protocol):
    """A point in a stream's work: ``query()`` without waiting, ``synchronize(timeout_s)`` on the host."""

    def query(self) -> bool: ...

    def synchronize(self, timeout_s: float) -> bool:
        """Block the host until the event completes or ``timeout_s`` passes; True when complete."""
        ...

    def error(self) -> BaseException | None:
        """The failure of the work before the event (the stand-in's copies), once complete."""
        ...


class CopyStream(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None, what: str | None = None) -> Event:
        """Queue ``dst.copy_(src)`` behind ``after`` (and the stream's earlier copies); the event completes when it landed.

        ``src`` must stay unmodified and ``dst`` unread until then. With a :mod:`nvoffload.trace` active, the copy
        is a span of its stream's track (``h2d`` or ``d2h``) named ``what``.
        """
        ...


class ComputeDevice(Protocol):
    """The compute device as the transfer engine sees it."""

    device: torch.device
    simulated: bool

    def record(self) -> Event:
        """An event at the end of the work queued on the compute stream so far."""
        ...

    def wait(self, event: Event) -> None:
        """Order the compute stream's later work after ``event`` (blocks the host only on the stand-in)."""
        ...

    def copy_stream(self, direction: str) -> CopyStream:
        """The copy stream for ``"h2d"`` or ``"d2h"`` (one per direction, so writes out never queue behind reads in)."""
        ...

    def close(self) -> None: ...


def untracked(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory with a version counter of its own: autograd does not see writes through it."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


def concrete(device: torch.device | str) -> torch.device:
    """``device`` as tensors placed on it report theirs: a bare ``cuda`` is the current CUDA device (``cuda:0``).
    ``ValueError`` for a CUDA device that is not usable here (no GPU, or an index past the last one)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if not cuda_available():
        raise ValueError(f"device {device}: no CUDA GPU is usable here (torch {torch.__version__})")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def compute_device(device: torch.device | str | None = None) -> ComputeDevice:
    """The :class:`CudaDevice` for a CUDA ``device``, else the CPU stand-in (default: CUDA when available)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if cuda_available() else "cpu")
    if device.type == "cuda":
        return CudaDevice(device)
    if device.type != "cpu":
        raise ValueError(f"nvoffload computes on CUDA or on the CPU, not on {device}")
    return SimDevice()


# ---------------------------------------------------------------------------- CUDA


SPIN_S = 50e-6
"""How long a host wait polls before it blocks: a copy about to land is seen without a thread switch."""

_blocking_waits = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="nvoffload-event-wait")


def bounded_wait(query: Callable[[], bool], block: Callable[[], object], timeout_s: float) -> bool:
    """Wait on the host until ``query()`` is True, at most ``timeout_s``; True when it is.

    Polls ``query`` for :data:`SPIN_S`, then runs ``block()`` (which returns once the awaited work is done and
    has no time limit of its own: ``cudaEventSynchronize`` on an event made with ``blocking=True``, which sleeps
    until the device signals it) on a helper thread, and wakes the moment it returns, or at the time limit (the
    helper thread stays blocked until the work ends; a wait past it is the caller's error to raise).
    """
    spin_until = time.monotonic() + min(SPIN_S, timeout_s)
    while not query():
        if time.monotonic() >= spin_until:
            break
    else:
        return True
    returned = threading.Event()

    def wait() -> None:
        try:
            block()
        finally:
            returned.set()

    _blocking_waits.submit(wait)
    returned.wait(timeout_s)
    return query()


class CudaEvent:
    __slots__ = ("raw",)

    def __init__(self, stream, *, timed: bool = False):
        # blocking: a host synchronize sleeps until the device signals the event, instead of spinning a core
        self.raw = torch.cuda.Event(enable_timing=timed, blocking=True)
        self.raw.record(stream)

    def query(self) -> bool:
        return self.raw.query()

    def synchronize(self, timeout_s: float) -> bool:
        # cudaEventSynchronize has no timeout: a helper thread blocks in it, this one waits for that, bounded.
        return bounded_wait(self.raw.query, self.raw.synchronize, timeout_s)

    def error(self) -> BaseException | None:
        return None  # CUDA reports copy failures as sticky errors on the next call


class _CudaClock:
    """Host times of CUDA events: one timed event recorded (and waited for) at a known host time, then each
    event's time as that plus ``elapsed_time`` from it."""

    def __init__(self, device: torch.device):
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(torch.cuda.current_stream(device))
        self._anchor.synchronize()
        self._anchor_ns = time.monotonic_ns()

    def span(self, start, end) -> tuple[int, int] | None:
        """``(start_ns, end_ns)`` of two timed events, once complete (None when they never ran)."""
        if not end.query():
            end.synchronize()
        try:
            return tuple(self._anchor_ns + round(self._anchor.elapsed_time(e) * 1e6) for e in (start, end))
        except RuntimeError:
            return None


class _CudaCopyStream:
    def __init__(self, device: torch.device, track: str):
        self._stream = torch.cuda.Stream(device)
        self._device = device
        self._track = track
        self._clock: _CudaClock | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None, what: str | None = None) -> Event:
        if after is not None:
            self._stream.wait_event(after.raw)
        recording = trace.active()
        with torch.cuda.stream(self._stream):
            if recording is not None:  # timed events around the copy, read when the trace is written
                if self._clock is None:
                    self._clock = _CudaClock(self._device)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self._stream)
            dst.copy_(src, non_blocking=True)
            event = CudaEvent(self._stream, timed=recording is not None)
        if recording is not None:
            clock, end = self._clock, event.raw
            recording.add_later(self._track, what or "copy", lambda: clock.span(start, end), bytes=src.numel() * src.element_size())
        for t in (dst, src):  # the caching allocator must not hand this memory out before the copy ends
            if t.is_cuda:
                t.record_stream(self._stream)
        return event


class _SideStream:
    """A CUDA stream besides the compute stream, current inside ``with`` (see :func:`side_stream`)."""

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device)
        self._current: list = []

    def __enter__(self) -> _SideStream:
        current = torch.cuda.stream(self._stream)
        current.__enter__()
        self._current.append(current)
        return self

    def __exit__(self, *exc) -> None:
        self._current.pop().__exit__(*exc)


def side_stream(device: torch.device) -> _SideStream:
    """A new stream of the CUDA ``device`` besides its compute stream, made current by ``with``: work queued there
    runs beside the compute stream's (the readers of a reduction in flight, ordered after it by a stream wait,
    while backward goes on)."""
    return _SideStream(concrete(device))


class CudaDevice:
    """A CUDA GPU: the current stream computes; one copy stream per direction."""

    simulated = False

    def __init__(self, device: torch.device):
        self.device = concrete(device)
        self._streams = {d: _CudaCopyStream(self.device, d) for d in ("h2d", "d2h")}

    def record(self) -> Event:
        return CudaEvent(torch.cuda.current_stream(self.device))

    def wait(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event.raw)

    def copy_stream(self, direction: str) -> CopyStream:
        return self._streams[direction]

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- the CPU stand-in


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {raw!r}")
    return value


class _SimEvent:
    """Completes when the stand-in's copy stream reaches it (or at once, on the compute stream).

    A lock held until then (one C object per copy, as cheap to make as a CUDA event is to record): a waiter
    acquires it with its time limit and hands it back."""

    __slots__ = ("_running", "_error")

    def __init__(self, complete: bool = False):
        self._running = _thread.allocate_lock()
        self._error: BaseException | None = None
        if not complete:
            self._running.acquire()

    def query(self) -> bool:
        return not self._running.locked()

    def synchronize(self, timeout_s: float) -> bool:
        if not self._running.locked():
            return True
        if not self._running.acquire(timeout=timeout_s):
            return False
        self._running.release()
        return True

    def error(self) -> BaseException | None:
        return self._error

    def _complete(self, error: BaseException | None = None) -> None:
        self._error = error
        self._running.release()


_RAN = _SimEvent(complete=True)  # an event on the stand-in's compute stream: complete at once, one for all


class _SimCopyStream:
    """One worker thread running queued copies in order, each no sooner than its issue time plus the delay."""

    def __init__(self, name: str, delay_s: float, bytes_per_s: float):
        self._delay_s = delay_s
        self._bytes_per_s = bytes_per_s
        self._worker = Worker(name, functools.partial(_run_sim_copy, name))
        self._stop = weakref.finalize(self, self._worker.stop)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None, what: str | None = None) -> Event:
        if dst.shape != src.shape:
            raise ValueError(f"copy of shape {tuple(src.shape)} into shape {tuple(dst.shape)}")
        event = _SimEvent()
        nbytes = src.numel() * src.element_size()
        duration_s = nbytes / self._bytes_per_s if self._bytes_per_s else 0.0
        # As on a GPU, autograd sees the write when the copy is issued (``dst.copy_`` bumps the version
        # counter then); the bytes land later through an alias that leaves the counter alone (made by the
        # copy's thread: issuing a copy is all the compute thread does, as on a GPU).
        torch.autograd.graph.increment_version(dst)
        self._worker.submit((dst, src, after, time.monotonic() + self._delay_s, duration_s, event, what))
        return event

    def close(self) -> None:
        self._stop()


def _run_sim_copy(name: str, op: tuple) -> None:
    """One queued stand-in copy, on its stream's worker thread."""
    dst, src, after, not_before, duration_s, event, what = op
    error = None
    if after is not None and not after.synchronize(future.WAIT_LIMIT_S):
        error = TimeoutError(f"a stand-in copy waited {future.WAIT_LIMIT_S:g} s for the event it was queued behind")
    else:
        # The bytes land at the end: until then the destination holds its old contents, as on a GPU.
        start_s = time.monotonic()
        wake = max(not_before, start_s + duration_s)
        while (left := wake - time.monotonic()) > 0:
            time.sleep(left)
        try:
            with torch.no_grad():
                untracked(dst).copy_(src)
        except BaseException as exc:  # noqa: BLE001 - reported through the event
            error = exc
        recording = trace.active()
        if recording is not None:
            start_ns, end_ns = round(max(start_s, wake - duration_s) * 1e9), time.monotonic_ns()
            nbytes = src.numel() * src.element_size()
            recording.add(name.removeprefix("nvoffload-sim-"), what or "copy", start_ns, end_ns, bytes=nbytes)
    del op, dst, src, after  # the event's waiters must not find the copy's tensors still held
    event._complete(error)


class SimDevice:
    """The CPU standing in for a GPU: compute on the host thread, copies on worker threads (see the module docs)."""

    simulated = True

    def __init__(self, *, copy_delay_us: float | None = None, copy_gbps: float | None = None):
        self.device = torch.device("cpu")
        self.copy_delay_us = _env_number("NVOFFLOAD_SIM_COPY_DELAY_US", 0.0) if copy_delay_us is None else copy_delay_us
        self.copy_gbps = _env_number("NVOFFLOAD_SIM_COPY_GBPS", 0.0) if copy_gbps is None else copy_gbps
        if self.copy_delay_us < 0 or self.copy_gbps < 0:
            raise ValueError(f"copy_delay_us and copy_gbps must be >= 0, got {self.copy_delay_us}, {self.copy_gbps}")
        self._streams = {
            d: _SimCopyStream(f"nvoffload-sim-{d}", self.copy_delay_us * 1e-6, self.copy_gbps * 1e9)
            for d in ("h2d", "d2h")
        }

    def record(self) -> Event:
        return _RAN  # the host thread has run everything queued before

    def wait(self, event: Event) -> None:
        if not event.synchronize(future.WAIT_LIMIT_S):
            raise TimeoutError(f"compute waited {future.WAIT_LIMIT_S:g} s for a copy that did not land")

    def copy_stream(self, direction: str) -> CopyStream:
        return self._streams[direction]

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()

