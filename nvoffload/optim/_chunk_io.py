"""The model's weights and gradients to and from the optimizer's host slots.

:class:`ChunkIO` is what the worker thread, the speculate/commit protocol and
the state-dict codec share: it holds the transfer engine, the :class:`WeightHome`
(if any), delayed updates' staged weights and the chunks' state
(``ChunkIO.chunks``, see :mod:`nvoffload.optim._chunk_state`), and no
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
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from nvoffload.device import Event, untracked
from nvoffload.optim._chunk_state import ChunkStore, Slot, StateFormat
from nvoffload.optim._layout import Record
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


class ChunkIO:
    """The model's side of the chunks' updates: their weights (:meth:`model_weights`) and gradients
    (:meth:`grad_to_host`) moved through ``transfer``, delayed updates' staged copies; and the chunks' own state
    in ``store``, laid out as ``layout`` says (``chunks``, a :class:`~nvoffload.optim._chunk_state.ChunkStore`)."""

    def __init__(self, store, layout: StateFormat, transfer: TransferEngine):
        self.chunks = ChunkStore(store, layout)
        self.transfer = transfer
        self.weight_home: WeightHome | None = None
        self.staged: dict[int, torch.Tensor] | None = None  # delayed updates: record index -> flat new weights

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
