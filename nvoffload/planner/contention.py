"""How much the device's compute and the store's I/O slow each other down on this machine.

Offloading hides I/O behind compute only if the two run at once at full speed. On a GPU server they mostly
do: the kernels do not run on the host's cores. With the CPU standing in for the GPU they do not: the
compute threads share the cores with the I/O threads (submission, CRC-32C), and on a VM the hypervisor's
disk emulation takes CPU time from them too. :func:`measure_contention` measures both rates alone and
together, through nvoffload's own :class:`~nvoffload.io.TensorStore`; :func:`overlapped_s` turns the two
fractions into the time a stretch of compute and a stretch of I/O take side by side. ``nvoffload
calibrate`` stores the fractions in the :class:`~nvoffload.planner.profile.MachineProfile`, the planner
uses them for every phase of a step, and the benchmarks print the probe beside their results.
"""

from __future__ import annotations

import collections
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import torch

from nvoffload.io import TensorStore, aligned_empty

__all__ = ["Contention", "measure_contention", "overlapped_s"]

CHUNK_BYTES = 4 << 20  # the size of each put and get
QUICK = {"seconds": 0.5, "io_bytes": 32 << 20}  # a probe of about two seconds, for quick runs

# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal (guest time is within user)
_STAT_FIELDS = 8


def overlapped_s(compute_s: float, io_s: float, compute_with_io: float, io_with_compute: float) -> float:
    """Seconds for ``compute_s`` of compute and ``io_s`` of I/O (each as long as it takes alone) side by side.

    While both run, compute goes at ``compute_with_io`` of its speed alone and I/O at ``io_with_compute`` of
    its own; whichever is left when the other ends runs alone at full speed::

        t_both = min(compute_s / compute_with_io, io_s / io_with_compute)
        total  = t_both + (compute_s - compute_with_io * t_both) + (io_s - io_with_compute * t_both)

    (one of the two remainders is zero). With both fractions 1 this is ``max(compute_s, io_s)``.
    """
    if compute_s <= 0 or io_s <= 0:
        return max(compute_s, io_s, 0.0)
    t_both = min(compute_s / compute_with_io, io_s / io_with_compute)
    return t_both + max(0.0, compute_s - compute_with_io * t_both) + max(0.0, io_s - io_with_compute * t_both)


@dataclass(frozen=True)
class Contention:
    """A :func:`measure_contention` result.

    Attributes:
        seconds: each phase's length; ``io_bytes``: the store's bytes kept in flight; ``threads``: torch's
            compute threads; ``device``: where the compute ran.
        compute_gflops_alone, compute_gflops_with_io: the matmul loop's GFLOP/s alone and beside the I/O.
        io_gb_per_s_alone, io_gb_per_s_with_compute: the store's GB/s (1e9 bytes) alone and beside compute.
        steal_fraction_with_io: the hypervisor's share of all CPU time while both ran (None without
            ``/proc/stat``).
        cpu_split: for each phase (``compute_alone``, ``io_alone``, ``both``), the fractions of CPU time in
            user, system, idle, iowait and steal (or None).
    """

    seconds: float
    io_bytes: int
    threads: int
    device: str
    compute_gflops_alone: float
    compute_gflops_with_io: float
    io_gb_per_s_alone: float
    io_gb_per_s_with_compute: float
    steal_fraction_with_io: float | None
    cpu_split: dict[str, dict[str, float] | None]

    @property
    def compute_with_io(self) -> float:
        """The fraction of its speed alone that compute keeps while the store streams."""
        return self.compute_gflops_with_io / self.compute_gflops_alone

    @property
    def io_with_compute(self) -> float:
        """The fraction of its speed alone that the store keeps while compute runs."""
        return self.io_gb_per_s_with_compute / self.io_gb_per_s_alone

    def overlap_floor(self, compute_s: float, io_s: float) -> float:
        """The best ``overlapped / max(compute_s, io_s)`` a step with these two stretches can reach here
        (1.0: they overlap for free; 1.0 too when either is zero)."""
        bound = max(compute_s, io_s)
        if bound <= 0:
            return 1.0
        return overlapped_s(compute_s, io_s, self.compute_with_io, self.io_with_compute) / bound

    def to_dict(self) -> dict:
        return {**asdict(self), "compute_fraction_with_io": self.compute_with_io, "io_fraction_with_compute": self.io_with_compute}

    def describe(self) -> str:
        """The figures in one line, for a log or a benchmark's notes."""
        steal = "n/a" if self.steal_fraction_with_io is None else f"{self.steal_fraction_with_io:.0%}"
        return (
            f"contention probe ({self.device}, {self.threads} threads, {self.seconds:g} s a phase,"
            f" {self.io_bytes >> 20} MiB in flight): compute {self.compute_gflops_alone:.1f} GFLOP/s alone,"
            f" {self.compute_gflops_with_io:.1f} with I/O (x{self.compute_with_io:.2f}); I/O"
            f" {self.io_gb_per_s_alone:.2f} GB/s alone, {self.io_gb_per_s_with_compute:.2f} with compute"
            f" (x{self.io_with_compute:.2f}); CPU steal with both: {steal}"
        )


