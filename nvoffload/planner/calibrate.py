"""``nvoffload calibrate``: measure this machine's engines through nvoffload's own code into a
:class:`~nvoffload.planner.profile.MachineProfile`.

- each swap directory's (and all of them together) write and read GB/s: a :class:`~nvoffload.io.TensorStore`
  (O_DIRECT, checksums on as by default) putting, then getting, 16 MiB tensors all in flight;
- the CPU Adam kernel's parameters/s with fp32 and bf16 gradients (:func:`nvoffload.optim.kernels.adam_step`
  on 4 Mi-element chunks, as the optimizer's);
- host<->device copy GB/s through a :class:`~nvoffload.transfer.TransferEngine` (page-locked with CUDA);
- a transformer block's forward and backward (:class:`nvoffload.models.gpt.Block`) at three widths, and a
  large matmul, in TFLOP/s: fp32 on the CPU, bf16 on a GPU;
- the NVMe optimizer's fixed time per parameter tensor (:class:`~nvoffload.optim.NVMeAdamW` steps over 16 and
  64 tiny tensors in the first swap directory: the difference, per tensor);
- activation offload's fixed time per saved tensor (forward and backward over 32 and 128 small saved tensors
  through :class:`~nvoffload.activations.offload_activations` in the first swap directory: the difference,
  per tensor);
- how much compute and the store's I/O slow each other down when they run at once
  (:func:`~nvoffload.planner.contention.measure_contention` beside the first swap directory);
- the free host and device memory; the GPU's name by NVML (``nvidia-ml-py``) where present;
- whether others' work kept the cores busy meanwhile (:func:`cpu_share`, before and after the compute): then the
  host's compute is timed by one thread's CPU time (:class:`Clock`), not the clock, and the profile says how busy
  the machine was (``MachineProfile.busy``, which ``plan`` repeats in a note).

The link between GPUs is not measured (one process calibrates): the profile's ``interconnect_gbps`` is the
host link's (see :class:`~nvoffload.planner.profile.MachineProfile`); edit the JSON for NVLink.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from nvoffload.planner.contention import QUICK, measure_contention
from nvoffload.planner.cost import block_flops
from nvoffload.planner.profile import Drive, MachineProfile

__all__ = ["Clock", "busy_machine", "calibrate", "cpu_share", "default_profile_path"]

_MiB = 1 << 20


class Clock(enum.Enum):
    """How calibrate times the host's compute (the Adam kernel; a block's passes with the CPU as the device)."""

    WALL = "the clock, with torch's threads"  # a quiet machine (and always a GPU's compute)
    # A busy machine: one torch thread, timed by the CPU time the process got (or the clock, if less). On 2 cores and
    # a load of 14 the clock made a short pass of one block 100-300 times slower than quiet (the fixed time a pass
    # 0.5-1.4 s, not 4 ms), and the CPU time of two threads was little better (their spinning at each barrier while
    # the other waits for a core); one thread's CPU time varies by a few percent. It takes the work as if on one core:
    # at most the threads' count slower than the machine alone.
    CPU_TIME = "one thread's CPU time"


def default_profile_path() -> str:
    """``<cache>/profiles/<host name>.json`` under nvoffload's cache directory."""
    from nvoffload.io.config import default_swap_root

    return os.path.join(default_swap_root(), "profiles", f"{socket.gethostname()}.json")


