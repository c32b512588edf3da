"""The host slab: one allocation of exactly the host budget, page-locked once, carved into buffers.

torch's caching pinned allocator rounds each request up to a power of two and
keeps freed blocks, so pinned memory could reach twice what a budget counts.
A :class:`HostSlab` is one anonymous memory mapping of ``capacity_bytes``
(page-aligned, so every buffer carved from it is ready for O_DIRECT), registered
with CUDA once when CUDA is present; buffers are 4 KiB-aligned ranges of it, so
the budget is the real footprint. :meth:`HostSlab.carve` gives an engine its own
share of a shared slab without a second allocation; the shared slab's
:attr:`~HostSlab.used_bytes` is what its carves hold (a carve made with
``by_buffers`` counts the buffers allocated from it), the host tier of
:class:`~nvoffload.memory.MemoryManager` (host memory is counted there only).
"""

from __future__ import annotations

import mmap
import threading
import time
import weakref

import torch

from nvoffload import device as _device
from nvoffload.core.buffers import ALIGNMENT_BYTES
from nvoffload.core.extents import Extents
from nvoffload.core.future import WAIT_LIMIT_S
from nvoffload.memory import MemoryBudgetError

__all__ = ["HostSlab", "ALIGNMENT_BYTES"]



def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


class HostSlab:
    """``capacity_bytes`` of host memory (rounded down to 4 KiB) handed out as aligned buffers.

    Args:
        capacity_bytes: the budget; the mapping is exactly this size.
        what: what the memory is for, in error messages.

    ``allocate`` returns a flat ``uint8`` tensor over a range of the slab (view
    it as another dtype); ``free`` gives it back. A request that does not fit
    waits up to ``wait_s`` seconds for other buffers to be freed (back-pressure
    between engine threads), then raises :class:`~nvoffload.memory.MemoryBudgetError`
    naming what asked, how much, and what the slab holds.

    >>> slab = HostSlab(1 << 20, what="staging")
    >>> buf = slab.allocate(10_000, "a chunk")
    >>> buf.numel(), buf.data_ptr() % 4096, slab.used_bytes
    (10000, 0, 12288)
    >>> slab.free(buf); slab.close()
    """

    def __init__(self, capacity_bytes: int, what: str = "host memory", *, _parent: HostSlab | None = None, _base=None,
                 _by_buffers: bool = False):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < ALIGNMENT_BYTES:
            raise ValueError(f"a host slab needs an int of at least {ALIGNMENT_BYTES} bytes, got {capacity_bytes!r}")
        self.what = what
        self.capacity_bytes = capacity_bytes - capacity_bytes % ALIGNMENT_BYTES
        self._parent = _parent
        self._by_buffers = _by_buffers  # the parent counts this carve's buffers, not its size
        if _base is None:
            self._map = mmap.mmap(-1, self.capacity_bytes)  # page-aligned, zero-filled on first touch
            self._base = torch.frombuffer(self._map, dtype=torch.uint8)
            self._registered = _device.register_host_memory(self._base)
        else:
            self._map, self._base, self._registered = None, _base, False
        self._extents = Extents()
        self._extents.end = self.capacity_bytes
        self._extents.give(0, self.capacity_bytes)
        self._pieces: dict[int, tuple[int, int, str, int]] = {}  # data_ptr -> (offset, aligned bytes, what, counted)
        self._used = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._closed = False
        if self._parent is None:
            self._release = weakref.finalize(self, _release_mapping, self._base, self._map, self._registered)

    # ---------------------------------------------------------------- allocation
    def allocate(self, nbytes: int, what: str, *, wait_s: float = 0.0) -> torch.Tensor:
        """A 4 KiB-aligned ``uint8`` buffer of ``nbytes`` (its aligned size is counted)."""
        return self._allocate(nbytes, what, wait_s, counted=True)

    def _allocate(self, nbytes: int, what: str, wait_s: float, *, counted: bool) -> torch.Tensor:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        size = max(_round_up(nbytes), ALIGNMENT_BYTES)
        if size > self.capacity_bytes:
            raise MemoryBudgetError(
                f"{what} needs {size} bytes of {self.what}, more than its whole budget of {self.capacity_bytes} bytes"
            )
        deadline = time.monotonic() + min(wait_s, WAIT_LIMIT_S)
        with self._cond:
            while True:
                self._check_open(what)
                offset = self._extents.take(size)
                if offset is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MemoryBudgetError(self._full_message(what, size, wait_s))
                self._cond.wait(left)
            piece = self._base[offset : offset + nbytes]
            self._pieces[piece.data_ptr()] = (offset, size, what, size if counted else 0)
            self._count(size if counted else 0)
        return piece

    def free(self, buffer: torch.Tensor) -> None:
        """Give back a buffer from :meth:`allocate` (any view of it starting at its first byte)."""
        with self._cond:
            entry = self._pieces.pop(buffer.data_ptr(), None)
            if entry is None:
                raise ValueError(f"the buffer at {buffer.data_ptr():#x} was not allocated from {self.what}, or was freed")
            offset, size, _, counted = entry
            self._extents.give(offset, size)
            if not (self._closed and self._by_buffers):  # closing stopped counting what was still out
                self._count(-counted)
            self._cond.notify_all()

    def carve(self, nbytes: int, what: str, *, by_buffers: bool = False) -> HostSlab:
        """A slab over ``nbytes`` of this one (an engine's share of a shared budget); ``close()`` gives it back.

        This slab counts the carve whole in :attr:`used_bytes`, or with ``by_buffers`` only the buffers
        allocated from it (an engine that holds its share's bytes as it needs them, the host cache); then
        :attr:`available_bytes` counts what the carve has left, so carve such a share last."""
        piece = self._allocate(nbytes, what, 0.0, counted=not by_buffers)
        return HostSlab(piece.numel(), what, _parent=self, _base=piece, _by_buffers=by_buffers)

    # ---------------------------------------------------------------- accounting
    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    @property
    def peak_bytes(self) -> int:
        with self._cond:
            return self._peak

    @property
    def available_bytes(self) -> int:
        with self._cond:
            return self.capacity_bytes - self._used

    def fits(self, nbytes: int) -> bool:
        """True when a buffer of ``nbytes`` could be allocated now without waiting."""
        with self._cond:
            return self._extents.fits(max(_round_up(nbytes), ALIGNMENT_BYTES))

    def _count(self, nbytes: int) -> None:
        """(holding the lock) ``nbytes`` more in use (fewer when negative), counted in the parent too when this is
        a ``by_buffers`` carve (the lock order: a carve's, then its parent's)."""
        self._used += nbytes
        self._peak = max(self._peak, self._used)
        if self._by_buffers and nbytes:
            with self._parent._cond:
                self._parent._count(nbytes)

    def reset_peak(self) -> None:
        with self._cond:
            self._peak = self._used

    @property
    def address(self) -> int:
        """Address of the slab's first byte (for tests that find its mapping in ``/proc/self/maps``)."""
        return self._base.data_ptr()

    @property
    def page_locked(self) -> bool:
        return self._registered or (self._parent is not None and self._parent.page_locked)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Give the memory back (to the parent slab, or unmap it). Buffers still out must not be used after."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._by_buffers:  # buffers still out are no longer counted in the parent
                self._count(-self._used)
            self._cond.notify_all()
        if self._parent is not None:
            self._parent.free(self._base)
        else:
            self._release()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: {self.what} was closed")

    def _full_message(self, what: str, size: int, wait_s: float) -> str:
        holders: dict[str, int] = {}
        for _, held, owner, _ in self._pieces.values():
            holders[owner] = holders.get(owner, 0) + held
        top = ", ".join(f"{owner}: {held}" for owner, held in sorted(holders.items(), key=lambda kv: -kv[1])[:4])
        waited = f" after waiting {wait_s:g} s" if wait_s else ""
        return (
            f"{what} needs {size} bytes of {self.what}, but {self._used} of its {self.capacity_bytes} bytes are in use"
            f" (largest free range {self._extents.largest_free_bytes}){waited}; held by {top or 'nothing'}"
        )


def _release_mapping(base: torch.Tensor, mapping: mmap.mmap, registered: bool) -> None:
    """Unpin and unmap the slab: from ``close()``, or from its finalizer (at interpreter exit that runs once
    :mod:`nvoffload.core.workers` has finished every thread and native I/O pool that could still touch it).
    ``torch.frombuffer`` does not hold the mapping's buffer, so tensors over the slab never keep it mapped."""
    if registered:
        _device.unregister_host_memory(base)
    del base
    mapping.close()
