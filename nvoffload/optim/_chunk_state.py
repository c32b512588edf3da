"""One chunk's optimizer state: how it is laid out, where it lives, its generations, its read and write.

A chunk (:class:`Chunk`) is a contiguous range of one parameter's elements. Its state is a block of fp32
*rows* of ``numel`` elements each: row 0 is the master weights, the others the optimizer's per-element state
(Adam's moments). Compact Adam state (see :data:`~nvoffload.optim._layout.STATE_PRECISIONS`) keeps both
moments as bf16 in row 1 (``exp_avg`` in its first half of bytes, ``exp_avg_sq`` in its second), or as 8-bit
codes (``exp_avg``'s, ``exp_avg_sq``'s, then the int8 exponents of their blocks' scales: the first half of row 1
and a little more), and without an fp32 master the bf16 weights in the first half of row 0; :class:`ChunkState`
gives the typed views (:meth:`StateFormat.views`), and the store holds only the bytes used.

Where it lives:

- in a :class:`Slot` (a host buffer of the optimizer's share of the slab) while an update runs, with staging
  for the chunk's gradient, its kept gradient and its 16-bit weights;
- between updates, in the store as *generations*: every update writes a new one (at most two coexist: the
  committed ``Chunk.gen`` and the step's ``Chunk.pending_gen``), named ``opt<N>.p<param>.c<chunk>.g<generation>``
  (plus ``.w`` for the master row of fp32 parameters, which is kept apart, see :meth:`StateFormat.split`);
- or, for the chunks that :class:`ResidentState` gave a home, in two host buffers of their own (generation
  ``g`` in ``Chunk.home[g % 2]``), never in the store and counting no store bytes; everything else
  (generations, commit, restore, state dicts) is the same for them.

With gradients released during backward, a chunk's fp32 gradient summed over the step's micro-batches is kept
as ``opt<N>.p<param>.c<chunk>.grad`` (see :mod:`nvoffload.optim._released`).

:class:`ChunkStore` reads and writes generations (and kept gradients) and counts the bytes; the optimizer's
worker drives one chunk's update through an :class:`InSlot`: ``ChunkStore.hold`` gives it the chunk's slot,
``read`` starts the committed generation's read into it (ahead of the update or in its turn), ``state`` waits
for it, and ``write`` writes the next generation.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from nvoffload.optim.kernels import FP8_BLOCK, decode_moment, encode_moment, fp8_blocks
from nvoffload.transfer import Future

MASTERLESS = ("bf16", "8bit")  # the precisions that update bf16 weights without an fp32 master
MAX_GENERIC_ROWS = 5  # master + up to four param-shaped state tensors of a generic optimizer


class ChunkState(NamedTuple):
    """Typed views of one chunk's rows: ``weights`` (the fp32 master, or the bf16 weights of a chunk without
    one) and the per-element state (Adam's ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``;
    a generic optimizer's fp32 rows), each ``numel`` elements."""

    rows: torch.Tensor
    weights: torch.Tensor
    moments: tuple[torch.Tensor, ...]
    exponents: torch.Tensor | None = None  # 8-bit moments: their blocks' scale exponents (2, blocks), int8

    def values(self) -> list[torch.Tensor]:
        """``weights`` then the moments as fp32 values (decoded, widened): in the order of the codec's state dict
        keys."""
        if self.exponents is None:
            return [view.float() for view in (self.weights, *self.moments)]
        moments = [decode_moment(c, e, root=i == 1) for i, (c, e) in enumerate(zip(self.moments, self.exponents))]
        return [self.weights.float(), *moments]

    def set_moment(self, index: int, values: torch.Tensor) -> None:
        """Moment ``index`` from fp32 ``values`` (rounded to nearest: bf16, or 8-bit at the kernel's scales)."""
        if self.exponents is None:
            self.moments[index].copy_(values)
        else:
            encode_moment(values, self.moments[index], self.exponents[index], root=index == 1)


class Chunk:
    """One contiguous range of one parameter's elements (of its :class:`~nvoffload.optim._layout.Record`) and
    where its state lives: its generations in the store, or its resident home."""

    __slots__ = (
        "record", "index", "start", "numel", "gen", "pending_gen", "applied", "scalars", "pending_scalars", "grad_norm",
        "home",
    )  # fmt: skip

    def __init__(self, record, index: int, start: int, numel: int):
        self.record = record
        self.index = index
        self.start = start
        self.numel = numel
        self.gen: int | None = None  # committed generation in the store, None = no state yet
        self.pending_gen: int | None = None  # generation written this step, not yet committed
        self.applied = False  # the model parameter holds this step's (uncommitted) update
        self.scalars: dict = {}  # non-tensor state of a generic optimizer, committed
        self.pending_scalars: dict = {}
        self.grad_norm = 0.0  # L2 norm (fp32) of the step's gradient (released gradients: set by the worker)
        # Resident state (see ResidentState): two host buffers of the chunk's fp32 rows, generation g in
        # home[g % 2]; None: the state is in the store.
        self.home: tuple[torch.Tensor, torch.Tensor] | None = None

    def name(self, gen: int) -> str:
        return f"{self.record.prefix}p{self.record.index}.c{self.index}.g{gen}"

    def kept_name(self, which: int = 0) -> str:
        """Store entry of the step's gradient kept between micro-batches (released gradients); delayed updates
        alternate between two (``which`` 0 and 1): one step's is read while the next step's is written."""
        return f"{self.record.prefix}p{self.record.index}.c{self.index}.grad" + (".1" if which else "")

    @property
    def elements(self) -> slice:
        """This chunk's range of the parameter's flat elements."""
        return slice(self.start, self.start + self.numel)


class Slot:
    """One host buffer from the slab: a chunk's fp32 state rows, then staging for its gradient (up to fp32),
    optionally an fp32 row for the gradient kept in the store, and staging for its weights in a 16-bit
    dtype, each part 4 KiB-aligned (O_DIRECT reads and writes the rows)."""

    __slots__ = ("memory", "buffer", "_grad", "_kept", "_out")

    def __init__(self, memory: torch.Tensor, rows_numel: int, chunk_numel: int, *, kept_grad: bool):
        self.memory = memory  # the slab allocation (uint8)
        grad_at = rows_numel * 4
        kept_at = grad_at + chunk_numel * 4
        out_at = kept_at + (chunk_numel * 4 if kept_grad else 0)
        self.buffer = memory[:grad_at].view(torch.float32)
        self._grad = memory[grad_at:kept_at]
        self._kept = memory[kept_at:out_at].view(torch.float32)
        self._out = memory[out_at : out_at + chunk_numel * 2]

    def rows(self, nrows: int, numel: int) -> torch.Tensor:
        return self.buffer[: nrows * numel].view(nrows, numel)

    def grad(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Host staging for ``numel`` gradient elements of ``dtype`` (fp32 or 16-bit)."""
        return self._grad.view(dtype)[:numel]

    def kept_grad(self, numel: int) -> torch.Tensor:
        """The fp32 row for ``numel`` elements of a gradient kept in the store (layouts with ``kept_grads``)."""
        if self._kept.numel() < numel:
            raise RuntimeError("this optimizer keeps no gradients in its store (release_grads is off)")
        return self._kept[:numel]

    def out(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Host staging for ``numel`` weights of the 16-bit ``dtype``."""
        return self._out.view(dtype)[:numel]


class StateFormat:
    """How a chunk's state is laid out: fp32 rows per element, their typed views, its store entries and bytes.

    Args:
        adam: Adam/AdamW state (master, ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``); else a
            generic optimizer's, with :data:`MAX_GENERIC_ROWS` rows.
        param_groups: the optimizer's groups (the list itself: groups added later count).
        state_precision: one of :data:`~nvoffload.optim._layout.STATE_PRECISIONS` (compact forms are Adam's,
            without amsgrad).
    """

    def __init__(self, *, adam: bool, param_groups: list[dict], state_precision: str):
        self.adam = adam
        self.state_precision = state_precision
        self._groups = param_groups

    def rows(self, record=None) -> int:
        """fp32 rows of state per element, of ``record`` or (None) of the most any group needs."""
        if not self.adam:
            return MAX_GENERIC_ROWS
        if self.state_precision != "fp32":
            return 2  # the master (or the bf16 weights), both compact moments
        if record is None:
            amsgrad = any(g.get("amsgrad", False) for g in self._groups)
        else:
            amsgrad = record.group.get("amsgrad", False)
        return 4 if amsgrad else 3

    def masterless(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s state has no fp32 master: its own bf16 weights are updated (``"bf16"``, ``"8bit"``)."""
        return self.state_precision in MASTERLESS and param.dtype == torch.bfloat16

    def split(self, rec) -> bool:
        """fp32 parameters keep their master row in its own store entry: it equals the model's weights
        at the start of a step, so an update reads only the moments (8 of 12 bytes per element); so do the
        bf16 weights of a chunk without an fp32 master (see :meth:`masterless`)."""
        return rec.param.dtype == torch.float32 or self.masterless(rec.param)

    def needs_master(self, chunk: Chunk) -> bool:
        """Whether an update must read the master weights (the model's are not the committed ones)."""
        return not self.split(chunk.record) or chunk.applied

    def bytes_per_element(self, param: torch.Tensor, record=None) -> float:
        """Store bytes of one generation of one element's state of ``param`` (of ``record``'s group, or the
        most any group needs); with 8-bit moments their scales' share too."""
        if self.state_precision == "fp32" or not self.adam:
            return self.rows(record) * 4
        weights = 2 if self.masterless(param) else 4
        return weights + (2 + 2 / FP8_BLOCK if self.state_precision == "8bit" else 4)

    def chunk_state_bytes(self, chunk: Chunk) -> int:
        """Store bytes of one generation of ``chunk``'s state: what its entries hold (with 8-bit moments, a
        byte a block a moment for their scales, where :meth:`bytes_per_element` spreads them over the elements)."""
        n = chunk.numel
        if self.state_precision == "fp32" or not self.adam:
            return self.rows(chunk.record) * 4 * n
        return (2 if self.masterless(chunk.record.param) else 4) * n + self._moment_nbytes(n)

    def chunk_rows(self, chunk: Chunk, slot: Slot) -> torch.Tensor:
        """The ``(rows, numel)`` view of ``slot`` that holds ``chunk``'s state."""
        return slot.rows(self.rows(chunk.record), chunk.numel)

    def chunk_state(self, chunk: Chunk, rows: torch.Tensor) -> ChunkState:
        """The typed views of ``rows`` (``chunk``'s, from :meth:`chunk_rows`)."""
        n = chunk.numel
        if not self.adam or self.state_precision == "fp32":
            return ChunkState(rows, rows[0], tuple(rows[1:]))
        weights = rows[0].view(torch.bfloat16)[:n] if self.masterless(chunk.record.param) else rows[0]
        if self.state_precision == "8bit":
            codes = rows[1].view(torch.uint8)
            exponents = codes[2 * n : 2 * n + 2 * fp8_blocks(n)].view(torch.int8).view(2, -1)
            return ChunkState(rows, weights, (codes[:n], codes[n : 2 * n]), exponents)
        moments = rows[1].view(torch.bfloat16)
        return ChunkState(rows, weights, (moments[:n], moments[n:]))

    def views(self, chunk: Chunk, slot: Slot) -> ChunkState:
        """The typed views of ``chunk``'s state in ``slot``."""
        return self.chunk_state(chunk, self.chunk_rows(chunk, slot))

    def _moment_bytes(self, chunk: Chunk, rows: torch.Tensor) -> torch.Tensor:
        """The part of row 1 that holds ``chunk``'s moments (and with 8 bits their exponents), as bytes."""
        return rows[1].view(torch.uint8)[: self._moment_nbytes(chunk.numel)]

    def _moment_nbytes(self, numel: int) -> int:
        """Bytes of a compact state's two moments of ``numel`` elements (and with 8 bits their exponents)."""
        return 2 * numel + 2 * fp8_blocks(numel) if self.state_precision == "8bit" else 4 * numel

    def entries(self, chunk: Chunk, gen: int, rows: torch.Tensor, *, state: bool = True, master: bool = True):
        """``(store name, rows)`` of a generation; split chunks can leave out the state or the master."""
        if not self.split(chunk.record):
            return [(chunk.name(gen), rows)]
        entries = []
        if state:
            moments = rows[1:] if self.state_precision == "fp32" else self._moment_bytes(chunk, rows)
            entries.append((chunk.name(gen), moments))
        if master:
            entries.append((chunk.name(gen) + ".w", self.chunk_state(chunk, rows).weights))
        return entries

    @staticmethod
    def names(chunk: Chunk, gen: int) -> tuple[str, str]:
        """Every store name a generation may use (the ``.w`` entry only exists for split chunks)."""
        return chunk.name(gen), chunk.name(gen) + ".w"


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


class ChunkStore:
    """Every chunk's state generations in ``store`` (or a resident home), laid out as ``layout`` says, read into
    and written from slots; and the bytes moved (``read_bytes``, ``written_bytes``)."""

    def __init__(self, store, layout: StateFormat):
        self.store = store
        self.layout = layout
        self.read_bytes = 0
        self.written_bytes = 0
        self._count_lock = threading.Lock()

    def hold(self, chunk: Chunk, slot: Slot) -> InSlot:
        """``chunk``'s state in ``slot``, for one update (nothing read yet)."""
        return InSlot(self, chunk, slot)

    def reset_counts(self) -> None:
        with self._count_lock:
            self.read_bytes = self.written_bytes = 0

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
                self.layout.entries(chunk, gen, self.home_rows(chunk, gen), state=state, master=master),
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
            self.home_rows(chunk, gen).copy_(rows)
            return Future.completed()
        futures = []
        for name, part in self.layout.entries(chunk, gen, rows):
            futures.append(self.store.put(name, part))
            with self._count_lock:
                self.written_bytes += part.numel() * part.element_size()
        return Future.all_of(futures)

    def write_first(self, chunk: Chunk, rows: torch.Tensor, scalars: dict) -> None:
        """Write ``rows`` as generation 0, the committed state of a chunk that had none."""
        self.write(chunk, 0, rows).result()
        chunk.gen = 0
        chunk.scalars = scalars

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

    def home_rows(self, chunk: Chunk, gen: int) -> torch.Tensor:
        """The ``(rows, numel)`` rows of generation ``gen`` of the resident ``chunk``."""
        nrows = self.layout.rows(chunk.record)
        return chunk.home[gen % 2][: nrows * chunk.numel].view(nrows, chunk.numel)

    def delete(self, chunk: Chunk, gen: int) -> None:
        if chunk.home is not None:
            return  # nothing in the store: its buffer takes generation gen + 2
        for name in self.layout.names(chunk, gen):
            if name in self.store:
                self.store.delete(name)

    def discard(self, chunk: Chunk) -> None:
        """Delete every generation of ``chunk`` from the store and forget its state."""
        for gen in {chunk.gen, chunk.pending_gen} - {None}:
            self.delete(chunk, gen)
        for name in (chunk.kept_name(0), chunk.kept_name(1)):
            if name in self.store:
                self.store.delete(name)
        chunk.gen, chunk.pending_gen, chunk.applied, chunk.scalars = None, None, False, {}


class InSlot:
    """One chunk's state in ``slot`` for one update (or for one gradient kept): the committed generation read in
    (``future``, None until :meth:`read`), the update's views of it (:meth:`state`) and the next generation
    written out (:meth:`write`); the chunk's kept gradient read and written through the slot's row for it.

    The model's weights come in as a :class:`~nvoffload.optim._chunk_io.ModelWeights` (or the context manager
    giving one): the master of a chunk with no state yet, and of a split chunk whose committed master they are."""

    __slots__ = ("chunk", "slot", "future", "_chunks", "_master", "_nbytes")

    def __init__(self, chunks: ChunkStore, chunk: Chunk, slot: Slot):
        self._chunks, self.chunk, self.slot = chunks, chunk, slot
        self.future: Future | None = None  # the committed generation's read, once started
        self._master = True  # the read holds the master row, or the update takes it elsewhere
        self._nbytes = 0  # a read ahead's bytes, not counted yet

    def read(self, *, ahead: bool = False) -> Future:
        """Start reading the committed generation into the slot, its master row only where the update must read
        the store's (:meth:`StateFormat.needs_master`). A read ``ahead`` of its update counts its bytes once
        :meth:`count` is called, when the read is used or dropped (a read ahead of the next step counts in that
        step, whether it starts before or after ``reset_counts``)."""
        chunk, chunks = self.chunk, self._chunks
        self._master = chunks.layout.needs_master(chunk)
        self.future, self._nbytes = chunks.read_ahead(chunk, chunk.gen, self.slot, master=self._master)
        if not ahead:
            self.count()
        return self.future

    def count(self) -> None:
        """Count the bytes of the read ahead (used or dropped)."""
        self._chunks.count_read(self._nbytes)
        self._nbytes = 0

    def first(self, model_weights, *, after) -> None:
        """The chunk has no state yet: its master is the model's weights (``model_weights``, the context manager of
        a :class:`~nvoffload.optim._chunk_io.ModelWeights`, read once ``after`` completed), its state zero; written
        as generation 0, the committed one."""
        state = self._chunks.layout.views(self.chunk, self.slot)
        with model_weights as weights:
            weights.read(self.chunk.elements, state.weights, self.slot, after=after)
        state.rows[1:].zero_()
        self._chunks.write_first(self.chunk, state.rows, {})

    def state(self) -> ChunkState:
        """The views of the state read, once the read is done; the master row read now where the read (ahead) left
        it out and the update must read the store's after all (the model holds this step's update: it is redone)."""
        chunk = self.chunk
        if self.future is not None:
            self.future.result()
        if not self._master and chunk.applied:
            self._chunks.read(chunk, chunk.gen, self.slot, state=False).result()
        return self._chunks.layout.views(chunk, self.slot)

    def master_from(self, weights, state: ChunkState, *, after) -> None:
        """The master row from the model's ``weights`` (read once ``after`` completed) where they are the committed
        master (as in torch: a split chunk the model holds no update of), as they were when the update was queued."""
        if self._chunks.layout.split(self.chunk.record) and not self.chunk.applied:
            weights.read(self.chunk.elements, state.weights, self.slot, after=after)

    def applying(self, weights, state: ChunkState) -> torch.Tensor | None:
        """The update is about to run: from here on the model may hold this step's (uncommitted) update, unless it
        goes to a delayed update's staged copy. Where the update puts the new weights of a 16-bit parameter with an
        fp32 master (its host copy in ``weights``, in place, or staging in the slot); None: the weights row is in
        the parameter's dtype."""
        chunk = self.chunk
        out = None
        dtype = chunk.record.param.dtype
        if state.weights.dtype != dtype:
            out = weights.host_view(chunk.elements)
            out = self.slot.out(dtype, chunk.numel) if out is None else out
        chunk.applied = weights.staged is None
        return out

    def write(self) -> Future:
        """Start writing the slot's rows as the chunk's next generation, the step's (``Chunk.pending_gen``)."""
        chunk = self.chunk
        gen = (chunk.gen or 0) + 1
        future = self._chunks.write(chunk, gen, self._chunks.layout.chunk_rows(chunk, self.slot))
        chunk.pending_gen = gen
        return future

    def kept_grad(self) -> torch.Tensor:
        """The slot's fp32 row for the chunk's kept gradient."""
        return self.slot.kept_grad(self.chunk.numel)

    def read_kept(self, which: int) -> Future:
        """Start reading the chunk's kept gradient ``which`` into :meth:`kept_grad`."""
        return self._chunks.read_kept(self.chunk, self.kept_grad(), which)

    def write_kept(self, grad: torch.Tensor, which: int) -> Future:
        """Start writing the fp32 ``grad`` as the chunk's kept gradient ``which``."""
        return self._chunks.write_kept(self.chunk, grad, which)
