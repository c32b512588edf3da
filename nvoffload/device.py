"""The thin device layer: everything CUDA-specific in nvoffload goes through here.

Every engine also runs with the CPU standing in for the GPU. Without CUDA,
page-locking is skipped (``tensor.pin_memory()`` raises on a CPU-only torch),
and host-device copies are plain memcpy.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "cuda_available",
    "register_host_memory",
    "unregister_host_memory",
    "host_empty",
    "copy_async",
    "CopyFuture",
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


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor for staging device data, page-locked when CUDA is present.

    Uses torch's caching pinned-memory allocator (cheap to reuse, unlike one
    ``cudaHostRegister`` per buffer); a plain CPU tensor without CUDA.
    """
    return torch.empty(numel, dtype=dtype, pin_memory=cuda_available())


class CopyFuture:
    """The pending result of :func:`copy_async`: ``done()`` and ``result()``.

    ``result()`` returns the destination. For a device destination it only
    orders the current stream after the copy (no host wait); for a host
    destination it waits for the copy to finish.
    """

    __slots__ = ("_dst", "_event")

    def __init__(self, dst: torch.Tensor, event=None):
        self._dst = dst
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self, timeout: float | None = None) -> torch.Tensor:
        if self._event is not None:
            if self._dst.is_cuda:
                torch.cuda.current_stream(self._dst.device).wait_event(self._event)
            else:
                self._event.synchronize()
        return self._dst


_copy_streams: dict = {}


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> CopyFuture:
    """Copy ``src`` into ``dst`` (same shape) on a dedicated copy stream.

    Without a CUDA tensor involved this is a plain synchronous memcpy. With one,
    the copy stream first waits for the current stream (so the data is ready),
    and both tensors are recorded on the copy stream so the caching allocator
    does not reuse their memory before the copy ends. The caller keeps ``src``
    and ``dst`` alive and unmodified until the future is done.
    """
    if not (dst.is_cuda or src.is_cuda):
        dst.copy_(src)
        return CopyFuture(dst)
    device = dst.device if dst.is_cuda else src.device
    stream = _copy_streams.get(device.index)
    if stream is None:
        stream = _copy_streams.setdefault(device.index, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    for t in (dst, src):
        if t.is_cuda:
            t.record_stream(stream)
    return CopyFuture(dst, event)
