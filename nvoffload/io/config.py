"""Settings of the I/O engine, as a frozen dataclass validated at construction."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from nvoffload.core.buffers import ALIGNMENT_BYTES

__all__ = ["ALIGNMENT_BYTES", "DirectIO", "IOConfig", "default_swap_root"]


def default_swap_root() -> str:
    """``$XDG_CACHE_HOME/nvoffload``, or ``~/.cache/nvoffload``: where swap
    directories and machine profiles go by default."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "nvoffload")


class DirectIO(enum.Enum):
    """Whether files are opened with O_DIRECT (bypassing the page cache).

    ``ON`` raises where the file system refuses O_DIRECT; ``AUTO`` falls back to
    buffered I/O there with one warning; ``OFF`` always uses buffered I/O.
    """

    ON = "on"
    OFF = "off"
    AUTO = "auto"


@dataclass(frozen=True)
class IOConfig:
    """How the native engine runs I/O.

    Defaults were measured with ``bench/bench_io.py`` (64 MiB tensors, all in
    flight, ext4 on a virtio disk): 1 MiB blocks on 16 threads gave the best
    medians (write 2.7, read 3.8 GB/s, vs 2.5/3.5 on 8 threads and 2.5/2.8 on 4;
    512 KiB, 2 MiB and 4 MiB blocks were no better). Threads mostly sleep in
    the kernel, so 16 of them cost little CPU; 1 MiB blocks keep 16 requests in
    flight without splitting them so finely that syscalls dominate.
    """

    num_threads: int = 16
    """Worker threads doing pread/pwrite."""
    block_size_bytes: int = 1 << 20
    """Large requests are split into blocks of this size that run in parallel."""
    queue_depth: int = 128
    """Blocks queued before a submit blocks (back-pressure)."""
    direct_io: DirectIO = DirectIO.AUTO
    stripe_min_bytes: int = 4 << 20
    """Tensors smaller than this stay in one swap file instead of being striped."""
    use_gds: bool = True
    """Use GPUDirect Storage (kvikio) for CUDA tensors when it is installed."""

    def __post_init__(self):
        if not isinstance(self.direct_io, DirectIO):
            raise ValueError(f"direct_io must be a DirectIO, got {self.direct_io!r}")
        for name in ("num_threads", "queue_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"IOConfig.{name} must be a positive int, got {value!r}")
        for name in ("block_size_bytes", "stripe_min_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < ALIGNMENT_BYTES or value % ALIGNMENT_BYTES:
                raise ValueError(
                    f"IOConfig.{name} must be a positive multiple of {ALIGNMENT_BYTES} bytes, got {value!r}"
                )
