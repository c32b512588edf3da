"""Aligned host buffers for O_DIRECT, and a pool so the hot path never allocates."""

from __future__ import annotations

import threading

import torch

from nvoffload import device
from nvoffload.io.config import ALIGNMENT_BYTES

__all__ = ["aligned_empty", "is_aligned", "round_up", "BufferPool"]


def round_up(nbytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return -(-nbytes // alignment) * alignment


def is_aligned(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` can be the buffer of an O_DIRECT transfer as it is."""
    nbytes = tensor.numel() * tensor.element_size()
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.data_ptr() % ALIGNMENT_BYTES == 0
        and nbytes % ALIGNMENT_BYTES == 0
    )


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``nbytes`` whose address is 4 KiB-aligned.

    View it as another dtype with ``.view(dtype)``. It is not page-locked; use
    :class:`BufferPool` for buffers that device copies read from or write to.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = torch.empty(nbytes + ALIGNMENT_BYTES, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT_BYTES
    return raw[start : start + nbytes]


class BufferPool:
    """Aligned host buffers in power-of-two size classes, reused across requests.

    ``acquire(nbytes)`` returns a ``uint8`` tensor of at least ``nbytes``
    (4 KiB-aligned, page-locked when CUDA is present); ``release`` returns it.
    Up to ``max_cached_bytes`` of released buffers are kept for reuse.
    """

    def __init__(self, max_cached_bytes: int = 1 << 30):
        if max_cached_bytes < 0:
            raise ValueError(f"max_cached_bytes must be >= 0, got {max_cached_bytes}")
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(ALIGNMENT_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._cached_bytes -= size
                return free.pop()
        buffer = aligned_empty(size)
        device.register_host_memory(buffer)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            if self._cached_bytes + size <= self.max_cached_bytes:
                self._free.setdefault(size, []).append(buffer)
                self._cached_bytes += size
                return
        self._drop(buffer)

    @staticmethod
    def _drop(buffer: torch.Tensor) -> None:
        if device.cuda_available():
            device.unregister_host_memory(buffer)

    @property
    def cached_bytes(self) -> int:
        """Bytes held in released buffers waiting for reuse."""
        return self._cached_bytes

    def close(self) -> None:
        """Drop the cached buffers (and unregister page-locked ones)."""
        with self._lock:
            free, self._free = self._free, {}
            self._cached_bytes = 0
        for buffers in free.values():
            for buffer in buffers:
                self._drop(buffer)
