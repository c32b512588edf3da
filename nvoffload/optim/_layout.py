"""How the NVMe optimizer cuts its state into chunks and sizes it: records, chunk sizes, slot and store bytes.

Each parameter has one :class:`Record`; its elements are cut into
:class:`~nvoffload.optim._chunk_state.Chunk` ranges of at most ``Layout.chunk_numel`` elements, each as large as
the host memory's slots allow. What one chunk's state is (its fp32 rows, their typed views, its store entries and
generations, its read and write) is :mod:`nvoffload.optim._chunk_state`'s: a :class:`Layout` is that
:class:`~nvoffload.optim._chunk_state.StateFormat` with the plan over every parameter added.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from nvoffload.optim._chunk_state import Chunk, Slot, StateFormat

_MIB = 1 << 20
ALIGN_NUMEL = 1024  # chunk boundaries on 4 KiB of fp32, for O_DIRECT
LOW_PRECISION = (torch.bfloat16, torch.float16)
_MAX_CHUNK_NUMEL = 16 * _MIB // 4  # fp32 elements: 16 MiB of master weights
# How Adam's state is kept: "fp32" is exact AdamW; "bf16-moments" keeps an fp32 master and bf16 moments;
# "bf16" also drops the fp32 master of bf16 parameters (their bf16 weights are updated by stochastic rounding);
# "8bit" is "bf16" with both moments in 8 bits (see nvoffload.optim.kernels).
STATE_PRECISIONS = ("fp32", "bf16-moments", "bf16", "8bit")


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


def _all_elements(index: int, numel: int) -> tuple[int, int]:
    return 0, numel


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


class Layout(StateFormat):
    """The chunking of every parameter's state (in the :class:`~nvoffload.optim._chunk_state.StateFormat` of
    ``adam`` and ``state_precision``): elements per chunk, the slots' bytes, the store's bytes.

    Args:
        adam: Adam/AdamW state; else a generic optimizer's (see :class:`~nvoffload.optim._chunk_state.StateFormat`).
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
        super().__init__(adam=adam, param_groups=param_groups, state_precision=state_precision)
        self.owned = owned if owned is not None else _all_elements
        self.kept_grads = kept_grads
        self.elementwise = elementwise
        self.prefix = prefix
        self.slot_rows = self.rows()  # rows in each slot, fixed when the slots are made
        self.chunk_numel = 0  # set by plan()

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
        does not keep (:class:`~nvoffload.optim._chunk_state.ResidentState`: two generations of ``slot_rows`` fp32
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
