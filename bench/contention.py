"""How much compute and NVMe I/O slow each other down on this machine.

Offloading hides I/O behind compute only if the two can run at once at full
speed. On a small VM they may not: while the disk streams, the hypervisor can
steal CPU time from the compute threads, and the compute threads can starve the
I/O. :func:`measure_contention` measures both rates alone and together in the
current process, with the CPU time split from ``/proc/stat`` for each phase;
:func:`overlap_floor` turns the result into the best ``overlap`` figure a
benchmark step can reach here. The benchmarks print both beside their results.
"""

from __future__ import annotations

import collections
import tempfile
import threading
import time

import torch

from nvoffload.io import TensorStore, aligned_empty
from nvoffload.transfer import Future

MATMUL_SIZE = 1024
CHUNK_BYTES = 4 << 20  # the size of each put and get
ALIGNMENT = 4096
QUICK_PROBE = {"seconds": 0.5, "io_bytes": 32 << 20}  # for the benchmarks' --quick runs

# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal (guest time is within user)
_STAT_FIELDS = 8


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


def _compute(seconds: float) -> float:
    """GFLOP/s of a loop of ``a @ b`` on 1024x1024 fp32 tensors run for ``seconds`` (at least one)."""
    a, b, c = (torch.randn(MATMUL_SIZE, MATMUL_SIZE) for _ in range(3))
    torch.mm(a, b, out=c)  # warm-up; into one output, so that no iteration allocates
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=c)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count * 2 * MATMUL_SIZE**3 / elapsed / 1e9


class _IOLoop(threading.Thread):
    """Keeps every chunk's put (write set) or get (read set) in flight until stopped.

    ``gb_per_s`` is the bytes completed before the stop was seen over the time
    from start to then; the I/O still in flight is drained but not counted.
    An I/O error is kept in ``error`` for the caller to raise.
    """

    def __init__(self, store: TensorStore, writes: list[torch.Tensor], reads: list[torch.Tensor]):
        super().__init__(name="contention-io", daemon=True)
        self.store, self.writes, self.reads = store, writes, reads
        self.stop = threading.Event()
        self.gb_per_s = 0.0
        self.error: BaseException | None = None

    def _submit(self, op: str, i: int) -> Future:
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


def measure_contention(swap_dir: str, seconds: float = 4.0, io_bytes: int = 256 << 20) -> dict:
    """Compute and I/O rates alone and at once, in this process, ``seconds`` per phase.

    Phases: (a) compute alone, a loop of ``a @ b`` on 1024x1024 fp32 tensors
    with torch's current thread count; (b) I/O alone, a Python thread keeping
    ``io_bytes`` of 4 KiB-aligned buffers in flight through a
    :class:`~nvoffload.io.TensorStore` in a temporary subdirectory of
    ``swap_dir``, half of them puts and half gets (each resubmitted as it
    completes); (c) both at once. The store and its files are removed on return.
    ``io_bytes`` is a multiple of 8 MiB (the puts and gets move 4 MiB each).

    Returns a JSON-able dict: ``compute_gflops_alone``, ``compute_gflops_with_io``,
    ``compute_fraction_with_io`` (with / alone), ``io_gb_per_s_alone``,
    ``io_gb_per_s_with_compute``, ``io_fraction_with_compute``,
    ``steal_fraction_with_io`` (of all CPU time in phase (c); None without
    ``/proc/stat``), ``cpu_split`` (for each phase, ``compute_alone``,
    ``io_alone`` and ``both``, the fractions of CPU time in user, system, idle,
    iowait and steal, or None) and the settings ``seconds``, ``io_bytes`` and
    ``threads``.
    """
    chunks = max(1, io_bytes // (2 * CHUNK_BYTES))
    if io_bytes != 2 * chunks * CHUNK_BYTES:
        raise ValueError(f"io_bytes must be a multiple of {2 * CHUNK_BYTES} (two 4 MiB chunks), got {io_bytes}")
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
            gflops = _compute(seconds) if compute else 0.0
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
    return {
        "seconds": seconds,
        "io_bytes": io_bytes,
        "threads": torch.get_num_threads(),
        "compute_gflops_alone": gflops_alone,
        "compute_gflops_with_io": gflops_both,
        "compute_fraction_with_io": gflops_both / gflops_alone,
        "io_gb_per_s_alone": io_alone,
        "io_gb_per_s_with_compute": io_both,
        "io_fraction_with_compute": io_both / io_alone,
        "steal_fraction_with_io": None if both is None else both["steal"],
        "cpu_split": split,
    }


def overlap_floor(compute_s: float, io_s: float, probe: dict) -> float:
    """The best ``overlap`` a step can reach here, given a :func:`measure_contention` result.

    The step has ``compute_s`` seconds of compute and ``io_s`` seconds of I/O,
    each as measured alone (the benchmark's own cases, so that the probe's
    noisy absolute rates do not enter). While both run, compute goes at
    ``f = compute_fraction_with_io`` of its alone speed and I/O at
    ``g = io_fraction_with_compute`` of its own; whichever is left when the
    other ends runs alone at full speed::

        t_both = min(compute_s / f, io_s / g)         # both running
        step   = t_both + (compute_s - f * t_both) + (io_s - g * t_both)
        floor  = step / max(compute_s, io_s)

    (one of the two remainders is zero). 1.0 means the two overlap for free;
    with no compute or no I/O the floor is 1.0.
    """
    f = probe["compute_fraction_with_io"]
    g = probe["io_fraction_with_compute"]
    bound = max(compute_s, io_s)
    if bound <= 0:
        return 1.0
    t_both = min(compute_s / f, io_s / g)
    step = t_both + max(0.0, compute_s - f * t_both) + max(0.0, io_s - g * t_both)
    return step / bound


def describe(probe: dict) -> str:
    """The probe's figures in one line, for a benchmark's notes."""
    steal = probe["steal_fraction_with_io"]
    return (
        f"contention probe ({probe['threads']} threads, {probe['seconds']:g} s a phase,"
        f" {probe['io_bytes'] >> 20} MiB in flight): compute {probe['compute_gflops_alone']:.1f} GFLOP/s alone,"
        f" {probe['compute_gflops_with_io']:.1f} with I/O (x{probe['compute_fraction_with_io']:.2f});"
        f" I/O {probe['io_gb_per_s_alone']:.2f} GB/s alone, {probe['io_gb_per_s_with_compute']:.2f} with compute"
        f" (x{probe['io_fraction_with_compute']:.2f}); CPU steal with both: "
        + ("n/a" if steal is None else f"{steal:.0%}")
    )
