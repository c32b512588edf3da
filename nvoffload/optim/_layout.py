"""How the NVMe optimizer cuts its state into chunks: records, chunks, store entry names, chunk sizes.

Each parameter has one :class:`Record`; its elements are cut into
:class:`Chunk` ranges of at most ``Layout.chunk_numel`` elements. A chunk's
state is a block of fp32 *rows* of ``numel`` elements each: row 0 is the
master weights, the others the optimizer's per-element state (Adam's moments).
Compact Adam state (see :data:`STATE_PRECISIONS`) keeps both moments as bf16 in
row 1 (``exp_avg`` in its first half of bytes, ``exp_avg_sq`` in its second),
or as 8-bit codes (``exp_avg``'s, ``exp_avg_sq``'s, then the int8 exponents of
their blocks' scales: the first half of row 1 and a little more), and without
an fp32 master the bf16 weights in the first half of row 0; :class:`ChunkState`
gives the typed views, and the store holds only the bytes used.
Every update writes a new *generation* of a chunk (at most two coexist: the
committed one and the step's); its store entries are named
``opt<N>.p<param>.c<chunk>.g<generation>`` (plus ``.w`` for the master row of
fp32 parameters, which is kept apart, see :meth:`Layout.split`). With
gradients released during backward, a chunk's fp32 gradient summed over the
step's micro-batches is kept as ``opt<N>.p<param>.c<chunk>.grad`` (see
:mod:`nvoffload.optim._released`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from nvoffload.optim.kernels import FP8_BLOCK, decode_moment, encode_moment, fp8_blocks

_MIB = 1 << 20
ALIGN_NUMEL = 1024  # chunk boundaries on 4 KiB of fp32, for O_DIRECT
LOW_PRECISION = (torch.bfloat16, torch.float16)
MAX_GENERIC_ROWS = 5  # master + up to four param-shaped state tensors of a generic optimizer
_MAX_CHUNK_NUMEL = 16 * _MIB // 4  # fp32 elements: 16 MiB of master weights
# How Adam's state is kept: "fp32" is exact AdamW; "bf16-moments" keeps an fp32 master and bf16 moments;
# "bf16" also drops the fp32 master of bf16 parameters (their bf16 weights are updated by stochastic rounding);
# "8bit" is "bf16" with both moments in 8 bits (see nvoffload.optim.kernels).
STATE_PRECISIONS = ("fp32", "bf16-moments", "bf16", "8bit")
MASTERLESS = ("bf16", "8bit")  # the precisions that update bf16 weights without an fp32 master


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
    """One contiguous range of one parameter's elements and its state generations in the store."""

    __slots__ = (
        "record", "index", "start", "numel", "gen", "pending_gen", "applied", "scalars", "pending_scalars", "grad_norm",
        "home",
    )  # fmt: skip

    def __init__(self, record: Record, index: int, start: int, numel: int):
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
        # Resident state (see nvoffload.optim._chunk_io.ResidentState): two host buffers of the chunk's fp32 rows,
        # generation g in home[g % 2]; None: the state is in the store.
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


class Record:
    """Everything the optimizer keeps about one parameter (one record per parameter, no id() keys)."""

    __slots__ = ("prefix", "index", "param", "group", "chunks", "step", "fires", "learned_fires", "spec", "hooks")

    def __init__(self, prefix: str, index: int, param: torch.Tensor, group: dict):
        self.prefix = prefix
        self.index = index
        self.param = param
        self.group = group
        self.chunks: list[Chunk] = []
        self.step = 0  # committed update count, torch's state["step"]
        self.fires = 0  # post-accumulate-grad hook calls since the last step()
        self.learned_fires = 0  # hook calls before the previous step() (0 = not learned; 1 with release_grads)
        # What the hook saw on the learned fire (see nvoffload.optim._generations.Spec), None = nothing yet.
        self.spec = None
        self.hooks: tuple = ()  # the handles of its gradient hooks (post-accumulate-grad; delayed updates: pre-accumulate too)

    @property
    def name(self) -> str:
        return f"parameter {self.index} (shape {tuple(self.param.shape)}, {self.param.dtype})"


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


