"""The I/O engine: async O_DIRECT reads and writes, aligned host buffers, the tensor store.

- :class:`IOEngine` -- submit a read or write of a buffer at a file offset, get a :class:`~nvoffload.transfer.Future`.
- :class:`TensorStore` -- named host tensors in aligned extents of swap files, striped over directories
  (device tensors move with :class:`nvoffload.transfer.TransferEngine`: through its slab, or by GPUDirect
  Storage); :func:`swap_directories` checks the directories (and their free space) before anything is written.
- :func:`aligned_empty` -- 4 KiB-aligned host buffers for O_DIRECT (not page-locked).
- :class:`SwapDirectoryInUse` -- a swap directory another process holds (see :mod:`nvoffload.io.ownership`).
"""

from nvoffload.core.buffers import aligned_empty
from nvoffload.io.config import DirectIO, IOConfig
from nvoffload.io.engine import IOEngine, OpenFile
from nvoffload.io.errors import ChecksumError, StoreIOError
from nvoffload.io.ownership import SwapDirectoryInUse
from nvoffload.io.store import TensorStore, swap_directories

__all__ = [
    "ChecksumError",
    "DirectIO",
    "IOConfig",
    "IOEngine",
    "OpenFile",
    "StoreIOError",
    "SwapDirectoryInUse",
    "TensorStore",
    "aligned_empty",
    "swap_directories",
]
