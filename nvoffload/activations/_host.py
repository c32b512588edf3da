"""The ``target="cpu"`` tier: offloaded tensors kept in host memory."""

from __future__ import annotations

import torch


class Completed:
    """A future that is already done (host-memory operations finish at once)."""

    __slots__ = ("_value",)

    def __init__(self, value=None):
        self._value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None):
        return self._value


class HostTier:
    """Named host buffers, with the put/get/delete surface of a TensorStore.

    ``put`` takes ownership of a host tensor that the caller already copied the
    data into (page-locked when CUDA is present), so nothing is copied twice.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.used_bytes = 0

    def put(self, name: str, tensor: torch.Tensor) -> Completed:
        if name in self._buffers:
            raise ValueError(f"host tier already holds a tensor named {name!r}")
        self._buffers[name] = tensor
        self.used_bytes += tensor.numel() * tensor.element_size()
        return Completed()

    def get(self, name: str, out: torch.Tensor | None = None) -> Completed:
        buffer = self._buffers[name]
        if out is None:
            return Completed(buffer)
        return Completed(out.copy_(buffer))

    def delete(self, name: str) -> None:
        buffer = self._buffers.pop(name)
        self.used_bytes -= buffer.numel() * buffer.element_size()

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def close(self) -> None:
        self._buffers.clear()
        self.used_bytes = 0
