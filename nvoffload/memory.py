"""The memory manager: byte budgets per tier, and the accounting every engine draws from.

Two tiers have budgets (the third, NVMe, is the swap directories' free space,
checked by the :class:`~nvoffload.io.TensorStore`):

- ``device``: the compute device's memory used by streamed parameters, the
  parameters that stay resident and gradients until the optimizer takes them;
- ``host``: host memory for cached parameter blocks, the optimizer's staging
  buffers and activation transfers.

The host buffers themselves come from host slabs
(:class:`~nvoffload.transfer.HostSlab`), each one mapping of exactly its
budget (page-locked once with CUDA), carved between the engines' transfer
engines. Once a slab is attached (:meth:`~MemoryManager.use_host_slab`, as
:func:`nvoffload.initialize` does) the host tier is that slab's accounting
(its aligned bytes in use, peak and capacity), the one place host memory is
counted: host bytes are taken from the slab, not allocated here.
Engines :meth:`~MemoryManager.allocate` before they hold memory and
:meth:`~MemoryManager.free` after; an allocation past the budget raises
:class:`MemoryBudgetError` instead of silently using more. The peak of each
tier is kept for the step report (:meth:`~MemoryManager.stats`).

:func:`retain_freed_host_memory` keeps the C heap from handing memory back to
the operating system between steps; :func:`release_freed_host_memory` makes it
hand large blocks back as soon as they are freed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import platform
import threading

__all__ = [
    "MemoryManager", "MemoryBudgetError", "TierStats", "TIERS", "release_freed_host_memory", "resident_state_share",
    "retain_freed_host_memory",
]  # fmt: skip

_M_TRIM_THRESHOLD = -1  # glibc's mallopt() parameters
_M_MMAP_THRESHOLD = -3
_HEAP_LIMIT_BYTES = 2**31 - 1  # mallopt takes an int: allocations up to 2 GiB come from the heap
_MMAP_THRESHOLD_BYTES = 8 << 20  # below: reused on the heap (no page faults); at and above: handed back at once


def _glibc():
    """The C library when it is glibc (whose ``mallopt`` parameters this module sets), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


def retain_freed_host_memory() -> bool:
    """Serve host allocations below 2 GiB from the C heap, so memory freed in one step is reused in the next.

    By default glibc gives each allocation above its mmap threshold (at most
    32 MiB) its own mapping and unmaps it when freed, so every training step
    faults its gradients and temporaries in again. On a virtual machine with
    free page reporting the hypervisor also takes the freed pages back. On the
    Firecracker VMs nvoffload is tested on, that made the NVMe optimizer's I/O
    after a forward and backward 2-5x slower (see ``bench/results/bench_offload_optim.md``, case
    ``full_unretained``).

    After this call the process keeps its peak heap: resident memory does not
    shrink between steps. Process-wide and idempotent; the NVMe optimizer and
    the activation offload call it unless given ``retain_host_memory=False``.

    Returns:
        True when applied; False where the C library is not glibc.
    """
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_HEAP_LIMIT_BYTES)))


def release_freed_host_memory() -> bool:
    """Give every host allocation of 8 MiB or more its own mapping, unmapped as soon as it is freed.

    glibc starts with a 128 KiB threshold but raises it (up to 32 MiB) each
    time a mapped block is freed; after a few steps the activations and
    gradients of a step come from the heap, and what the heap freed stays with
    the process, so resident memory creeps up to the largest step's
    temporaries on top of the budgets. Fixing the threshold (and the heap's
    trim threshold at twice it, glibc's own rule; what the heap holds free now
    is handed back at once) keeps resident memory near what is live
    (``bench/results/bench_memory.md``), at the cost of faulting large
    temporaries in again every step: the opposite trade of
    :func:`retain_freed_host_memory`. Training GPT-2 124M (batch 1 x 1024,
    256 MiB host and 400 MiB device budgets, activations offloaded), peak RSS
    was 1.0 GiB with the threshold at 1 MiB, 1.4-1.5 GiB at 4 or 8 MiB and
    1.8 GiB with glibc's dynamic threshold; but at 1 MiB a step faulted
    0.8-0.9 M pages in, 2.5x as many as nvoffload's steps did before this
    function existed (0.31 M), and was about 10% slower, while at 8 MiB it
    faulted 0.3 M.
    Process-wide; :func:`nvoffload.initialize` calls it unless
    ``OffloadConfig.retain_host_memory``.

    Returns:
        True when applied; False where the C library is not glibc.
    """
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_MMAP_THRESHOLD_BYTES)):
        return False
    libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2 * _MMAP_THRESHOLD_BYTES))
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


