"""The I/O engine: async O_DIRECT reads and writes, aligned host buffers, the tensor store.

- :class:`IOEngine` -- submit a read or write of a buffer at a file offset, get a :class:`~nvoffload.transfer.Future`.
- :class:`TensorStore` -- named tensors in aligned extents of swap files, striped over directories;
  CUDA tensors move by GPUDirect Storage (kvikio) or through the store's fixed page-locked staging slab;
  :func:`swap_directories` checks the directories (and their free space) before anything is written.
- :func:`aligned_empty` -- 4 KiB-aligned host buffers for O_DIRECT (not page-locked).
- :class:`SwapDirectoryInUse` -- a swap directory another process holds (see :mod:`nvoffload.io.ownership`).
"""

from nvoffload.io.buffers import aligned_empty
from nvoffload.io.config import DirectIO, IOConfig
from nvoffload.io.engine import IOEngine, OpenFile
from nvoffload.io.errors import ChecksumError, StoreIOError
from nvoffload.io.ownership import SwapDirectoryInUse
from nvoffload.io.staging import DEFAULT_STAGING_BYTES
from nvoffload.io.store import TensorStore, swap_directories

__all__ = [
    "ChecksumError",
    "DEFAULT_STAGING_BYTES",
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
