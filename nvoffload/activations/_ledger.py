"""Exact accounting of the memory that saved tensors keep alive."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef


def is_parameter_like(tensor: torch.Tensor) -> bool:
    """True for parameters, leaves that require grad, and views of either.

    Those live as long as the model (or the user's variable) anyway, so moving
    them would cost I/O and free nothing.
    """
    if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    if tensor._is_view():
        base = tensor._base
        return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
    return False


class ModuleBuffers:
    """The storages of module buffers, noted while the context is active.

    Saved tensors that are buffers (running statistics, masks, position tables)
    live as long as their module: moving them would cost I/O and free nothing.
    While active, a global forward pre-hook notes the buffers of every module
    that runs (all of its submodules' too, the first time it runs), so that
    :meth:`holds` recognises them. Contexts nest; the hook is removed and the
    notes are cleared when the outermost one exits.
    """

    def __init__(self) -> None:
        self._storages: set[StorageWeakRef] = set()
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._hook = None
        self._depth = 0

    def __enter__(self) -> ModuleBuffers:
        if self._depth == 0:
            self._hook = nn.modules.module.register_module_forward_pre_hook(self._note)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._hook.remove()
            self._hook = None
            self._storages.clear()
            self._seen = weakref.WeakSet()

    def _note(self, module: nn.Module, args) -> None:
        modules = [module] if module in self._seen else module.modules()
        for m in modules:  # a module's own buffers every call: one may be reassigned between calls
            self._seen.add(m)
            for buffer in m._buffers.values():
                if buffer is not None:
                    self._storages.add(StorageWeakRef(buffer.untyped_storage()))

    def holds(self, tensor: torch.Tensor) -> bool:
        """True for parameters, leaves that require grad (and views of them) and noted buffers."""
        return is_parameter_like(tensor) or StorageWeakRef(tensor.untyped_storage()) in self._storages


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` share one storage."""
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


class StorageLedger:
    """Bytes of distinct storages currently referenced, with a peak.

    Each :meth:`add` returns a key (a weak reference to the storage, which also
    keeps its identity from being reused) to hand back to :meth:`remove`.
    """

    def __init__(self) -> None:
        self._counts: dict[StorageWeakRef, list[int]] = {}
        self.bytes = 0
        self.peak_bytes = 0

    def add(self, tensor: torch.Tensor) -> StorageWeakRef:
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        entry = self._counts.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            self._counts[key] = [1, nbytes]
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        else:
            entry[0] += 1
        return key

    def remove(self, key: StorageWeakRef) -> None:
        entry = self._counts[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._counts[key]
            self.bytes -= entry[1]

    def reset_peak(self) -> None:
        self.peak_bytes = self.bytes
