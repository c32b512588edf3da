"""Where offloaded tensors live, and the transfers that move them there and back.

Every copy goes through a :class:`~nvoffload.transfer.TransferEngine`:

- out, at pack time: device->host on the engine's device-to-host stream into a
  buffer of the engine's :class:`~nvoffload.transfer.HostSlab`, then (NVMe) the
  write of that buffer, chained by the engine (``engine.save``); with
  GPUDirect Storage the device memory is written directly;
- back, ahead of unpack: (NVMe) the read into a slab buffer, then
  host->device on the host-to-device stream into a new device tensor
  (``engine.load``; ``engine.to_device`` for host memory). Unpack orders
  compute after it with ``engine.wait``.

With a store and ``resident_bytes``, the tier spills: a tensor is kept in a slab
buffer, as in host memory, while the tensors kept there fit in
``resident_bytes``, and only the others go to the store. The slab holds those
beside the staging of the store's transfers (the config sizes it so).

A slab buffer is given back only once the last transfer that reads or writes
it is done: :meth:`Tier.retire` queues it behind that transfer in the tier's
:class:`~nvoffload.transfer.FreeBehind` (:attr:`Tier.frees`, which activation
offload also frees its device tensors read back behind). A staging buffer (NVMe) is retired as soon as its transfer
starts, so a wait for room waits for transfers in flight, never for backward
to use a tensor. The slab is the only count of the host memory the tier holds.

Into a store, a tensor larger than the slab moves in pieces of at most half the
slab (room for a piece going out beside one coming back), each a tensor of the
store and a transfer of the engine through its own staging buffer, taken again
for a later piece once that transfer is done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from nvoffload.core.buffers import ALIGNMENT_BYTES
from nvoffload.memory import MemoryBudgetError
from nvoffload.transfer import FreeBehind, Future, TransferEngine

__all__ = ["Load", "Tier", "Write"]


class Write:
    """A tensor on its way out: ``future`` is done when it is stored; ``host`` is the slab buffer that holds it
    in host memory (None in a store)."""

    __slots__ = ("future", "host", "copy_key")

    def __init__(self, future: Future, host: torch.Tensor | None, copy_key=None):
        self.future = future
        self.host = host
        self.copy_key = copy_key  # ledger key of a contiguous copy made on the device for this write


class Load:
    """A tensor on its way back into ``device`` memory: ``future`` is done when it is there."""

    __slots__ = ("future", "device", "prefetched")

    def __init__(self, future: Future, device: torch.Tensor, prefetched: bool):
        self.future = future
        self.device = device
        self.prefetched = prefetched


class Tier:
    """Offloaded tensors in a TensorStore (``store``), or in host memory (``store=None``), or in host memory up
    to ``resident_bytes`` and in the store beyond (a store and ``resident_bytes``).

    In host memory a tensor's data is the slab buffer its write filled, kept
    until :meth:`release_host`; in a store, slab buffers only stage the copies.
    ``make_room()`` finishes the oldest write in flight (False when none is),
    for :meth:`allocate` to wait for when the slab is full.
    ``close()`` waits for the transfers still using slab buffers, gives the
    buffers back, and closes the engine and the store when ``owned``.
    """

    def __init__(self, engine: TransferEngine, store, make_room: Callable[[], bool], *, owns_engine: bool,
                 owns_store: bool, resident_bytes: int = 0):  # fmt: skip
        self.engine = engine
        # Bytes of tensors kept in slab buffers, and how many may be (all of the slab without a store).
        self.host_bytes = 0
        self._host_limit = engine.slab.capacity_bytes if store is None else min(resident_bytes, engine.slab.capacity_bytes)
        self._make_room = make_room
        self.store = store
        self._owns_engine = owns_engine
        self._owns_store = owns_store
        # Memory that transfers in flight still use (slab buffers, tensors read back), freed behind them.
        self.frees = FreeBehind("activation offload's buffers in use by transfers")
        self._pieces: dict[str, list[tuple[str, int, int]]] = {}  # name -> (store name, start, end) of a pieced one

    @property
    def slab(self):
        return self.engine.slab

    # ---------------------------------------------------------------- host buffers
    def allocate(self, numel: int, dtype: torch.dtype, what: str, *, wait: bool = True) -> torch.Tensor | None:
        """A slab buffer for ``numel`` elements of ``dtype``.

        When the slab is full: with ``wait``, waits for retired buffers, then
        for the oldest writes (``make_room()``), and raises
        :class:`~nvoffload.memory.MemoryBudgetError` if that is not enough;
        without, returns None at once.
        """
        nbytes = numel * dtype.itemsize
        if nbytes > self.slab.capacity_bytes:  # only in host memory (target="cpu"): a store takes pieces
            raise MemoryBudgetError(
                f"a saved activation of {nbytes} bytes ({what}) does not fit in {self.slab.what} "
                f"({self.slab.capacity_bytes} bytes), which holds the tensors offloaded to host memory: give "
                f"offload_activations a host_memory_bytes of at least {nbytes}, target='nvme', or raise min_bytes "
                "above it"
            )
        self.reap()
        while not self.slab.fits(nbytes):
            if not wait:
                return None
            if not (self.wait_retiring() or self._make_room()):
                break
        return self.slab.allocate(nbytes, what).view(dtype)

    def retire(self, buffer: torch.Tensor | None, future: Future | None) -> None:
        """Give ``buffer`` back once ``future`` (the last transfer using it; None: none) is done; give back those
        done."""
        if buffer is not None and future is None:
            self.slab.free(buffer)
        elif buffer is not None:
            self.frees.free(future, functools.partial(self.slab.free, buffer), buffer.numel() * buffer.element_size())
        self.reap()

    def release_host(self, buffer: torch.Tensor | None, future: Future | None) -> None:
        """A tensor kept in slab buffer ``buffer`` (None: kept nowhere) is no longer needed: give the buffer back
        once ``future`` (its last read; None: none) is done; give back the retired buffers already done."""
        if buffer is not None:
            self.host_bytes -= buffer.numel() * buffer.element_size()
        self.retire(buffer, future)

    def reap(self) -> None:
        """Free what transfers that are done used (retired buffers), without waiting."""
        self.frees.reap()

    def wait_retiring(self) -> bool:
        """Wait for the oldest transfer that memory is freed behind, and free it; False when none is."""
        return self.frees.wait_oldest()

    # ---------------------------------------------------------------- out
    def write(self, name: str, flat: torch.Tensor) -> Write:
        """Start storing device tensor ``flat`` (1-D, contiguous) under ``name``.

        Queued behind the compute stream's work so far (which produced ``flat``);
        ``flat`` must stay unmodified until the write's future is done.
        """
        nbytes = flat.numel() * flat.element_size()
        if self.store is None:
            host = self.allocate(flat.numel(), flat.dtype, name)
        elif self.host_bytes + nbytes <= self._host_limit:  # spilling: kept in host memory while it has room
            host = self.allocate(flat.numel(), flat.dtype, name, wait=False)
        else:
            host = None
        if host is not None:
            self.host_bytes += nbytes
            return Write(self.engine.to_host(host, flat, what=name), host)
        if self.engine.direct(self.store, flat):
            return Write(self.engine.save(self.store, name, flat, None), None)
        pieces = self._split(name, flat.numel(), flat.dtype)
        if len(pieces) > 1:
            self._pieces[name] = pieces
        futures = []
        try:
            for piece, start, end in pieces:
                host = self.allocate(end - start, flat.dtype, piece)  # waits for an earlier piece's buffer
                futures.append(self.engine.save(self.store, piece, flat[start:end], host))
                self.retire(host, futures[-1])
        except BaseException:
            for future in futures:  # what was started ends before its pieces are deleted
                future.exception()
            self.delete(name)
            raise
        return Write(futures[0] if len(futures) == 1 else Future.all_of(futures, what=name), None)

    def _split(self, name: str, numel: int, dtype: torch.dtype) -> list[tuple[str, int, int]]:
        """``(store name, start, end)`` of the pieces ``name`` moves in: itself whole when it fits in the slab,
        else pieces of at most half the slab (aligned), named ``name#i``."""
        if numel * dtype.itemsize <= self.slab.capacity_bytes:
            return [(name, 0, numel)]
        step = max(ALIGNMENT_BYTES, self.slab.capacity_bytes // 2 // ALIGNMENT_BYTES * ALIGNMENT_BYTES) // dtype.itemsize
        return [(f"{name}#{i}", start, min(start + step, numel)) for i, start in enumerate(range(0, numel, step))]

    # ---------------------------------------------------------------- back
    def read(
        self, name: str, host: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device, *, prefetch: bool
    ) -> Load | None:
        """Start bringing ``name`` back into a new device tensor of ``numel`` elements of ``dtype``.

        From its slab buffer ``host`` (kept in host memory), or from the store through
        a staging buffer (none with GPUDirect Storage), piece by piece when it
        was written in pieces. A prefetch that finds the slab full, or a
        tensor in pieces (whose reads wait for each other), returns None
        instead of waiting.
        """
        pieces = self._pieces.get(name, [(name, 0, numel)])
        if len(pieces) > 1 and prefetch:
            return None
        dst = torch.empty(numel, dtype=dtype, device=device)
        if host is not None:
            return Load(self.engine.to_device(dst, host, what=name), dst, prefetch)
        if self.engine.direct(self.store, dst):
            return Load(self.engine.load(self.store, name, dst, None), dst, prefetch)
        futures = []
        for piece, start, end in pieces:
            staging = self.allocate(end - start, dtype, piece, wait=not prefetch)  # waits for an earlier piece's
            if staging is None:  # a prefetch (of one piece) that finds the slab full
                return None
            futures.append(self.engine.load(self.store, piece, dst[start:end], staging))
            self.retire(staging, futures[-1])
        return Load(futures[0] if len(futures) == 1 else Future.all_of(futures, what=name), dst, prefetch)

    def delete(self, name: str) -> None:
        """Free ``name``'s space in the store, every piece of it (a tensor whose write failed left none)."""
        if self.store is None:
            return
        for piece, _, _ in self._pieces.pop(name, [(name, 0, 0)]):
            if piece in self.store:
                self.store.delete(piece)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for the transfers using slab buffers, give the buffers back, close what this tier owns."""
        self.frees.drain()
        if self._owns_store and self.store is not None:
            self.store.close()
        if self._owns_engine:
            self.engine.close()

