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

A slab buffer is given back only once the last transfer that reads or writes
it is done: :meth:`Tier.retire` parks it with that transfer's future until then.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from nvoffload.memory import MemoryBudgetError
from nvoffload.transfer import Future, TransferEngine

__all__ = ["Load", "Tier", "Write"]


class Write:
    """A tensor on its way out: ``future`` is done when it is stored; ``host`` is its slab buffer (None with GDS)."""

    __slots__ = ("future", "host", "copy_key")

    def __init__(self, future: Future, host: torch.Tensor | None, copy_key=None):
        self.future = future
        self.host = host
        self.copy_key = copy_key  # ledger key of a contiguous copy made on the device for this write


class Load:
    """A tensor on its way back into ``device`` memory; ``staging`` is its slab buffer (NVMe, not GDS)."""

    __slots__ = ("future", "device", "staging", "prefetched")

    def __init__(self, future: Future, device: torch.Tensor, staging: torch.Tensor | None, prefetched: bool):
        self.future = future
        self.device = device
        self.staging = staging
        self.prefetched = prefetched


class Tier:
    """Offloaded tensors in a TensorStore (``store``), or in host memory (``store=None``).

    In host memory a tensor's data is the slab buffer its write filled, kept
    until :meth:`delete`; with a store, slab buffers only stage the copies.
    ``make_room()`` finishes the oldest write in flight (False when none is),
    for :meth:`allocate` to wait for when the slab is full.
    ``close()`` waits for the transfers still using slab buffers, gives the
    buffers back, and closes the engine and the store when ``owned``.
    """

    def __init__(self, engine: TransferEngine, store, make_room: Callable[[], bool], *, owns_engine: bool, owns_store: bool):
        self.engine = engine
        self._make_room = make_room
        self.store = store
        self._owns_engine = owns_engine
        self._owns_store = owns_store
        self._retiring: collections.deque[tuple[Future | None, torch.Tensor]] = collections.deque()
        self.host_bytes = 0  # slab bytes this tier holds: stored data, staging, buffers retiring

    @property
    def slab(self):
        return self.engine.slab

    @property
    def used_bytes(self) -> int:
        """Bytes the offloaded tensors take in the target (swap files, or slab buffers)."""
        return self.store.used_bytes if self.store is not None else self.host_bytes

    # ---------------------------------------------------------------- host buffers
    def allocate(self, numel: int, dtype: torch.dtype, what: str, *, wait: bool = True) -> torch.Tensor | None:
        """A slab buffer for ``numel`` elements of ``dtype``.

        When the slab is full: with ``wait``, waits for retired buffers, then
        for the oldest writes (``make_room()``), and raises
        :class:`~nvoffload.memory.MemoryBudgetError` if that is not enough;
        without, returns None at once.
        """
        nbytes = numel * dtype.itemsize
        if nbytes > self.slab.capacity_bytes:
            raise MemoryBudgetError(
                f"a saved activation of {nbytes} bytes ({what}) does not fit in {self.slab.what} "
                f"({self.slab.capacity_bytes} bytes): give offload_activations a host_memory_bytes (with "
                f"nvoffload.initialize, OffloadConfig.activation_memory_bytes) of at least {2 * nbytes}, "
                "room for one write and one read, or raise min_bytes above it"
            )
        self.reap()
        while not self.slab.fits(nbytes):
            if not wait:
                return None
            if not (self.wait_retiring() or self._make_room()):
                break
        buffer = self.slab.allocate(nbytes, what)
        self.host_bytes += buffer.numel()
        return buffer.view(dtype)

    def retire(self, buffer: torch.Tensor | None, future: Future | None) -> None:
        """Give ``buffer`` back once ``future`` (the last transfer using it) is done."""
        if buffer is not None:
            self._retiring.append((future, buffer))
            self.reap()

    def reap(self) -> None:
        """Give back the retired buffers whose transfers are done, without waiting."""
        for _ in range(len(self._retiring)):
            future, buffer = self._retiring.popleft()
            if future is None or future.done():
                self._free(buffer)
            else:
                self._retiring.append((future, buffer))

    def wait_retiring(self) -> bool:
        """Wait for the oldest retired buffer's transfer and give it back; False when none is retiring."""
        if not self._retiring:
            return False
        future, buffer = self._retiring.popleft()
        if future is not None:
            future.exception()  # its error was (or will be) reported by whoever used the transfer
        self._free(buffer)
        return True

    def _free(self, buffer: torch.Tensor) -> None:
        self.host_bytes -= buffer.numel() * buffer.element_size()
        self.slab.free(buffer)

    # ---------------------------------------------------------------- out
    def write(self, name: str, flat: torch.Tensor) -> Write:
        """Start storing device tensor ``flat`` (1-D, contiguous) under ``name``.

        Queued behind the compute stream's work so far (which produced ``flat``);
        ``flat`` must stay unmodified until the write's future is done.
        """
        if self.store is None:
            host = self.allocate(flat.numel(), flat.dtype, name)
            return Write(self.engine.to_host(host, flat, what=name), host)
        host = None if self.store.direct_to_device(flat) else self.allocate(flat.numel(), flat.dtype, name)
        return Write(self.engine.save(self.store, name, flat, host), host)

    # ---------------------------------------------------------------- back
    def read(
        self, name: str, host: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device, *, prefetch: bool
    ) -> Load | None:
        """Start bringing ``name`` back into a new device tensor of ``numel`` elements of ``dtype``.

        From its slab buffer ``host`` (host memory), or from the store through
        a staging buffer (none with GPUDirect Storage). A prefetch that finds
        the slab full returns None instead of waiting.
        """
        dst = torch.empty(numel, dtype=dtype, device=device)
        if self.store is None:
            return Load(self.engine.to_device(dst, host, what=name), dst, None, prefetch)
        staging = None
        if not self.store.direct_to_device(dst):
            staging = self.allocate(numel, dtype, name, wait=not prefetch)
            if staging is None:
                return None
        return Load(self.engine.load(self.store, name, dst, staging), dst, staging, prefetch)

    def delete(self, name: str) -> None:
        """Free ``name``'s space in the store (a tensor whose write failed left none)."""
        if self.store is not None and name in self.store:
            self.store.delete(name)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for the transfers using slab buffers, give the buffers back, close what this tier owns."""
        while self.wait_retiring():
            pass
        if self._owns_store and self.store is not None:
            self.store.close()
        if self._owns_engine:
            self.engine.close()
