"""Moving chunk state between the store and host slots, and reaching the model's weights.

:class:`ChunkIO` is what the worker thread, the speculate/commit protocol and
the state-dict codec share: it holds the store, the layout, the
:class:`WeightHome` (if any) and the I/O byte counters, and no reference to the
optimizer itself, so a dropped optimizer can be collected while its worker runs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch

from nvoffload.optim._layout import Chunk, Layout, Record, Slot


class WeightHome(Protocol):
    """Where some parameters' weights live while they are off the device (see :mod:`nvoffload.streaming`).

    The optimizer reads and writes those weights through ``acquire`` (a flat,
    writable host tensor of the parameter's dtype, valid until ``release``);
    ``release(modified=True)`` tells the home that the weights changed. Called
    from the optimizer's worker thread as well as the training thread.
    """

    def holds(self, param: torch.Tensor) -> bool: ...

    def acquire(self, param: torch.Tensor) -> torch.Tensor: ...

    def release(self, param: torch.Tensor, *, modified: bool) -> None: ...


class AllOf:
    """Store futures waited for together; ``result()`` raises the first error once all are done."""

    __slots__ = ("_futures",)

    def __init__(self, futures: list):
        self._futures = futures

    def result(self, timeout: float | None = None) -> None:
        error = None
        for f in self._futures:
            try:
                f.result(timeout)
            except BaseException as exc:  # noqa: BLE001 - every part must finish before the slot is reused
                error = error or exc
        if error is not None:
            raise error


class ChunkIO:
    """Reads and writes generations of chunk state in ``store``, counting the bytes moved."""

    def __init__(self, store, layout: Layout):
        self.store = store
        self.layout = layout
        self.weight_home: WeightHome | None = None
        self.read_bytes = 0
        self.written_bytes = 0
        self._count_lock = threading.Lock()

    def reset_counts(self) -> None:
        with self._count_lock:
            self.read_bytes = self.written_bytes = 0

    @contextlib.contextmanager
    def model_weights(self, rec: Record, *, modify: bool):
        """The parameter's weights as a flat tensor: on the device, or in its :class:`WeightHome`."""
        home = self.weight_home
        if home is None or not home.holds(rec.param):
            yield rec.param.detach().view(-1)
            return
        flat = home.acquire(rec.param)
        try:
            yield flat
        finally:
            home.release(rec.param, modified=modify)

    def read(self, chunk: Chunk, gen: int, slot: Slot, *, state: bool = True, master: bool = True) -> AllOf:
        """Start reading generation ``gen`` of ``chunk`` into ``slot`` (or only its state or its master row)."""
        futures = []
        for name, out in self.layout.entries(chunk, gen, self.layout.chunk_rows(chunk, slot), state=state, master=master):
            futures.append(self.store.get(name, out=out))
            with self._count_lock:
                self.read_bytes += out.numel() * 4
        return AllOf(futures)

    def write(self, chunk: Chunk, gen: int, rows: torch.Tensor) -> AllOf:
        """Start writing ``rows`` (``(rows, numel)`` fp32) as generation ``gen`` of ``chunk``."""
        futures = []
        for name, part in self.layout.entries(chunk, gen, rows):
            futures.append(self.store.put(name, part))
            with self._count_lock:
                self.written_bytes += part.numel() * 4
        return AllOf(futures)

    def delete(self, chunk: Chunk, gen: int) -> None:
        for name in self.layout.names(chunk, gen):
            if name in self.store:
                self.store.delete(name)

    def write_first(self, chunk: Chunk, rows: torch.Tensor, scalars: dict) -> None:
        """Write ``rows`` as generation 0, the committed state of a chunk that had none."""
        self.write(chunk, 0, rows).result()
        chunk.gen = 0
        chunk.scalars = scalars

    def init(self, chunk: Chunk, slot: Slot) -> None:
        """First update of a chunk: master = the model's weights, zero state; saved as generation 0."""
        rows = self.layout.chunk_rows(chunk, slot)
        with self.model_weights(chunk.record, modify=False) as weights:
            rows[0].copy_(weights[chunk.elements])
        rows[1:].zero_()
        self.write_first(chunk, rows, {})

    def discard(self, chunk: Chunk) -> None:
        """Delete every generation of ``chunk`` from the store and forget its state."""
        for gen in {chunk.gen, chunk.pending_gen} - {None}:
            self.delete(chunk, gen)
        chunk.gen, chunk.pending_gen, chunk.applied, chunk.scalars = None, None, False, {}
