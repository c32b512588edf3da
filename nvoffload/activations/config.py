"""Settings and statistics of the activation offload."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ActivationOffloadConfig", "OffloadStats", "TARGETS"]

TARGETS = ("nvme", "cpu")

MiB = 1 << 20
MIN_HOST_BYTES = 4096  # one aligned buffer


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """How :class:`~nvoffload.activations.offload_activations` moves saved tensors.

    Attributes:
        target: ``"nvme"`` (a :class:`~nvoffload.io.TensorStore`) or ``"cpu"``
            (host memory).
        min_bytes: saved tensors smaller than this stay where they are.
        keep_recent_bytes: the most recently saved tensors, up to this many bytes,
            stay in memory (backward needs them first); older ones are written out.
        prefetch_bytes: during backward, reads in flight (or read but not yet
            used) for the tensors backward will ask for next, up to this many
            bytes (the transfer engine's :class:`~nvoffload.transfer.ReadAhead`;
            one larger read may start alone; 0: none read ahead).
        max_pending_write_bytes: bytes of writes in flight at most: before a
            write starts, forward waits for the oldest ones until it fits beside
            them (the transfer engine's :class:`~nvoffload.transfer.WriteBehind`),
            and a write larger than this alone is waited for at once (0: each
            write ends before forward goes on). Bounds the memory held by slow writes.
        retain_host_memory: call :func:`nvoffload.memory.retain_freed_host_memory`
            (process-wide: the activations freed each step are reused, not
            handed back to the operating system and faulted in again).
        host_memory_bytes: the host slab of the offload's own transfer engine
            (page-locked at the first write when CUDA is present: it is the
            real footprint). It holds the offloaded tensors themselves with
            ``target="cpu"``, and stages the copies of writes and reads in
            flight with ``target="nvme"``. Default (None): a quarter of the
            machine's memory, at most 4 GiB, for ``"cpu"``; ``max_pending_write_bytes +
            prefetch_bytes``, at least 64 MiB, for ``"nvme"``. Unused when a
            shared engine is given (its slab is the budget).
        host_resident_bytes: with ``target="nvme"``, offloaded tensors are kept
            in host memory (slab buffers) while those kept there fit in this
            many bytes, and only the rest are written to NVMe: the host first,
            NVMe when it is short. Each comes back from where it is (read
            ahead as ever). The default ``host_memory_bytes`` adds it to the
            staging; a given one (or a shared engine's slab) must hold both.
            0 (default): every offloaded tensor goes to NVMe.
    """

    target: str = "nvme"
    min_bytes: int = 256 * 1024
    keep_recent_bytes: int = 64 * MiB
    prefetch_bytes: int = 256 * MiB
    max_pending_write_bytes: int = 256 * MiB
    retain_host_memory: bool = True
    host_memory_bytes: int | None = None
    host_resident_bytes: int = 0

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"unknown offload target {self.target!r}; choose one of {list(TARGETS)}")
        for field in ("min_bytes", "keep_recent_bytes", "prefetch_bytes", "max_pending_write_bytes", "host_resident_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{field} must be an int number of bytes, got {value!r}")
            if value < 0:
                raise ValueError(f"{field} must be >= 0, got {value}")
        if self.host_resident_bytes and self.target != "nvme":
            raise ValueError("host_resident_bytes is for target='nvme' (target='cpu' keeps every tensor in host memory)")
        value = self.host_memory_bytes
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < MIN_HOST_BYTES):
            raise ValueError(f"host_memory_bytes must be None or an int >= {MIN_HOST_BYTES}, got {value!r}")
        if value is not None and self.host_resident_bytes + MIN_HOST_BYTES > value:
            raise ValueError(
                f"host_memory_bytes ({value}) must hold host_resident_bytes ({self.host_resident_bytes}) and the"
                " staging of the NVMe transfers beside it: raise it, or leave it out (its default adds them)"
            )

    def host_bytes(self) -> int:
        """The host slab's size: ``host_memory_bytes``, or its default for the target."""
        if self.host_memory_bytes is not None:
            return self.host_memory_bytes
        if self.target == "cpu":
            return min(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4, 4 << 30)
        return max(self.max_pending_write_bytes + self.prefetch_bytes, 64 * MiB) + self.host_resident_bytes


@dataclass(frozen=True)
class OffloadStats:
    """A snapshot of one offload context's counters (bytes unless named otherwise).

    ``resident_bytes`` counts the distinct storages that saved tensors keep in
    the compute device's memory through this context: tensors left in place
    (small ones, not parameters), the recent ones kept in memory, those whose
    write is still in flight, and those read back but not yet used by backward.
    ``offloaded_bytes`` is the space taken in the target (swap files or host
    memory) right now. ``host_bytes_written`` is the part of ``bytes_written``
    kept in host memory (all of it with ``target="cpu"``; with
    ``host_resident_bytes``, what fit there; the rest went to NVMe), and
    ``host_bytes_read`` the part of ``bytes_read`` read back from there.
    ``tensors_forwarded`` counts tensors backward used
    straight from memory without a round trip (never written out);
    ``reads_prefetched`` counts reads already started before backward asked for
    the tensor; ``reads_avoided`` counts written tensors backward used from
    memory because their write was still in flight when the read-ahead (or
    backward) reached them.
    """

    resident_bytes: int
    peak_resident_bytes: int
    offloaded_bytes: int
    peak_offloaded_bytes: int
    bytes_written: int
    host_bytes_written: int
    bytes_read: int
    host_bytes_read: int
    tensors_written: int
    tensors_forwarded: int
    dedup_hits: int
    reads_prefetched: int
    reads_avoided: int
    live_records: int
