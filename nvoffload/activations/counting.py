"""Saved-tensor hooks that only count: the yardstick for the baselines."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from ._ledger import ModuleBuffers, StorageLedger, same_storage

__all__ = ["SavedTensorCounter"]


class _Counted:
    __slots__ = ("packed", "__weakref__")

    def __init__(self, packed):
        self.packed = packed


def _tensors_in(packed) -> list[torch.Tensor]:
    if isinstance(packed, torch.Tensor):
        return [packed]
    if isinstance(packed, (tuple, list)):
        return [t for item in packed for t in _tensors_in(item)]
    return []


class SavedTensorCounter(saved_tensors_hooks):
    """Counts the memory held by saved tensors, alone or around other hooks.

    Alone, tensors are saved as usual (detached aliases) and counted. Around
    ``inner`` hooks (``torch.autograd.graph.save_on_cpu()``, for instance), the
    inner pack runs and what it returns is inspected: tensors sharing the
    original's storage count as ``resident`` (the original stays in memory),
    other tensors (copies) count as ``offloaded``. Parameters, leaves that
    require grad and module buffers are not counted. A storage counts once however many saved
    tensors refer to it; it stops counting when autograd drops the saved tensor.

    Example::

        >>> import torch
        >>> from nvoffload.activations import SavedTensorCounter
        >>> x = torch.randn(256, 256, requires_grad=True)
        >>> with SavedTensorCounter() as counter:
        ...     y = x.sin().sin()
        >>> counter.resident_bytes  # x.sin() (x is a leaf requiring grad: not counted)
        262144
        >>> y.sum().backward()
        >>> counter.resident_bytes, counter.peak_resident_bytes
        (0, 262144)
    """

    def __init__(self, inner: saved_tensors_hooks | None = None) -> None:
        self._resident = StorageLedger()
        self._offloaded = StorageLedger()
        self._lock = threading.Lock()
        self._buffers = ModuleBuffers()
        buffers = self._buffers
        inner_pack = inner.pack_hook if inner is not None else (lambda t: t.detach())
        inner_unpack = inner.unpack_hook if inner is not None else (lambda p: p)

        def pack(tensor: torch.Tensor) -> _Counted:
            packed = inner_pack(tensor)
            handle = _Counted(packed)
            if not buffers.holds(tensor):
                with self._lock:
                    keys = [
                        (ledger, ledger.add(t))
                        for t in _tensors_in(packed)
                        for ledger in [self._resident if same_storage(t, tensor) else self._offloaded]
                    ]
                finalizer = weakref.finalize(handle, self._forget, keys)
                finalizer.atexit = False
            return handle

        def unpack(handle: _Counted) -> torch.Tensor:
            return inner_unpack(handle.packed)

        super().__init__(pack, unpack)

    def __enter__(self) -> SavedTensorCounter:
        self._buffers.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._buffers.__exit__(*exc)

    def _forget(self, keys) -> None:
        with self._lock:
            for ledger, key in keys:
                ledger.remove(key)

    @property
    def resident_bytes(self) -> int:
        """Bytes of distinct storages that saved tensors keep in place now."""
        return self._resident.bytes

    @property
    def peak_resident_bytes(self) -> int:
        """Highest :attr:`resident_bytes` since creation or :meth:`reset_peak`."""
        return self._resident.peak_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of copies made by the inner hooks, held now."""
        return self._offloaded.bytes

    @property
    def peak_offloaded_bytes(self) -> int:
        """Highest :attr:`offloaded_bytes` since creation or :meth:`reset_peak`."""
        return self._offloaded.peak_bytes

    def reset_peak(self) -> None:
        """Restart the peaks from the current values."""
        with self._lock:
            self._resident.reset_peak()
            self._offloaded.reset_peak()
