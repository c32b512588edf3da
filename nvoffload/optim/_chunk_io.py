"""Moving chunk state between the store and host slots, and the model's weights and gradients to and from them.

:class:`ChunkIO` is what the worker thread, the speculate/commit protocol and
the state-dict codec share: it holds the store, the layout, the transfer
engine, the :class:`WeightHome` (if any) and the I/O byte counters, and no
reference to the optimizer itself, so a dropped optimizer can be collected
while its worker runs.

Parameters and gradients are device memory (on the CPU stand-in too): every
byte between them and a host slot moves on the transfer engine's copy streams,
queued behind an event of the compute stream, and the host waits for a copy's
future before it reads what the copy brought. The optimizer's worker thread
computes nothing on the device, so an event it recorded itself would order its
copies after the wrong work (on CUDA its own default stream: all of backward
queued so far, or not the stream that produced the tensor): every copy it
queues waits for the event of its request (``Request.ready``), recorded by the
thread that queued the request when the gradient was final.

Delayed updates (``delayed_update``): the worker writes an update's new weights into a second copy of the
parameter on its device (:meth:`ChunkIO.stage`, made on the training thread when the update is
queued) instead of the parameter, which the next forward and backward still read; ``step()`` copies them in
(:meth:`ChunkIO.install_staged`) once the updates are done. A :class:`WeightHome`'s parameters (streamed
blocks) get theirs from the home (``acquire(staged=True)``), which makes them the weights at ``install_staged``.
PipeDream-2BW keeps its two weight versions the same way.

Resident state: the chunks that :class:`ResidentState` gave a home (host
memory, two buffers: generation ``g`` in ``Chunk.home[g % 2]``) are read and
written there, never in the store, and count no store bytes; everything else
(generations, commit, restore, state dicts) is the same for them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch

from nvoffload.device import Event, untracked
from nvoffload.optim._layout import Chunk, Layout, Record, Slot
from nvoffload.transfer import Future, TransferEngine


class WeightHome(Protocol):
    """Where some parameters' weights live while they are off the device (see :mod:`nvoffload.streaming`).

    The optimizer reads and writes those weights through ``acquire`` (a flat,
    writable host tensor of the parameter's dtype, valid until ``release``);
    ``release(modified=True)`` tells the home that the weights changed. Called
    from the optimizer's worker thread as well as the training thread. A home
    that takes deferred or delayed updates is also an
    :class:`~nvoffload.optim._in_flight.InFlightHome`.
    """

    def holds(self, param: torch.Tensor) -> bool: ...

    def acquire(self, param: torch.Tensor, *, staged: bool = False) -> torch.Tensor:
        """The parameter's weights (``staged``: the next weights a delayed update writes, which forward and backward
        do not read until :meth:`install_staged`)."""
        ...

    def release(self, param: torch.Tensor, *, modified: bool, staged: bool = False) -> None: ...


class ModelWeights:
    """One parameter's flat weights as the optimizer reads and writes them: device memory, reached through
    the transfer engine's copy streams, or a :class:`WeightHome`'s host tensor, reached directly. With a
    ``staged`` copy (delayed updates), reads come from the parameter and writes go to the copy."""

    __slots__ = ("flat", "on_host", "staged", "_transfer")

    def __init__(self, flat: torch.Tensor, on_host: bool, transfer: TransferEngine, staged: torch.Tensor | None = None):
        self.flat, self.on_host, self.staged, self._transfer = flat, on_host, staged, transfer

    def host_view(self, elements: slice) -> torch.Tensor | None:
        """The weights of ``elements`` as a host tensor an update may write in place, or None (device memory)."""
        return self.flat[elements] if self.on_host else None

    def read(self, elements: slice, out: torch.Tensor, slot: Slot, *, after: Event | None = None) -> None:
        """Copy the weights of ``elements`` into the host tensor ``out`` (fp32 or the parameter's dtype); on the
        device the copy is queued behind ``after`` (default: the calling thread's compute stream so far: the
        worker thread passes its request's event)."""
        src = self.flat[elements]
        if self.on_host:
            out.copy_(src)
            return
        staging = out if out.dtype == src.dtype else slot.out(src.dtype, src.numel())
        self._transfer.to_host(staging, src, after=after, what="weights").result()
        if staging is not out:
            out.copy_(staging)

    def write(self, elements: slice, src: torch.Tensor, slot: Slot, *, after: Event | None = None) -> Future:
        """Set the weights of ``elements`` from host ``src`` (fp32 or the parameter's dtype); on the device
        the copy is queued behind ``after`` (default: the compute stream's work so far). ``src`` and
        ``slot`` stay untouched until the future is done.

        The write does not bump the parameter's autograd version: an update only lands once the parameter's
        gradient is final, and a forward that saw it early (an extra micro-batch) is undone by ``step()``,
        which must not meet autograd's in-place error in that micro-batch's backward first."""
        dst = untracked((self.flat if self.staged is None else self.staged)[elements])
        if src.dtype != dst.dtype:
            src = slot.out(dst.dtype, dst.numel()).copy_(src)
        if self.on_host:
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
            return Future.completed()
        return self._transfer.to_device(dst, src, after=after, what="weights")


class ResidentState:
    """Host homes for chunks' state that never goes to the store: ``capacity_bytes`` of ``slab``, given to the
    chunks offered, in order, while their two generations fit (``2 * rows * 4`` bytes an element, 4 KiB-aligned).

    The homes stay allocated until the slab is closed; ``used_bytes`` is what they hold, ``state_bytes`` one
    generation of their state in the store (what the store would read and write per update without them)."""

    def __init__(self, slab, capacity_bytes: int, rows: int):
        self._slab = slab
        self.capacity_bytes = capacity_bytes
        self._rows = rows  # rows per element of each home: the slots' (the most any group needs)
        self.used_bytes = 0
        self.state_bytes = 0

    def offer(self, chunk: Chunk, state_bytes: int) -> bool:
        """Give ``chunk`` (``state_bytes`` of state a generation in the store) a home if its two generations fit
        what is left; True if so."""
        rows_bytes = self._rows * chunk.numel * 4
        gen_bytes = -(-rows_bytes // 4096) * 4096
        if self.used_bytes + 2 * gen_bytes > self.capacity_bytes:
            return False
        memory = self._slab.allocate(2 * gen_bytes, "the resident optimizer state")
        chunk.home = tuple(memory[at : at + rows_bytes].view(torch.float32) for at in (0, gen_bytes))
        self.used_bytes += 2 * gen_bytes
        self.state_bytes += state_bytes
        return True


class ChunkIO:
    """Reads and writes generations of chunk state in ``store``, counting the bytes moved."""

    def __init__(self, store, layout: Layout, transfer: TransferEngine):
        self.store = store
        self.layout = layout
        self.transfer = transfer
        self.weight_home: WeightHome | None = None
        self.staged: dict[int, torch.Tensor] | None = None  # delayed updates: record index -> flat new weights
        self.read_bytes = 0
        self.written_bytes = 0
        self._count_lock = threading.Lock()

    def reset_counts(self) -> None:
        with self._count_lock:
            self.read_bytes = self.written_bytes = 0

    @contextlib.contextmanager
    def model_weights(self, rec: Record, *, modify: bool, update: bool = False):
        """The parameter's :class:`ModelWeights`: on the device, or in its :class:`WeightHome`; for an
        ``update`` with delayed updates, writing to its staged copy."""
        home = self.weight_home
        if home is None or not home.holds(rec.param):
            staged = self.staged[rec.index] if update and self.staged is not None else None
            yield ModelWeights(rec.param.detach().view(-1), False, self.transfer, staged)
            return
        staged = update and self.staged is not None
        flat = home.acquire(rec.param, staged=staged)  # staged: a copy of the weights, which the update rewrites
        try:
            yield ModelWeights(flat, True, self.transfer, flat if staged else None)
        finally:
            home.release(rec.param, modified=modify, staged=staged)

    def stage(self, records: list[Record]) -> None:
        """Delayed updates: give each of ``records`` the device copy its updates write to (once; on the
        training thread, so the caching allocator files it under the compute stream)."""
        if self.staged is None:
            self.staged = {}
        for rec in records:
            if rec.index not in self.staged:
                self.staged[rec.index] = torch.empty_like(rec.param, memory_format=torch.contiguous_format).detach().view(-1)

    def install_staged(self, records: list[Record]) -> None:
        """Delayed updates: copy the new weights of ``records`` (their updates done) into the parameters, on
        the compute stream."""
        with torch.no_grad():
            for rec in records:
                untracked(rec.param.detach().view(-1)).copy_(self.staged[rec.index])

    def grad_to_host(self, grad: torch.Tensor, slot: Slot, ready: Event | None) -> Future:
        """Start copying a chunk's gradient (device memory, final at the event ``ready``) into ``slot``; the future's
        result is the host copy."""
        host = slot.grad(grad.dtype, grad.numel())
        return self.transfer.to_host(host, grad, after=ready, what="a gradient")

    def read(self, chunk: Chunk, gen: int, slot: Slot, *, state: bool = True, master: bool = True) -> Future:
        """Start reading generation ``gen`` of ``chunk`` into ``slot`` (or only its state or its master row)."""
        future, nbytes = self.read_ahead(chunk, gen, slot, state=state, master=master)
        self.count_read(nbytes)
        return future

    def read_ahead(self, chunk: Chunk, gen: int, slot: Slot, *, state: bool = True, master: bool = True) -> tuple[Future, int]:
        """:meth:`read`, with its bytes left for the caller to :meth:`count_read` once the read is used (a read
        ahead of the next step counts in that step, whether it starts before or after ``reset_counts``)."""
        rows = self.layout.chunk_rows(chunk, slot)
        if chunk.home is not None:
            for (_, out), (_, kept) in zip(
                self.layout.entries(chunk, gen, rows, state=state, master=master),
                self.layout.entries(chunk, gen, self._home(chunk, gen), state=state, master=master),
            ):
                out.copy_(kept)
            return Future.completed(), 0
        futures, nbytes = [], 0
        for name, out in self.layout.entries(chunk, gen, rows, state=state, master=master):
            futures.append(self.store.get(name, out=out))
            nbytes += out.numel() * out.element_size()
        return Future.all_of(futures), nbytes

    def count_read(self, nbytes: int) -> None:
        with self._count_lock:
            self.read_bytes += nbytes

    def write(self, chunk: Chunk, gen: int, rows: torch.Tensor) -> Future:
        """Start writing ``rows`` (``(rows, numel)`` fp32) as generation ``gen`` of ``chunk`` (a resident chunk's
        is copied to its home now)."""
        if chunk.home is not None:
            self._home(chunk, gen).copy_(rows)
            return Future.completed()
        futures = []
        for name, part in self.layout.entries(chunk, gen, rows):
            futures.append(self.store.put(name, part))
            with self._count_lock:
                self.written_bytes += part.numel() * part.element_size()
        return Future.all_of(futures)

    def read_kept(self, chunk: Chunk, out: torch.Tensor, which: int) -> Future:
        """Start reading ``chunk``'s kept gradient (fp32; entry ``which``, see :meth:`Chunk.kept_name`) into ``out``."""
        with self._count_lock:
            self.read_bytes += out.numel() * 4
        return self.store.get(chunk.kept_name(which), out=out)

    def write_kept(self, chunk: Chunk, grad: torch.Tensor, which: int) -> Future:
        """Start writing the fp32 ``grad`` as ``chunk``'s kept gradient ``which`` (replacing the one kept before)."""
        with self._count_lock:
            self.written_bytes += grad.numel() * 4
        return self.store.put(chunk.kept_name(which), grad)

    def _home(self, chunk: Chunk, gen: int) -> torch.Tensor:
        """The ``(rows, numel)`` rows of generation ``gen`` of the resident ``chunk``."""
        nrows = self.layout.rows(chunk.record)
        return chunk.home[gen % 2][: nrows * chunk.numel].view(nrows, chunk.numel)

    def delete(self, chunk: Chunk, gen: int) -> None:
        if chunk.home is not None:
            return  # nothing in the store: its buffer takes generation gen + 2
        for name in self.layout.names(chunk, gen):
            if name in self.store:
                self.store.delete(name)

    def write_first(self, chunk: Chunk, rows: torch.Tensor, scalars: dict) -> None:
        """Write ``rows`` as generation 0, the committed state of a chunk that had none."""
        self.write(chunk, 0, rows).result()
        chunk.gen = 0
        chunk.scalars = scalars

    def init(self, chunk: Chunk, slot: Slot, *, after: Event | None) -> None:
        """First update of a chunk: master = the model's weights (read once ``after`` completed), zero state;
        saved as generation 0."""
        rows = self.layout.chunk_rows(chunk, slot)
        with self.model_weights(chunk.record, modify=False) as weights:
            weights.read(chunk.elements, self.layout.chunk_state(chunk, rows).weights, slot, after=after)
        rows[1:].zero_()
        self.write_first(chunk, rows, {})

    def discard(self, chunk: Chunk) -> None:
        """Delete every generation of ``chunk`` from the store and forget its state."""
        for gen in {chunk.gen, chunk.pending_gen} - {None}:
            self.delete(chunk, gen)
        for name in (chunk.kept_name(0), chunk.kept_name(1)):
            if name in self.store:
                self.store.delete(name)
        chunk.gen, chunk.pending_gen, chunk.applied, chunk.scalars = None, None, False, {}
