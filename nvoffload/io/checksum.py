"""CRC-32C of tensors' bytes, on the native core: SSE4.2's crc32 instruction on three interleaved streams
(about 4x ``zlib.crc32`` here, see ``bench/results/bench_io.md``), or a slicing-by-8 table where the CPU lacks it.

>>> import torch
>>> from nvoffload.io.checksum import crc32c
>>> hex(crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)))
'0xe3069283'
"""

from __future__ import annotations

import torch

from nvoffload.core.native import native_module

__all__ = ["crc32c", "crc32c_combine"]

_aio = native_module("nvoffload.io._aio")


def crc32c(data: torch.Tensor, crc: int = 0) -> int:
    """CRC-32C of the bytes of the contiguous CPU tensor ``data``, continuing from ``crc`` (0 to start):
    ``crc32c(b, crc32c(a))`` is the CRC of ``a``'s bytes followed by ``b``'s. Releases the GIL."""
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError(f"crc32c needs a contiguous CPU tensor, got one on {data.device} (contiguous: {data.is_contiguous()})")
    return _aio.crc32c(data.data_ptr(), data.numel() * data.element_size(), crc)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of bytes ``a`` followed by bytes ``b``, from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``:
    a tensor's CRC joined from those its parts' I/O threads computed, without reading its bytes again."""
    return _aio.crc32c_combine(crc_a, crc_b, len_b)
