"""Aligned host buffers for O_DIRECT, and the byte views the I/O paths move."""

from __future__ import annotations

import torch

ALIGNMENT_BYTES = 4096
"""O_DIRECT's alignment of buffer addresses, sizes and file offsets (the logical block size; 4 KiB covers every
NVMe drive and ext4/xfs)."""

__all__ = ["ALIGNMENT_BYTES", "aligned_empty", "byte_view", "is_aligned", "round_up"]


def round_up(nbytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return -(-nbytes // alignment) * alignment


def is_aligned(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` can be the buffer of an O_DIRECT transfer as it is."""
    nbytes = tensor.numel() * tensor.element_size()
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.data_ptr() % ALIGNMENT_BYTES == 0
        and nbytes % ALIGNMENT_BYTES == 0
    )


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``nbytes`` whose address is 4 KiB-aligned.

    View it as another dtype with ``.view(dtype)``. It is not page-locked: device
    copies stage through a :class:`~nvoffload.transfer.HostSlab` instead.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = torch.empty(nbytes + ALIGNMENT_BYTES, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT_BYTES
    return raw[start : start + nbytes]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (CPU or CUDA) as a flat ``uint8`` tensor (bfloat16 included)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)