def measure_contention(swap_dir: str, *, device: str | torch.device = "cpu", seconds: float = 4.0, io_bytes: int = 256 << 20) -> Contention:
    """Compute and I/O rates alone and at once, in this process, ``seconds`` per phase.

    Phases: (a) compute alone, a loop of square matmuls on ``device`` (fp32 1024 x 1024 on the CPU with
    torch's current thread count, bf16 8192 x 8192 on a GPU); (b) I/O alone, a thread keeping ``io_bytes``
    of 4 KiB-aligned buffers in flight through a :class:`~nvoffload.io.TensorStore` (checksums on, as by
    default) in a temporary subdirectory of ``swap_dir``, half of them puts and half gets, each resubmitted
    as it completes; (c) both at once. The store and its files are removed on return. ``io_bytes`` is a
    multiple of 8 MiB (the puts and gets move 4 MiB each).
    """
    chunks = max(1, io_bytes // (2 * CHUNK_BYTES))
    if io_bytes != 2 * chunks * CHUNK_BYTES:
        raise ValueError(f"io_bytes must be a multiple of {2 * CHUNK_BYTES} (two 4 MiB chunks), got {io_bytes}")
    dev = torch.device(device)
    writes = [aligned_empty(CHUNK_BYTES).fill_(1) for _ in range(chunks)]
    reads = [aligned_empty(CHUNK_BYTES) for _ in range(chunks)]
    split: dict[str, dict[str, float] | None] = {}

    with tempfile.TemporaryDirectory(dir=swap_dir, prefix="contention-") as tmp, TensorStore(
        tmp, capacity_bytes=2 * io_bytes  # the read set, and each write set's old and new copy
    ) as store:
        for f in [store.put(f"r{i}", t) for i, t in enumerate(writes)]:
            f.result()

        def phase(name: str, compute: bool, io: bool) -> tuple[float, float]:
            before = _cpu_ticks()
            loop = _IOLoop(store, writes, reads) if io else None
            if loop is not None:
                loop.start()
            gflops = _compute_gflops(dev, seconds) if compute else 0.0
            if loop is not None:
                if not compute:
                    time.sleep(seconds)
                loop.stop.set()
                loop.join()
                if loop.error is not None:
                    raise loop.error
            split[name] = _cpu_split(before, _cpu_ticks())
            return gflops, 0.0 if loop is None else loop.gb_per_s

        gflops_alone, _ = phase("compute_alone", compute=True, io=False)
        _, io_alone = phase("io_alone", compute=False, io=True)
        gflops_both, io_both = phase("both", compute=True, io=True)

    both = split["both"]
    return Contention(
        seconds=seconds, io_bytes=io_bytes, threads=torch.get_num_threads(), device=str(dev),
        compute_gflops_alone=gflops_alone, compute_gflops_with_io=gflops_both, io_gb_per_s_alone=io_alone,
        io_gb_per_s_with_compute=io_both, steal_fraction_with_io=None if both is None else both["steal"], cpu_split=split,
    )  # fmt: skip


def _compute_gflops(dev: torch.device, seconds: float) -> float:
    """GFLOP/s of a loop of square matmuls on ``dev`` run for ``seconds`` (at least one)."""
    n, dtype = (1024, torch.float32) if dev.type == "cpu" else (8192, torch.bfloat16)
    a, b, c = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(3))

    def once() -> None:
        torch.mm(a, b, out=c)  # into one output, so that no iteration allocates
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    once()  # warm-up
    count, start = 0, time.perf_counter()
    while True:
        once()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count * 2 * n**3 / elapsed / 1e9


class _IOLoop(threading.Thread):
    """Keeps every chunk's put (write set) or get (read set) in flight until stopped.

    ``gb_per_s`` is the bytes completed before the stop was seen over the time from start to then; the
    I/O still in flight is drained but not counted. An I/O error is kept in ``error`` for the caller to
    raise.
    """

    def __init__(self, store: TensorStore, writes: list[torch.Tensor], reads: list[torch.Tensor]):
        super().__init__(name="contention-io", daemon=True)
        self.store, self.writes, self.reads = store, writes, reads
        self.stop = threading.Event()
        self.gb_per_s = 0.0
        self.error: BaseException | None = None

    def _submit(self, op: str, i: int):
        if op == "w":
            return self.store.put(f"w{i}", self.writes[i])
        return self.store.get(f"r{i}", self.reads[i])

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # raised again by the caller, in its own thread
            self.error = exc

    def _loop(self) -> None:
        pending = collections.deque((op, i) for i in range(len(self.writes)) for op in ("w", "r"))
        futures = collections.deque(self._submit(op, i) for op, i in pending)
        done, start = 0, time.perf_counter()
        while not self.stop.is_set():
            futures.popleft().result()
            done += CHUNK_BYTES
            op, i = pending[0]
            pending.rotate(-1)
            futures.append(self._submit(op, i))
        elapsed = time.perf_counter() - start
        for f in futures:
            f.result()
        self.gb_per_s = done / elapsed / 1e9


def _cpu_ticks() -> list[int] | None:
    """The machine's cumulative CPU ticks from ``/proc/stat``, or None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 1 + _STAT_FIELDS:
        return None
    return [int(v) for v in fields[1 : 1 + _STAT_FIELDS]]


def _cpu_split(before: list[int] | None, after: list[int] | None) -> dict[str, float] | None:
    """Fractions of the CPU time between two readings spent in user, system, idle, iowait and steal."""
    if before is None or after is None:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (a - b for a, b in zip(after, before))
    total = user + nice + system + idle + iowait + irq + softirq + steal
    if total <= 0:
        return None
    return {
        "user": (user + nice) / total,
        "system": (system + irq + softirq) / total,
        "idle": idle / total,
        "iowait": iowait / total,
        "steal": steal / total,
    }
