"""How a model splits into streamed blocks, and where each parameter sits in its block's bytes."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from nvoffload.core.buffers import ALIGNMENT_BYTES

__all__ = ["Block", "find_blocks", "partition", "resident_bytes", "state_tensors"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's layers: the entries of its largest ``nn.ModuleList`` with parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(True for _ in m.parameters())]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of layers to stream; pass blocks= explicitly"
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What ``module.state_dict()`` holds, without reading it: parameters (every name of a
    tied one) and persistent buffers, by state-dict key."""
    tensors = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for key, p in m._parameters.items():
            if p is not None:
                tensors[dot + key] = p
        for key, b in m._buffers.items():
            if b is not None and key not in m._non_persistent_buffers_set:
                tensors[dot + key] = b
    return tensors


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_ALIGN_BYTES = 64  # each parameter's offset in its block's bytes: views of every dtype start on a cache line


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


class Block:
    """One streamed block's layout: its parameters' bytes one after another, each at a 64-byte-aligned offset, in one
    flat ``uint8`` tensor; each parameter is a view of its range with its own dtype (a block may mix dtypes, e.g.
    an fp32 norm in a bf16 layer).

    A block of frozen and trainable parameters (a LoRA layer: its base weights and
    its adapters) lays out the frozen ones first and the trainable ones after, from
    a 4 KiB-aligned offset: two *parts*, each its own store entry, so an update of
    the trainable ones writes back their part only (``parts``: store name, start
    and end byte of each).

    ``params`` may be replaced (a parameter built on the meta device gets a new
    object) until the streamer is set up; the layout does not change.

    A delayed update writes a block's new weights to its :meth:`twin`, which
    holds them (in the host cache, and its trained parts in store entries of
    their own) until they land and its ``parts`` become the block's.
    """

    def __init__(self, index: int, pos: int, module: nn.Module, params: list[tuple[str, nn.Parameter]]):
        self.index = index  # in the list of modules given to the streamer
        self.pos = pos  # among the streamed blocks (forward order)
        self.module = module
        self.name = f"stream.block{index}"  # in the tensor store
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.dtypes = [p.dtype for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.param_bytes = [shape.numel() * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes)]
        self.offsets, self._part = [0] * len(self.params), [0] * len(self.params)
        groups = [[j for j, p in enumerate(self.params) if p.requires_grad == trains] for trains in (False, True)]
        self.parts: list[tuple[str, int, int]] = []
        total = 0
        for group in filter(None, groups):
            start = total = _aligned(total, ALIGNMENT_BYTES)
            for j in group:
                total = _aligned(total, _ALIGN_BYTES)
                self.offsets[j], self._part[j] = total, len(self.parts)
                total += self.param_bytes[j]
            self.parts.append((self.name if not self.parts else f"{self.name}.trainable", start, total))
        self.nbytes = total
        self.twin_of: Block | None = None  # a twin's block

    @property
    def trainable(self) -> list[nn.Parameter]:
        """The parameters that require grad now (``requires_grad`` read past the off-device guard: it is no read of
        the weights, and this runs in every block's hooks)."""
        with torch._C.DisableTorchFunctionSubclass():
            return [p for p in self.params if p.requires_grad]

    @property
    def grad_bytes(self) -> int:
        """Device bytes of the gradients a backward pass makes."""
        with torch._C.DisableTorchFunctionSubclass():
            return sum([nbytes for p, nbytes in zip(self.params, self.param_bytes) if p.requires_grad])

    def twin(self) -> Block:
        """A block of the same layout for this block's next weights (a delayed update's): its parts that hold a
        parameter which requires grad are other store entries (the name with ``.next`` added, or taken off when
        the block's has it), the others the block's own."""
        with torch._C.DisableTorchFunctionSubclass():  # requires_grad is no read of the weights
            trained = {self._part[j] for j, p in enumerate(self.params) if p.requires_grad}
        twin = copy.copy(self)
        twin.parts = [(_other_entry(name) if k in trained else name, start, end) for k, (name, start, end) in enumerate(self.parts)]
        twin.twin_of = self
        return twin

    def part_of(self, j: int) -> int:
        """The index in ``parts`` of the part that holds parameter ``j``."""
        return self._part[j]

    def pack(self, flat: torch.Tensor) -> None:
        """Copy the parameters' weights into the block's bytes ``flat`` (a flat ``uint8`` tensor), each to its range."""
        with torch.no_grad():
            for view, p in zip(self.views(flat), self.params):
                view.copy_(p)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's :meth:`view` of ``flat``, in order."""
        return [self.view(flat, j) for j in range(len(self.params))]

    def view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter ``j``'s range of the block's bytes ``flat`` (a flat ``uint8`` tensor), with its dtype and shape."""
        return flat[self.offsets[j] : self.offsets[j] + self.param_bytes[j]].view(self.dtypes[j]).view(self.shapes[j])

    def __repr__(self) -> str:
        return f"parameter block {self.index}" + (" (the new weights of its delayed update)" if self.twin_of is not None else "")


def _other_entry(name: str) -> str:
    """The store entry a block's twin keeps a part in, given the block's."""
    return name.removesuffix(".next") if name.endswith(".next") else name + ".next"


def partition(model: nn.Module, modules: Iterable[nn.Module]) -> tuple[list[Block], list[tuple[str, nn.Parameter]]]:
    """The streamed blocks (modules without parameters left out) and the resident parameters (all others), named.

    Raises ValueError for a parameter in two blocks: each block's parameters
    must be its own (keep a shared one outside the blocks).
    """
    names = {p: n for n, p in model.named_parameters()}
    blocks: list[Block] = []
    owner: dict[nn.Parameter, int] = {}
    for i, module in enumerate(modules):
        params = []
        for p in module.parameters():
            if p in owner:
                raise ValueError(
                    f"parameter {names[p]} is in streamed blocks {owner[p]} and {i}: a block's parameters must be "
                    "its own (keep shared parameters outside the blocks)"
                )
            owner[p] = i
            params.append((names[p], p))
        if params:
            blocks.append(Block(i, len(blocks), module, params))
    resident = [(n, p) for n, p in model.named_parameters() if p not in owner]
    return blocks, resident


def resident_bytes(resident: list[tuple[str, nn.Parameter]], *, grads: bool = False) -> int:
    """Bytes of the resident parameters (``grads``: of their gradients)."""
    return _nbytes(p for _, p in resident if p.requires_grad or not grads)
