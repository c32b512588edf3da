"""Exact accounting of the memory that saved tensors keep alive."""

from __future__ import annotations

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