def calibrate(
    swap_dirs: Sequence[str], *, device: str | None = None, quick: bool = False, log: Callable[[str], None] = print
) -> MachineProfile:
    """Measure this machine (see the module docs); ``quick`` uses smaller sizes (seconds, rougher figures)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate measures a CUDA GPU or the CPU, not {dev}")
    if not swap_dirs:
        raise ValueError("give at least one swap directory")
    per_dir = (64 if quick else 1024) * _MiB
    drives = []
    for d in swap_dirs:
        drives.append(store_bandwidth([d], per_dir))
        log(f"swap directory {d}: write {drives[-1].write_gbps:.2f} GB/s, read {drives[-1].read_gbps:.2f} GB/s")
    together = store_bandwidth(list(swap_dirs), per_dir * len(swap_dirs)) if len(swap_dirs) > 1 else drives[0]
    share = cpu_share()  # below _BUSY_CPU_SHARE: others' work keeps the cores busy; the host's compute is timed by CPU time
    clock = Clock.CPU_TIME if share < _BUSY_CPU_SHARE else Clock.WALL
    adam = {name: _adam_rate(dtype, quick, clock) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    log(f"CPU Adam: {adam['float32'] / 1e6:.0f} M params/s (fp32 gradients), {adam['bfloat16'] / 1e6:.0f} M (bf16)")
    h2d, d2h = _copy_bandwidth(dev, quick)
    log(f"host<->device copies: h2d {h2d:.2f} GB/s, d2h {d2h:.2f} GB/s")
    widths = (256, 512, 1024) if dev.type == "cpu" else (1024, 2048, 4096)
    on_host = clock if dev.type == "cpu" else Clock.WALL  # a GPU's compute: by the clock
    blocks = tuple((w, *_block_tflops(dev, w, quick, on_host)) for w in (widths[:2] if quick else widths))
    matmul = _matmul_tflops(dev, quick, on_host)
    cores = os.cpu_count() or 1
    busy = busy_machine(min(share, cpu_share()), os.getloadavg()[0], cores)
    tensor_s = _optimizer_tensor_seconds(swap_dirs[0], quick, clock)
    log(f"NVMe optimizer: {tensor_s * 1e3:.2f} ms a parameter tensor a step, besides its bytes")
    crc = _crc32c_gbps(quick)
    log(f"CRC-32C: {crc:.1f} GB/s on one thread")
    saved_s = _saved_tensor_seconds(swap_dirs[0], dev, quick, clock if dev.type == "cpu" else Clock.WALL)
    log(f"activation offload: {saved_s * 1e3:.2f} ms a saved tensor, written and read back, besides its bytes")
    probe = measure_contention(swap_dirs[0], device=dev, **(QUICK if quick else {"seconds": 3.0}))
    log("block forward+backward, matrices / attention TFLOP/s, fixed ms: " + ", ".join(f"d_model {w}: {m:.3f} / {a:.3f}, {o * 1e3:.1f}" for w, m, a, o in blocks) + f"; matmul {matmul:.3f}")
    log(probe.describe())
    host_free = host_available_bytes()
    if dev.type == "cuda":
        device_free, name = torch.cuda.mem_get_info(dev)[0], _gpu_name(dev)
    else:
        device_free, name = host_free, platform.processor() or platform.machine()
    return MachineProfile(
        name=f"{socket.gethostname()} ({name}, {len(swap_dirs)} swap directories)", device=dev.type,
        device_name=name, device_memory_bytes=int(device_free), host_memory_bytes=int(host_free), block_tflops=blocks,
        matmul_tflops=matmul, h2d_gbps=h2d, d2h_gbps=d2h, drives=tuple(drives), drives_together=together,
        adam_params_per_s=adam, cpu_cores=cores, busy=busy,
        compute_with_io=min(1.0, probe.compute_with_io), io_with_compute=min(1.0, probe.io_with_compute),
        optimizer_tensor_s=tensor_s, saved_tensor_s=saved_s, crc32c_gbps=crc,
        source=f"measured by nvoffload calibrate{' --quick' if quick else ''} on {socket.gethostname()},"
        f" {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, swap directories {', '.join(map(str, swap_dirs))}",
    )  # fmt: skip


def _crc32c_gbps(quick: bool) -> float:
    """One thread's CRC-32C rate, GB/s: the best of 3 passes over 16 MiB (64 MiB), in cache-cold memory as the
    I/O threads see a block's bytes."""
    from nvoffload.io.checksum import crc32c

    data = torch.randint(0, 256, ((16 if quick else 64) * _MiB,), dtype=torch.uint8)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        crc32c(data)
        best = min(best, time.perf_counter() - start)
    return data.numel() / best / 1e9


