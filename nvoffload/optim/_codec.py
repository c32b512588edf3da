"""The state dict codec: the optimizer's state on NVMe to and from torch's state dict, chunk by chunk.

The state dict has the wrapped optimizer's layout (for Adam/AdamW: ``step``,
``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``, fp32), plus
``master_param`` (fp32) for bf16/fp16 parameters, so it is interchangeable
with the wrapped optimizer's own. Chunks pass through one slot lent by the
worker, so host memory stays within the budget (plus the tensors returned).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from nvoffload.core.buffers import round_up
from nvoffload.core.future import Future
from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._chunk_state import Chunk, ChunkStore, Slot
from nvoffload.optim._layout import Record
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._updates import Update
from nvoffload.transfer import relay

Sink = Callable[[torch.Tensor, slice, torch.Tensor], None]  # (placeholder, elements, fp32 values)
Source = Callable[[torch.Tensor, slice, torch.Tensor], None]  # (state tensor or placeholder, elements, out)
# (placeholder, elements, fp32 values) -> the future of their write (None: written); values live until it is done
AsyncSink = Callable[[torch.Tensor, slice, torch.Tensor], "Future | None"]


class StateCodec:
    """Reads and writes the state of ``records`` (the optimizer's list, shared) as a torch state dict.

    Besides whole state dicts, it streams: :meth:`layout` gives the state dict with a meta tensor (dtype and
    shape, no data) in place of every per-element tensor, :meth:`stream` hands their values out chunk by
    chunk, and :meth:`load_state_dict` with a ``source`` fills them chunk by chunk, so that a checkpoint
    larger than memory passes through one slot.
    """

    def __init__(self, records: list[Record], io: ChunkIO, update: Update, pipeline: Pipeline):
        self._records = records
        self._io = io
        self._chunks = io.chunks
        self._update = update
        self._pipeline = pipeline

    def state_dict(self, param_groups: list[dict]) -> dict:
        layout = self.layout(param_groups)
        full: dict[int, torch.Tensor] = {}  # id(placeholder) -> the tensor gathered (zeros where another rank owns)
        for st in layout["state"].values():
            for value in st.values():
                if isinstance(value, torch.Tensor) and value.is_meta:
                    full[id(value)] = torch.zeros(value.shape, dtype=torch.float32)

        def gather(placeholder: torch.Tensor, elements: slice, values: torch.Tensor) -> None:
            full[id(placeholder)].view(-1)[elements] = values

        self.stream(layout, gather)
        for st in layout["state"].values():
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.is_meta:
                    st[key] = full[id(value)]
        return layout

    def layout(self, param_groups: list[dict]) -> dict:
        """The state dict with a meta tensor (fp32, the parameter's shape) for each per-element tensor; no I/O."""
        self._pipeline.wait_idle()
        state = {}
        for rec in self._records:
            if rec.step == 0 or any(c.gen is None for c in rec.chunks):
                continue
            st = self._update.scalar_state(rec)
            for key in self._row_keys(rec):
                if key is not None:
                    st[key] = torch.empty(rec.param.shape, dtype=torch.float32, device="meta")
            state[rec.index] = st
        groups = []
        for g in param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [r.index for r in self._records if r.group is g]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def stream(self, layout: dict, sink: Sink) -> None:
        """Call ``sink(placeholder, elements, values)`` for every meta tensor of ``layout`` (from :meth:`layout`,
        no step since), chunk by chunk in order of elements; ``values`` (fp32) is valid during the call only."""
        self._pipeline.wait_idle()
        with self._pipeline.lend() as slot:
            for st, keys, c in self._chunks_of(layout):
                self._chunks.read(c, c.gen, slot).result()
                values = self._chunks.layout.views(c, slot).values()
                for key, value in zip(keys, values):
                    if key is not None:
                        sink(st[key], c.elements, value)  # a compact state's moments widened or decoded

    def snapshot(self, layout: dict) -> StateSnapshot:
        """The committed state of ``layout``'s tensors (from :meth:`layout`, no step since), held for
        :meth:`StateSnapshot.stream` while the next steps run: the store's generations pinned, a resident
        chunk's rows copied (its buffer takes the generation after next)."""
        self._pipeline.wait_idle()
        items, names = [], []
        for st, keys, c in self._chunks_of(layout):
            copy = self._chunks.home_rows(c, c.gen).clone() if c.home is not None else None
            master = keys[0] is not None  # else the weights' row (a split chunk's own entry) is not saved: not read
            items.append(_Held(st, keys, c, c.gen, copy, master))
            if copy is None:
                held = self._chunks.layout.names(c, c.gen)[: 2 if master else 1]
                names += [name for name in held if name in self._chunks.store]
        return StateSnapshot(self._chunks, items, self._chunks.store.pin(names))

    def _chunks_of(self, layout: dict) -> Iterator[tuple[dict, list[str | None], Chunk]]:
        """Each chunk with state in ``layout``, in order: its parameter's layout entry, its row keys, itself."""
        for rec in self._records:
            st = layout["state"].get(rec.index)
            if st is not None:
                keys = self._row_keys(rec)
                for c in rec.chunks:
                    yield st, keys, c

    def _row_keys(self, rec: Record) -> list[str | None]:
        """The state dict key of each of ``rec``'s chunks' :meth:`ChunkState.values` (None: the weights of a
        parameter whose master is its own weights: fp32, or bf16 without an fp32 master)."""
        nrows = self._chunks.layout.rows(rec)
        master = None if self._chunks.layout.split(rec) else "master_param"
        return [master, *self._update.row_keys(rec, nrows)]

    def load_state_dict(self, state_dict: dict, param_groups: list[dict], source: Source | None = None) -> None:
        """Load ``state_dict`` into the store; the groups' hyperparameters are taken from it (as torch does).
        Parameters without a ``master_param`` entry use the model's current weights as master weights.
        ``source(tensor, elements, out)`` fills ``out`` (fp32) with ``elements`` of a state tensor, flat
        (default: copied from the tensor itself; for meta tensors, read from wherever they stand for)."""
        source = source if source is not None else _copy_elements
        self._pipeline.wait_idle()
        groups = state_dict["param_groups"]
        if len(groups) != len(param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, optimizer has {len(param_groups)}")
        by_index = {}
        for g, saved in zip(param_groups, groups):
            recs = [r for r in self._records if r.group is g]
            if len(saved["params"]) != len(recs):
                raise ValueError(
                    f"loaded state dict contains a parameter group of {len(saved['params'])} parameters"
                    f" that doesn't match the size of optimizer's group ({len(recs)})"
                )
            by_index.update(zip(saved["params"], recs))
        for idx in state_dict["state"]:
            if idx not in by_index:
                raise ValueError(f"state for parameter {idx} has no matching parameter")
        for g, saved in zip(param_groups, groups):
            g.update((k, v) for k, v in saved.items() if k != "params")
        with self._pipeline.lend() as slot:
            for idx, rec in by_index.items():
                self._scatter(rec, state_dict["state"].get(idx), slot, source)

    def _scatter(self, rec: Record, st: dict | None, slot: Slot, source: Source) -> None:
        for c in rec.chunks:
            self._chunks.discard(c)
        rec.step = 0
        if not st:
            return
        nrows = self._chunks.layout.rows(rec)
        shape = rec.param.shape
        master = st.get("master_param")
        tensors, scalars, rec.step = self._update.parse(rec, st, nrows)
        for t in [t for t in (master, *tensors) if t is not None]:
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"state tensor of shape {tuple(t.shape)} does not fit {rec.name}")
        for c in rec.chunks:
            state = self._chunks.layout.views(c, slot)
            state.rows.zero_()
            for index, t in enumerate(tensors):
                if state.moments[index].dtype == torch.float32:
                    source(t, c.elements, state.moments[index])
                else:  # a compact state's: rounded from fp32 values
                    values = torch.empty(c.numel, dtype=torch.float32)
                    source(t, c.elements, values)
                    state.set_moment(index, values)
            if master is not None:
                source(master, c.elements, state.weights)  # a master is fp32
            else:  # the model's current weights are the master
                with self._io.model_weights(rec, modify=False) as weights:
                    weights.read(c.elements, state.weights, slot)
            self._chunks.write_first(c, state.rows, dict(scalars))


def _copy_elements(tensor: torch.Tensor, elements: slice, out: torch.Tensor) -> None:
    out.copy_(tensor.detach().reshape(-1)[elements])


@dataclass
class _Held:
    """One chunk of a :class:`StateSnapshot`: where its values go, and its generation (or a resident copy)."""

    state: dict  # the layout's entry of its parameter: key -> placeholder
    keys: list[str | None]  # the state dict key of each of its values (None: not saved)
    chunk: Chunk
    gen: int
    copy: torch.Tensor | None  # a resident chunk's rows, copied when the snapshot was taken
    master: bool  # whether its weights' row is saved (and read)


class StateSnapshot:
    """The optimizer state of one step, held while the next steps run, streamed from any thread by
    :meth:`stream` through buffers of its own (not the optimizer's slots). The store keeps the step's
    generation of each chunk (a :class:`~nvoffload.io.StorePin`: the next commits' deletes leave its extents
    alone, so nothing the snapshot reads is overwritten and no step waits for it) until :meth:`release`:
    on NVMe, one more generation of the state at most."""

    def __init__(self, chunks: ChunkStore, items: list[_Held], pin):
        self._chunks, self._items, self._pin = chunks, items, pin

    def _rows_numel(self, held: _Held) -> int:
        return self._chunks.layout.rows(held.chunk.record) * held.chunk.numel

    def _widened_numel(self, held: _Held) -> int:
        """fp32 elements of the 16-bit values of ``held`` that :meth:`_values` widens."""
        rows = torch.empty(self._rows_numel(held), device="meta").view(-1, held.chunk.numel)
        state = self._chunks.layout.chunk_state(held.chunk, rows)
        views = (state.weights, *state.moments) if state.exponents is None else ()
        return sum(v.numel() for v in views if v.dtype != torch.float32)

    def _values(self, held: _Held, rows: torch.Tensor, spare: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`ChunkState.values` of ``held``'s ``rows``, a 16-bit one widened into ``spare`` (fp32, the buffer's
        own: no memory allocated, and faulted in, per chunk); 8-bit moments decoded."""
        state = self._chunks.layout.chunk_state(held.chunk, rows)
        if state.exponents is not None:
            return state.values()
        values, free = [], spare
        for view in (state.weights, *state.moments):
            if view.dtype != torch.float32:
                view, free = free[: view.numel()].copy_(view), free[view.numel() :]
            values.append(view)
        return values

    def stream(self, sink: AsyncSink, *, max_bytes_in_flight: int) -> None:
        """Call ``sink(placeholder, elements, values)`` for every value of every chunk held, chunk by chunk in
        order of elements (as :meth:`StateCodec.stream`); the reads run ahead and ``sink``'s writes behind,
        in buffers of at most ``max_bytes_in_flight`` bytes in all (at least two chunks', each its rows and its
        widened values): a buffer is read into again once the writes ``sink`` returned for it are done."""
        if not self._items:
            return
        largest = round_up(max(self._rows_numel(h) * 4 for h in self._items))
        widest = max(self._widened_numel(h) * 4 for h in self._items)

        def rows(held: _Held, buffer: torch.Tensor) -> torch.Tensor:
            return buffer[:largest].view(torch.float32)[: self._rows_numel(held)].view(-1, held.chunk.numel)

        def write(held: _Held, buffer: torch.Tensor) -> Future:
            values = self._values(held, rows(held, buffer), buffer[largest:].view(torch.float32))
            futures = [sink(held.state[key], held.chunk.elements, value) for key, value in zip(held.keys, values) if key]
            return Future.all_of([f for f in futures if f is not None])

        def read(held: _Held, buffer: torch.Tensor) -> Future:
            return self._read(held, rows(held, buffer))

        relay(self._items, largest + widest, max_bytes_in_flight, read, write)

    def _read(self, held: _Held, rows: torch.Tensor) -> Future:
        if held.copy is not None:
            rows.copy_(held.copy)
            return Future.completed()
        entries = self._chunks.layout.entries(held.chunk, held.gen, rows, master=held.master)
        return Future.all_of([self._pin.get(name, out=out) for name, out in entries])

    def release(self) -> None:
        """Let the store reuse the generations held (those the next steps replaced). Idempotent."""
        self._pin.release()
        self._items = []