def _all_elements(index: int, numel: int) -> tuple[int, int]:
    return 0, numel


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


class Layout:
    """The chunking of every parameter's state: rows per element, elements per chunk, store entries.

    Args:
        adam: Adam/AdamW state (master, ``exp_avg``, ``exp_avg_sq`` and with
            amsgrad ``max_exp_avg_sq``); else a generic optimizer's, with
            :data:`MAX_GENERIC_ROWS` rows.
        elementwise: the update is elementwise, so a parameter may span several
            chunks; else each parameter is one chunk.
        param_groups: the optimizer's groups (the list itself: groups added later count).
        prefix: the store entry names' prefix, unique per optimizer.
        kept_grads: gradients are kept in the store between micro-batches and for a
            redone update (one more fp32 row per slot, and per element in the store).
        owned: ``owned(index, numel)`` gives the elements ``(lo, hi)`` of parameter ``index`` whose state this
            optimizer keeps (its rank's share, see :mod:`nvoffload.distributed`); default: all.
        state_precision: one of :data:`STATE_PRECISIONS` (validated by the optimizer's configuration; compact
            forms are Adam's, without amsgrad).
    """

    def __init__(self, *, adam: bool, elementwise: bool, param_groups: list[dict], prefix: str, kept_grads: bool,
                 owned: Callable[[int, int], tuple[int, int]] | None = None, state_precision: str = "fp32"):  # fmt: skip
        self.adam = adam
        self.state_precision = state_precision
        self.owned = owned if owned is not None else _all_elements
        self.kept_grads = kept_grads
        self.elementwise = elementwise
        self._groups = param_groups
        self.prefix = prefix
        self.slot_rows = self.rows()  # rows in each slot, fixed when the slots are made
        self.chunk_numel = 0  # set by plan()

    def rows(self, record: Record | None = None) -> int:
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

    @property
    def slot_bytes_per_elem(self) -> int:
        # state rows, gradient staging, (the kept gradient,) 16-bit weight staging
        return self.slot_rows * 4 + 4 + (4 if self.kept_grads else 0) + 2

    def _slot_bytes(self, numel: int) -> int:
        return -(-numel * self.slot_bytes_per_elem // 4096) * 4096  # as the slab counts it

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one slot (what the slab counts)."""
        return self._slot_bytes(self.chunk_numel)

    def plan(self, *, chunk_bytes: int | None, cpu_memory_bytes: int, num_slots: int) -> int:
        """Set and return the elements per chunk, from ``chunk_bytes`` (fp32 master bytes) or from
        ``num_slots`` slots fitting ``cpu_memory_bytes``; raises ValueError when the budget is too small."""
        largest = max((p.numel() for g in self._groups for p in g["params"]), default=1)
        per_elem = self.slot_bytes_per_elem
        if not self.elementwise:
            numel = _aligned(largest)  # whole parameters: the update is not elementwise
        elif chunk_bytes is not None:
            numel = chunk_bytes // 4
        else:
            numel = min((cpu_memory_bytes // num_slots - 4096) // per_elem, _MAX_CHUNK_NUMEL, _aligned(largest))
            numel -= numel % ALIGN_NUMEL
        needed_bytes = num_slots * self._slot_bytes(max(numel, ALIGN_NUMEL))
        if numel < ALIGN_NUMEL or needed_bytes > cpu_memory_bytes:
            what = "the chunks" if self.elementwise else "the largest parameter"
            raise ValueError(
                f"cpu_memory_bytes={cpu_memory_bytes} is too small: {num_slots} buffers for {what} need"
                f" {needed_bytes} bytes ({max(numel, ALIGN_NUMEL)} elements x {per_elem} bytes each)"
            )
        self.chunk_numel = numel
        return numel

    def state_bytes(self) -> int:
        """Store bytes of one generation of the state of every trained parameter's owned elements (frozen ones,
        a LoRA model's base weights, have none)."""
        return sum(math.ceil(_aligned(n) * self.bytes_per_element(p)) for p, n in self._owned())

    def store_state_bytes(self, resident_state_bytes: int = 0) -> int:
        """At most the store bytes of one generation of the state that ``resident_state_bytes`` of host memory
        does not keep (:class:`~nvoffload.optim._chunk_io.ResidentState`: two generations of ``slot_rows`` fp32
        rows an element, given to whole chunks first come first served, so one largest chunk's room may stay
        unused; each element left resident counted at the fewest store bytes any takes)."""
        owned = self._owned()
        state = self.state_bytes()
        if not resident_state_bytes or not owned:
            return state
        largest_chunk = min(_MAX_CHUNK_NUMEL, max(_aligned(n) for _, n in owned))
        resident = max(0, resident_state_bytes // (2 * self.slot_rows * 4) - largest_chunk)
        resident = min(resident, sum(_aligned(n) for _, n in owned))
        return max(0, state - math.floor(resident * min(self.bytes_per_element(p) for p, _ in owned)))

    def bytes_per_element(self, param: torch.Tensor, record: Record | None = None) -> float:
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

    def masterless(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s state has no fp32 master: its own bf16 weights are updated (``"bf16"``, ``"8bit"``)."""
        return self.state_precision in MASTERLESS and param.dtype == torch.bfloat16

    def kept_grad_bytes(self) -> int:
        """Store bytes of the kept gradients (0 without ``kept_grads``)."""
        return sum(_aligned(n) * 4 for _, n in self._owned()) if self.kept_grads else 0

    def _owned(self) -> list[tuple[torch.Tensor, int]]:
        """Each parameter that requires grad (a frozen one gets no state) and the elements of it owned here."""
        params = [p for g in self._groups for p in g["params"]]
        return [(p, hi - lo) for i, p in enumerate(params) if p.requires_grad for lo, hi in [self.owned(i, p.numel())]]

    def new_slot(self, slab) -> Slot:
        """A slot allocated from ``slab`` (a :class:`~nvoffload.transfer.HostSlab`)."""
        memory = slab.allocate(self.slot_bytes, "an optimizer slot")
        return Slot(memory, self.slot_rows * self.chunk_numel, self.chunk_numel, kept_grad=self.kept_grads)

    def new_record(self, index: int, param: torch.Tensor, group: dict) -> Record:
        rec = Record(self.prefix, index, param, group)
        lo, hi = self.owned(index, param.numel())
        step = self.chunk_numel
        rec.chunks = [Chunk(rec, i, s, min(step, hi - s)) for i, s in enumerate(range(lo, hi, step))]
        return rec

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

    def _moment_bytes(self, chunk: Chunk, rows: torch.Tensor) -> torch.Tensor:
        """The part of row 1 that holds ``chunk``'s moments (and with 8 bits their exponents), as bytes."""
        return rows[1].view(torch.uint8)[: self._moment_nbytes(chunk.numel)]

    def _moment_nbytes(self, numel: int) -> int:
        """Bytes of a compact state's two moments of ``numel`` elements (and with 8 bits their exponents)."""
        return 2 * numel + 2 * fp8_blocks(numel) if self.state_precision == "8bit" else 4 * numel

    def split(self, rec: Record) -> bool:
        """fp32 parameters keep their master row in its own store entry: it equals the model's weights
        at the start of a step, so an update reads only the moments (8 of 12 bytes per element); so do the
        bf16 weights of a chunk without an fp32 master (see :meth:`masterless`)."""
        return rec.param.dtype == torch.float32 or self.masterless(rec.param)

    def needs_master(self, chunk: Chunk) -> bool:
        """Whether an update must read the master weights (the model's are not the committed ones)."""
        return not self.split(chunk.record) or chunk.applied

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
