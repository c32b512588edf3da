"""The I/O engine: async O_DIRECT reads and writes, aligned host buffers, the tensor store.

- :class:`IOEngine` -- submit a read or write of a buffer at a file offset, get a :class:`~nvoffload.transfer.Future`.
- :class:`TensorStore` -- named tensors in aligned extents of swap files, striped over directories;
  :func:`swap_directories` checks the directories (and their free space) before anything is written.
- :func:`aligned_empty`, :class:`BufferPool` -- 4 KiB-aligned host buffers (page-locked with CUDA).
"""

from nvoffload.io.buffers import BufferPool, aligned_empty
from nvoffload.io.config import DirectIO, IOConfig
from nvoffload.io.engine import IOEngine, OpenFile
from nvoffload.io.errors import ChecksumError, StoreIOError
from nvoffload.io.store import TensorStore, swap_directories

__all__ = [
    "BufferPool",
    "ChecksumError",
    "DirectIO",
    "IOConfig",
    "IOEngine",
    "OpenFile",
    "StoreIOError",
    "TensorStore",
    "aligned_empty",
    "swap_directories",
]
