"""The thin device layer: everything CUDA-specific in nvoffload goes through here.

Every engine also runs with the CPU standing in for the GPU. Without CUDA,
page-locking is skipped (``tensor.pin_memory()`` raises on a CPU-only torch),
and host-device copies are plain memcpy.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["cuda_available", "register_host_memory", "unregister_host_memory"]


@functools.cache
def cuda_available() -> bool:
    """True when torch was built with CUDA and a GPU is visible."""
    return torch.cuda.is_available()


def register_host_memory(tensor: torch.Tensor) -> bool:
    """Page-lock the host memory behind a contiguous CPU ``tensor`` in place.

    Registered memory lets device copies run asynchronously. Returns True when
    the memory was registered, False without CUDA (nothing to do). Pair every
    successful call with :func:`unregister_host_memory` before the memory is freed.
    """
    if not cuda_available():
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("register_host_memory needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
    return True


def unregister_host_memory(tensor: torch.Tensor) -> None:
    """Undo :func:`register_host_memory` for ``tensor``."""
    err = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {int(err)}")