TIERS = ("device", "host")


class MemoryBudgetError(MemoryError):
    """An engine asked a tier for more bytes than its budget has left; ``host_shortfall_bytes`` is how many
    more bytes of host memory it needed, where that is known (else 0)."""

    def __init__(self, message: str, *, host_shortfall_bytes: int = 0):
        super().__init__(message)
        self.host_shortfall_bytes = host_shortfall_bytes


@dataclasses.dataclass(frozen=True)
class TierStats:
    """One tier's accounting, in bytes.

    For the device tier of a CUDA device, ``reserved_bytes`` and ``reserved_peak_bytes`` are what torch's
    caching allocator holds on it now and at most (``torch.cuda.memory_reserved``/``max_memory_reserved``:
    the whole process, since it started or since ``torch.cuda.reset_peak_memory_stats()``), to read beside
    the budget's ``used_bytes``/``peak_bytes``: the budget counts the engines' tensors, the allocator adds
    activations, workspaces and its rounding. None for the host tier and for other devices.
    """

    used_bytes: int
    peak_bytes: int
    limit_bytes: int
    reserved_bytes: int | None = None
    reserved_peak_bytes: int | None = None


class MemoryManager:
    """Budgets for the device and host tiers, with thread-safe accounting.

    Args:
        device_memory_bytes: the most device memory the engines may hold at once.
        cpu_memory_bytes: the most host memory the engines may hold at once.
        device: the device whose memory the device tier is (a ``torch.device``); on CUDA, :meth:`stats`
            reports what the caching allocator reserves there beside the budget.

    >>> mm = MemoryManager(device_memory_bytes=1 << 20, cpu_memory_bytes=4 << 20)
    >>> mm.allocate("host", 3 << 20, "a cached block")
    >>> mm.free("host", 3 << 20)
    >>> mm.stats()["host"].peak_bytes
    3145728
    """

    def __init__(self, *, device_memory_bytes: int, cpu_memory_bytes: int, device=None):
        for name, value in (("device_memory_bytes", device_memory_bytes), ("cpu_memory_bytes", cpu_memory_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int number of bytes, got {value!r}")
        self._limit = {"device": device_memory_bytes, "host": cpu_memory_bytes}
        self._used = dict.fromkeys(TIERS, 0)
        self._tracked = dict.fromkeys(TIERS, 0)  # of which: counted with track(), freed by other threads
        self._peak = dict.fromkeys(TIERS, 0)
        # Taken by every allocation and free (each streamed block's, each gradient's): held as the plain lock it
        # is, its condition's Python-level methods only where a wait (wait_s) may need them.
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        self._waiting = 0  # allocations waiting for memory to be freed (notified by untrack and free)
        self._cuda_device = device if device is not None and device.type == "cuda" else None
        self.host_slab = None  # the HostSlab whose accounting the host tier is (use_host_slab)

    def use_host_slab(self, slab) -> None:
        """Make ``slab`` (a :class:`~nvoffload.transfer.HostSlab`) the host tier: its used, peak and capacity
        bytes are the tier's, and host bytes are allocated from it (:meth:`allocate` refuses the host tier)."""
        with self._lock:
            if self.host_slab is not None or self._used["host"]:
                raise ValueError("the host tier already counts memory: attach the host slab before anything is allocated")
            self.host_slab = slab

    def limit_bytes(self, tier: str) -> int:
        if self._check(tier) == "host" and self.host_slab is not None:
            return self.host_slab.capacity_bytes
        return self._limit[tier]

    def available_bytes(self, tier: str) -> int:
        """Bytes the tier's budget has left now."""
        if self._check(tier) == "host" and self.host_slab is not None:
            return self.host_slab.available_bytes
        with self._lock:
            return self._limit[tier] - self._used[tier]

    def allocate(self, tier: str, nbytes: int, what: str, *, wait_s: float = 0.0, headroom_bytes: int = 0) -> None:
        """Account ``nbytes`` more in ``tier``, leaving room for ``headroom_bytes`` that will follow.

        Past the budget, while memory counted with :meth:`track` is in use
        (gradients the optimizer has not taken yet), waits up to ``wait_s``
        seconds for it to be freed (back-pressure: backward waits for the
        optimizer), then raises :class:`MemoryBudgetError`.
        """
        if tier != "device":
            self._counted_here(tier)
        needed = nbytes + headroom_bytes
        with self._mutex:
            if wait_s > 0 and self._used[tier] + needed > self._limit[tier] and self._tracked[tier]:
                self._waiting += 1
                try:
                    self._lock.wait_for(
                        lambda: self._used[tier] + needed <= self._limit[tier] or not self._tracked[tier], timeout=wait_s
                    )
                finally:
                    self._waiting -= 1
            if self._used[tier] + needed > self._limit[tier]:
                raise MemoryBudgetError(
                    f"{what} needs {needed} bytes of {tier} memory, but {self._used[tier]} of the "
                    f"{self._limit[tier]}-byte {tier} budget are in use"
                )
            self._add(tier, nbytes)

    def track(self, tier: str, nbytes: int) -> None:
        """Account ``nbytes`` that an engine cannot refuse (gradients autograd made); counted, never refused."""
        if tier != "device":
            self._counted_here(tier)
        with self._mutex:
            self._add(tier, nbytes)
            self._tracked[tier] += nbytes

    def untrack(self, tier: str, nbytes: int) -> None:
        """Free memory counted with :meth:`track`."""
        if tier != "device":
            self._counted_here(tier)
        with self._mutex:
            self._tracked[tier] -= nbytes
            self._used[tier] -= nbytes
            if self._waiting:
                self._lock.notify_all()

    def free(self, tier: str, nbytes: int) -> None:
        if tier != "device":
            self._counted_here(tier)
        with self._mutex:
            self._used[tier] -= nbytes
            if self._waiting:
                self._lock.notify_all()

    def stats(self) -> dict[str, TierStats]:
        """Used, peak and limit of each tier; on CUDA, the device tier with what the allocator reserves."""
        with self._lock:
            stats = {t: TierStats(self._used[t], self._peak[t], self._limit[t]) for t in TIERS}
        slab = self.host_slab
        if slab is not None:
            stats["host"] = TierStats(slab.used_bytes, slab.peak_bytes, slab.capacity_bytes)
        if self._cuda_device is not None:
            import torch

            stats["device"] = dataclasses.replace(
                stats["device"],
                reserved_bytes=torch.cuda.memory_reserved(self._cuda_device),
                reserved_peak_bytes=torch.cuda.max_memory_reserved(self._cuda_device),
            )
        return stats

    def reset_peaks(self) -> None:
        """Restart each tier's peak from its current use (at the start of a step)."""
        with self._lock:
            self._peak = dict(self._used)
        if self.host_slab is not None:
            self.host_slab.reset_peak()

    def _add(self, tier: str, nbytes: int) -> None:
        self._used[tier] += nbytes
        self._peak[tier] = max(self._peak[tier], self._used[tier])

    def _counted_here(self, tier: str) -> str:
        if self._check(tier) == "host" and self.host_slab is not None:
            raise ValueError(f"host memory is taken from {self.host_slab.what}, not allocated in the host tier")
        return tier

    @staticmethod
    def _check(tier: str) -> str:
        if tier not in TIERS:
            raise ValueError(f"unknown memory tier {tier!r}; use one of {list(TIERS)}")
        return tier


def resident_state_share(stream_host_bytes: int, block_bytes: list[int], prefetch_blocks: int, *,
                         delayed_update: bool = False) -> int:  # fmt: skip
    """Host bytes for resident optimizer state out of ``stream_host_bytes``, the budget left for parameter
    blocks of ``block_bytes`` each: what remains once every block is cached (at least ``2 + prefetch_blocks``
    of the largest, what streaming needs), in whole 4 KiB pages; 0 when the blocks do not all fit. With
    ``delayed_update`` every block is cached beside its twin (its new weights), and streaming needs two more.

    The weights' cache comes first whatever bounds the step: a byte of it saves a block's two reads a
    micro-batch (2 NVMe bytes a step or more) and, once every block is cached, the write-back of the changed
    weights; a byte of resident state saves half a byte read and half a byte written (its two generations,
    24 bytes a parameter, save the 12 read and 12 written). On NVMe reads, writes, their checksums and their
    sum alike the cache saves at least as much, so resident state takes only what the cache cannot use."""
    pages = [-(-b // 4096) * 4096 for b in block_bytes] * (2 if delayed_update else 1)
    cache = max(sum(pages), (2 + prefetch_blocks + (2 if delayed_update else 0)) * max(pages, default=0))
    return max(0, stream_host_bytes - cache) // 4096 * 4096