def store_bandwidth(dirs: list[str], nbytes: int) -> Drive:
    """The store's sequential write and read GB/s over ``dirs`` (striped), ``nbytes`` in 16 MiB tensors, with
    checksums, as ``calibrate`` measures each swap directory."""
    from nvoffload.io import TensorStore, aligned_empty

    size = 16 * _MiB
    buffers = [aligned_empty(size) for _ in range(max(1, nbytes // size))]
    for b in buffers:
        b.fill_(7)
    with TensorStore(dirs if len(dirs) > 1 else dirs[0], capacity_bytes=len(buffers) * size) as store:
        start = time.perf_counter()
        for f in [store.put(f"calibrate{i}", b) for i, b in enumerate(buffers)]:
            f.result()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for f in [store.get(f"calibrate{i}", out=b) for i, b in enumerate(buffers)]:
            f.result()
        read_s = time.perf_counter() - start
    total = len(buffers) * size
    return Drive(read_gbps=total / read_s / 1e9, write_gbps=total / write_s / 1e9)


def _adam_rate(grad_dtype: torch.dtype, quick: bool, clock: Clock) -> float:
    from nvoffload.optim.kernels import adam_step

    n = 4 * _MiB
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(grad_dtype)
    out = torch.empty(n, dtype=torch.bfloat16) if grad_dtype != torch.float32 else None

    def once(step=[0]):  # noqa: B006 - a counter across calls
        step[0] += 1
        adam_step(p, g, m, v, step=step[0], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, param_out=out)

    return n / _median_seconds([once], 3 if quick else 10, clock)[0]


def _optimizer_tensor_seconds(swap_dir: str, quick: bool, clock: Clock) -> float:
    """The NVMe optimizer's step time per parameter tensor beyond its bytes: steps over 64 and over 16 tensors of
    1024 elements (whose bytes and Adam work take microseconds), in turns, the difference over 48; on a busy
    machine by the CPU time the process got (the clock's difference of two short steps is the load's noise there:
    it came out negative, and the fixed time 0, at a load of 10 on 2 cores)."""
    from nvoffload.optim import NVMeAdamW

    with contextlib.ExitStack() as stack:
        runs = []
        for count in (16, 64):
            params = [torch.nn.Parameter(torch.zeros(1024)) for _ in range(count)]
            d = stack.enter_context(tempfile.TemporaryDirectory(dir=swap_dir))
            opt = NVMeAdamW(params, lr=1e-4, swap_dir=d, cpu_memory_bytes=16 * _MiB)
            stack.callback(opt.close)

            def once(params=params, opt=opt):
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
                opt.zero_grad()

            runs.append(once)
        few, many = _median_seconds(runs, 3 if quick else 8, clock)
    return max(0.0, (many - few) / 48)


def _saved_tensor_seconds(swap_dir: str, dev: torch.device, quick: bool, clock: Clock) -> float:
    """Activation offload's time per saved tensor beyond its bytes: forward and backward of a chain of 128 and of
    32 ``sin`` (each saves its input, 1024 elements: its bytes take microseconds), every one written to the store
    and read back (nothing kept in memory), in turns, the difference over 96 (timed by ``clock``, as
    :func:`_optimizer_tensor_seconds`)."""
    from nvoffload.activations import offload_activations

    x = torch.zeros(1024, device=dev, requires_grad=True)
    with tempfile.TemporaryDirectory(dir=swap_dir) as d:
        offload = offload_activations(d, min_bytes=0, keep_recent_bytes=0)
        try:

            def chain(count: int) -> None:
                with offload:
                    y = x
                    for _ in range(count):
                        y = y.sin()
                y.sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            few, many = _median_seconds([lambda: chain(32), lambda: chain(128)], 3 if quick else 8, clock)
        finally:
            offload.close()
    return max(0.0, (many - few) / 96)


def _copy_bandwidth(dev: torch.device, quick: bool) -> tuple[float, float]:
    from nvoffload.transfer import TransferEngine

    nbytes = (32 if quick else 256) * _MiB
    with TransferEngine(nbytes + 4096, dev.type if dev.type == "cpu" else str(dev), what="calibrate copies") as engine:
        host = engine.slab.allocate(nbytes, "calibrate copies")
        host.fill_(1)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h2d_s, d2h_s = _median_seconds([lambda: engine.to_device(on_device, host).result(), lambda: engine.to_host(host, on_device).result()], 3)
        h2d, d2h = nbytes / h2d_s / 1e9, nbytes / d2h_s / 1e9
        engine.slab.free(host)
    return h2d, d2h


def _block_tflops(dev: torch.device, d_model: int, quick: bool, clock: Clock = Clock.WALL) -> tuple[float, float, float]:
    """A block's matrices and attention TFLOP/s and fixed seconds per pass, from its forward and backward timed
    on four shapes: short sequences, twice as many of them (the matrices' work doubles, the fixed time does
    not), long sequences of the same tokens (only attention grows), and one short sequence (a small micro-batch:
    the fixed time is at least what its time leaves beside the rates, so a pass of few tokens costs what it
    measured, which the first two alone can put at 0 when the larger pass runs at a lower rate). Each pass timed by
    ``clock`` (see :class:`Clock`)."""
    from nvoffload.models.gpt import Block, GPTConfig

    tokens = 512 if quick else 1024
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    shapes = [(tokens // 128, 128), (2 * tokens // 128, 128), (tokens // 512, 512), (1, 128)]  # (batch, seq)
    runs = []
    for batch, seq in shapes:
        cfg = GPTConfig(seq_len=seq, n_layer=1, n_head=max(1, d_model // 64), d_model=d_model)
        block = Block(cfg).to(device=dev, dtype=dtype)
        x = torch.randn(batch, seq, d_model, device=dev, dtype=dtype, requires_grad=True)

        def once(block=block, x=x):
            block(x).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        runs.append(once)
    seconds = _median_seconds(runs, 2 if quick else 6, clock)
    (m0, a0), (m1, a1), (m2, a2), (m3, a3) = (block_flops(d_model, cfg.mlp_ratio, b, s) for b, s in shapes)
    # seconds[i] = overhead + m_i / matrix_rate + a_i / attention_rate; m1 = 2 m0, a1 = 2 a0, m2 = m0; m3: one sequence's
    # Noise can make the differences small or negative: the fixed time is at most half of the short pass,
    # and attention runs no faster per FLOP than the matrices.
    per_short = min(max(seconds[1] - seconds[0], seconds[0] / 2), seconds[0])  # m0 / matrix_rate + a0 / attention_rate
    overhead = seconds[0] - per_short
    attention_s = max(seconds[2] - seconds[0], 0.0) / (a2 - a0)
    matrix_s = max(per_short - a0 * attention_s, per_short / 2) / m0
    attention_s = max(attention_s, matrix_s)
    overhead = max(overhead, seconds[3] - m3 * matrix_s - a3 * attention_s)
    return 1 / matrix_s / 1e12, 1 / attention_s / 1e12, overhead


def _matmul_tflops(dev: torch.device, quick: bool, clock: Clock = Clock.WALL) -> float:
    n = (1024 if quick else 2048) if dev.type == "cpu" else 8192
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)

    def once():
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return 2 * n**3 / _median_seconds([once], 3, clock)[0] / 1e12


def _median_seconds(runs: Sequence[Callable[[], object]], repeats: int, clock: Clock = Clock.WALL) -> list[float]:
    """Each run's median of ``repeats`` timings after one warm-up, timed in turns (one of each, then again), so
    that a load that comes and goes on the machine falls on all of them alike, not on one: what matters where
    the figures are compared with each other (a difference, a slope); each timed by ``clock``."""
    threads = torch.get_num_threads()
    one_thread = clock is Clock.CPU_TIME and threads > 1
    if one_thread:
        torch.set_num_threads(1)
    try:
        for run in runs:
            run()
        times = [[] for _ in runs]
        for _ in range(repeats):
            for run, seconds in zip(runs, times):
                wall, cpu = time.perf_counter(), time.process_time()
                run()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                seconds.append(min(wall, cpu) if clock is Clock.CPU_TIME else wall)
    finally:
        if one_thread:
            torch.set_num_threads(threads)
    return [statistics.median(seconds) for seconds in times]


# Below this share of the clock in CPU time, a thread that never waits for anything but a core was kept waiting by
# others' work: the machine is busy (quiet, the share is 1).
_BUSY_CPU_SHARE = 0.75


def cpu_share(seconds: float = 0.2) -> float:
    """The CPU time this thread gets a second of the clock while it computes for ``seconds`` (a loop of Python
    arithmetic, which waits for nothing but a core): about 1 on a quiet machine, less on one others keep busy."""
    wall, cpu = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - wall < seconds:
        for i in range(1000):
            x += i
    return (time.thread_time() - cpu) / (time.perf_counter() - wall)


def busy_machine(share: float, load_average: float, cores: int) -> str:
    """How busy the machine was while calibrate timed its compute (``share``: the least :func:`cpu_share` then,
    and the load average): a description when below ``_BUSY_CPU_SHARE`` (others' work held it up), else ``""``."""
    if share >= _BUSY_CPU_SHARE:
        return ""
    return f"a thread got {share:.2f} s of CPU time a second, load average {load_average:.1f} on {cores} cores"


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _gpu_name(dev: torch.device) -> str:
    """The GPU's name by NVML where ``nvidia-ml-py`` is installed (the ``[gpu]`` extra), else torch's."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            name = pynvml.nvmlDeviceGetName(handle)
            return name.decode() if isinstance(name, bytes) else name
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML missing or failing: torch knows the name too
        return torch.cuda.get_device_name(dev)
