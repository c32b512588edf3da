"""The host tier of parameter streaming: copies of blocks in host memory, within the host budget."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable

import torch

from nvoffload import device as _device
from nvoffload.io import TensorStore, aligned_empty
from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.streaming._blocks import Block

__all__ = ["HostCache"]


class _Entry:
    """A block's host copy: the buffer, the read filling it (if not settled), and who uses it."""

    __slots__ = ("host", "loading", "dirty", "pins")

    def __init__(self, host: torch.Tensor, loading=None):
        self.host = host  # flat, the block's dtype
        self.loading = loading  # future of the store read into ``host``
        self.dirty = False  # newer than the store
        self.pins = 0  # users that must not see it evicted


class HostCache:
    """Host copies of blocks, least recently used first out, within the :class:`MemoryManager`'s host budget.

    The store holds every block. :meth:`pin` gives a block's flat host copy
    (read from the store if not cached) and keeps it cached until :meth:`unpin`;
    ``unpin(modified=True)`` marks it changed, and a changed block is written back
    before it leaves (or at :meth:`flush`). Thread-safe: the optimizer's worker
    pins blocks while the training thread brings them to the device.
    """

    def __init__(self, store: TensorStore, memory: MemoryManager, device: torch.device):
        self.store = store
        self.memory = memory
        self._pinned_memory = device.type == "cuda"  # page-locked buffers for device copies
        self._lock = threading.RLock()
        self._lru: collections.OrderedDict[Block, _Entry] = collections.OrderedDict()
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_wait_s = 0.0  # time pin() waited for reads to arrive

    def install(self, block: Block, fill: Callable[[torch.Tensor], None]) -> None:
        """Store a new block: ``fill`` writes its weights into a flat host buffer, which is written to the store
        and stays cached."""
        with self._lock:
            host = self._new_buffer(block)
            try:
                fill(host)
                self._write_back(block, host)
            except BaseException:
                self.memory.free("host", block.nbytes)
                raise
            self._lru[block] = _Entry(host)

    def pin(self, block: Block) -> torch.Tensor:
        """The block's weights in host memory, flat (read from the store when not cached); cached until :meth:`unpin`."""
        with self._lock:
            entry = self._lru.get(block) or self._start_read(block)
            start = time.perf_counter()
            try:
                self._settle(entry)
            except BaseException:
                self._drop(block)
                raise
            finally:
                self.io_wait_s += time.perf_counter() - start
            entry.pins += 1
            self._lru.move_to_end(block)
            return entry.host

    def unpin(self, block: Block, *, modified: bool) -> None:
        """Let the block's host copy go again; ``modified``: its weights changed (written back before it leaves)."""
        with self._lock:
            entry = self._lru[block]
            entry.pins -= 1
            entry.dirty = entry.dirty or modified

    @contextlib.contextmanager
    def pinned(self, block: Block, *, modified: bool = False):
        """:meth:`pin` and :meth:`unpin` around a ``with`` body."""
        host = self.pin(block)
        try:
            yield host
        finally:
            self.unpin(block, modified=modified)

    def prefetch(self, blocks: Iterable[Block]) -> None:
        """Start reading the blocks not cached, in order, while there is room for them."""
        with self._lock:
            for block in blocks:
                if block in self._lru:
                    continue
                try:
                    self._start_read(block)
                except MemoryBudgetError:
                    return  # no room to read ahead: the block is read when it is needed

    def flush(self) -> None:
        """Write every changed cached block back to the store."""
        with self._lock:
            for block, entry in self._lru.items():
                self._settle(entry)
                if entry.dirty:
                    self._write_back(block, entry.host)
                    entry.dirty = False

    def close(self) -> None:
        """Give back every host copy (changed ones are not written back: the store goes with the streamer)."""
        with self._lock:
            for block, entry in list(self._lru.items()):
                with contextlib.suppress(Exception):
                    self._settle(entry)
                self._drop(block)

    # ------------------------------------------------------------------ internals (caller holds the lock)
    def _start_read(self, block: Block) -> _Entry:
        host = self._new_buffer(block)
        entry = self._lru[block] = _Entry(host, self.store.get(block.name, out=host))
        self.bytes_read += block.nbytes
        return entry

    @staticmethod
    def _settle(entry: _Entry) -> None:
        if entry.loading is not None:
            loading, entry.loading = entry.loading, None
            loading.result()

    def _write_back(self, block: Block, host: torch.Tensor) -> None:
        self.store.put(block.name, host).result()
        self.bytes_written += block.nbytes

    def _new_buffer(self, block: Block) -> torch.Tensor:
        self._make_room(block)
        self.memory.allocate("host", block.nbytes, f"host copy of {block}")
        if self._pinned_memory:
            return _device.host_empty(block.numel, block.dtype)
        return aligned_empty(block.nbytes).view(block.dtype)

    def _drop(self, block: Block) -> None:
        del self._lru[block]  # the buffer goes with the entry
        self.memory.free("host", block.nbytes)

    def _make_room(self, block: Block) -> None:
        """Evict least recently used unpinned blocks (writing back changed ones) until ``block`` fits."""
        for cached, entry in list(self._lru.items()):
            if self.memory.available_bytes("host") >= block.nbytes:
                return
            if entry.pins:
                continue
            self._settle(entry)
            if entry.dirty:
                self._write_back(cached, entry.host)
            self._drop(cached)
        if self.memory.available_bytes("host") < block.nbytes:
            pinned = [str(b.index) for b, e in self._lru.items() if e.pins]
            raise MemoryBudgetError(
                f"{block} needs {block.nbytes} bytes of host memory, but {self.memory.available_bytes('host')} are "
                f"left and the cached blocks in use cannot leave (pinned: {', '.join(pinned) or 'none'})"
            )
