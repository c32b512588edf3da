"""TensorStore write/read bandwidth beside fio, torch.save/load and numpy.tofile/fromfile.

Every case moves the same bytes (``--total-gib`` in ``--tensor-mib`` tensors)
on the same directories in the same run:

- ``fio``: direct=1, bs=1M, iodepth=32, ioengine=libaio, one job per directory
  (the drive's bandwidth as the standard tool sees it; the ratios are against
  it), and the same with 4 jobs per directory (``fio numjobs=4``, not in the
  quick run: a check that one fio job is not the limit). Skipped, with a message, where ``fio`` is not
  installed (``apt-get install fio``).
- ``TensorStore``: every tensor put (then got) at once, O_DIRECT, from 4 KiB-aligned
  buffers (``nvoffload.io.aligned_empty``), and from ordinary ``torch.empty``
  tensors (``unaligned``: the I/O threads bounce unaligned blocks through aligned buffers).
- ``TensorStore crc32c``: the same with the store's checksums (CRC-32C of every tensor at ``put``,
  verified at ``get``: the default), and, printed apart, the checksums' own speed on one thread
  (native CRC-32C beside ``zlib.crc32`` and a plain read of the buffer).
- ``torch.save``/``torch.load`` and ``numpy.tofile``/``fromfile``: one file per
  tensor, buffered, with ``fsync`` counted in the write time (without it the
  write only reaches the page cache), and the page cache emptied before reading
  (``/proc/sys/vm/drop_caches`` when permitted, and ``posix_fadvise(DONTNEED)``
  on every file in any case) so that reads come from the drive.

Each case runs ``--repeats`` times, interleaved with the others so that they
share the machine's noise; the median is reported with the ratio to fio.

    python bench/bench_io.py                     # 4 GiB, one and two directories under /tmp
    python bench/bench_io.py --quick             # 256 MiB smoke run
    python bench/bench_io.py --dirs /nvme0,/nvme1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, markdown_table, save_report  # noqa: E402

from nvoffload.io import IOConfig, TensorStore, _aio, aligned_empty  # noqa: E402
from nvoffload.io.checksum import crc32c  # noqa: E402

MiB = 1 << 20
GB = 1e9


def drop_page_cache(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; returns how ('drop_caches' or 'fadvise')."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def fio_bandwidth(dirs: list[Path], total_bytes: int, rw: str, jobs_per_dir: int = 1) -> float:
    """fio's aggregate bandwidth (bytes/s), ``jobs_per_dir`` jobs per directory on files it lays out itself.

    Several jobs on one file each take their own slice of it (``offset_increment``).
    """
    per_job = max(MiB, total_bytes // (len(dirs) * jobs_per_dir)) // MiB
    cmd = [
        "fio",
        "--output-format=json",
        "--group_reporting",
        "--direct=1",
        "--bs=1M",
        "--iodepth=32",
        "--ioengine=libaio",
        f"--rw={rw}",
        f"--size={per_job}M",
        f"--numjobs={jobs_per_dir}",
        f"--offset_increment={per_job}M",
    ]
    for i, d in enumerate(dirs):
        cmd += [f"--name=dir{i}", f"--filename={d / 'fio.dat'}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["read" if rw == "read" else "write"]["bw_bytes"])


def store_bandwidth(dirs: list[Path], tensors: list[torch.Tensor], config: IOConfig, checksum: bool):
    """(write, read) bytes/s of TensorStore: every put in flight at once, then every get.

    ``checksum``: the store's CRC-32C of every tensor, taken at ``put`` and verified at ``get``.
    The gets read back into the tensors themselves (no second copy in memory);
    the first two are zeroed in between and checked against copies taken before.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    expected = [t.clone() for t in tensors[:2]]
    with TensorStore([str(d) for d in dirs], capacity_bytes=total, config=config, checksum=checksum) as store:
        start = time.perf_counter()
        for f in [store.put(f"t{i}", t) for i, t in enumerate(tensors)]:
            f.result()
        write_s = time.perf_counter() - start
        for t in tensors[:2]:
            t.zero_()
        start = time.perf_counter()
        for f in [store.get(f"t{i}", out=t) for i, t in enumerate(tensors)]:
            f.result()
        read_s = time.perf_counter() - start
    if not all(torch.equal(a, b) for a, b in zip(tensors[:2], expected)):
        raise RuntimeError("TensorStore read back different bytes")
    return total / write_s, total / read_s


def file_bandwidth(
    dirs: list[Path],
    tensors: list[torch.Tensor],
    save: Callable[[torch.Tensor, Path], None],
    load: Callable[[Path, torch.Tensor], torch.Tensor],
):
    """(write, read) bytes/s of one buffered file per tensor, fsync in the write, cold reads."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    paths = [dirs[i % len(dirs)] / f"peer{i}.bin" for i in range(len(tensors))]
    start = time.perf_counter()
    for t, p in zip(tensors, paths):
        save(t, p)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    write_s = time.perf_counter() - start
    drop_page_cache(paths)
    start = time.perf_counter()
    first = load(paths[0], tensors[0])
    for t, p in zip(tensors[1:], paths[1:]):
        load(p, t)  # dropped at once: only the first is kept, to check it
    read_s = time.perf_counter() - start
    if not torch.equal(first, tensors[0]):
        raise RuntimeError(f"{paths[0]} read back different bytes")
    for p in paths:
        p.unlink()
    return total / write_s, total / read_s


def torch_save(t: torch.Tensor, p: Path) -> None:
    torch.save(t, p)


def torch_load(p: Path, like: torch.Tensor) -> torch.Tensor:
    return torch.load(p, weights_only=True)


def numpy_save(t: torch.Tensor, p: Path) -> None:
    t.numpy().tofile(p)


def numpy_load(p: Path, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(p, dtype=np.float32)).view(like.shape)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="256 MiB, one repeat: the smoke run")
    p.add_argument("--total-gib", type=float, default=4.0, help="bytes moved per case (default 4 GiB)")
    p.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor (default 64 MiB)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case; the median is reported")
    p.add_argument(
        "--dirs",
        default=None,
        help="comma-separated directories (one per drive); default: two fresh directories under /tmp. "
        "Cases run with the first one alone and with all of them",
    )
    p.add_argument("--threads", type=int, default=None, help="IOConfig.num_threads (default: IOConfig's)")
    p.add_argument("--thread-sweep", default=None, metavar="N,N,...",
                   help="also the store with and without checksums at each of these IOConfig.num_threads, on the"
                   " first directory: how the checksums' cost scales with the I/O threads")  # fmt: skip
    p.add_argument("--block-kib", type=int, default=None, help="IOConfig.block_size_bytes in KiB")
    p.add_argument("--queue-depth", type=int, default=None, help="IOConfig.queue_depth")
    p.add_argument("--no-fio", action="store_true", help="leave out the fio peer")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.total_gib, args.repeats = 0.25, 1
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    overrides = {
        k: v
        for k, v in (
            ("num_threads", args.threads),
            ("block_size_bytes", None if args.block_kib is None else args.block_kib * 1024),
            ("queue_depth", args.queue_depth),
        )
        if v is not None
    }
    config = IOConfig(**overrides)
    tensor_bytes = args.tensor_mib * MiB
    count = max(1, round(args.total_gib * (1 << 30) / tensor_bytes))
    total = count * tensor_bytes

    scratch = None
    if args.dirs:
        roots = [Path(d) for d in args.dirs.split(",")]
    else:
        scratch = Path(tempfile.mkdtemp(prefix="bench_io_", dir="/tmp"))
        roots = [scratch / "a", scratch / "b"]
        for r in roots:
            r.mkdir()
    dir_sets = [roots[:1]] + ([roots] if len(roots) > 1 else [])

    have_fio = shutil.which("fio") is not None and not args.no_fio
    if not have_fio:
        print("fio peer skipped: " + ("--no-fio given" if args.no_fio else "fio is not installed (apt-get install fio)"))

    numel = tensor_bytes // 4
    gen = torch.Generator().manual_seed(0)
    aligned = [aligned_empty(tensor_bytes).view(torch.float32) for _ in range(count)]
    for t in aligned:
        t.uniform_(generator=gen)
    unaligned = [torch.empty(numel + 1)[1:] for _ in range(2)]  # torch's allocator, 4 bytes off alignment
    for t in unaligned:
        t.uniform_(generator=gen)
    unaligned = [unaligned[i % 2] for i in range(count)]  # tensors i and i + 2 share memory and bytes

    cases: list[tuple[str, bool, Callable]] = []  # (name, every dir set?, run(dirs) -> (w, r))
    if have_fio:
        for jobs in (1,) if args.quick else (1, 4):
            cases.append(
                (
                    "fio" if jobs == 1 else f"fio numjobs={jobs}",
                    True,
                    lambda d, j=jobs: (fio_bandwidth(d, total, "write", j), fio_bandwidth(d, total, "read", j)),
                )
            )
    cases.append(("TensorStore", True, lambda d: store_bandwidth(d, aligned, config, checksum=False)))
    cases.append(("TensorStore crc32c", True, lambda d: store_bandwidth(d, aligned, config, checksum=True)))
    cases.append(("TensorStore unaligned", True, lambda d: store_bandwidth(d, unaligned, config, checksum=False)))
    sweep = [int(n) for n in args.thread_sweep.split(",")] if args.thread_sweep else []
    for threads in sweep:
        swept = dataclasses.replace(config, num_threads=threads)
        for checksum in (False, True):
            name = f"TensorStore{' crc32c' if checksum else ''} {threads} threads"
            cases.append((name, False, lambda d, c=swept, k=checksum: store_bandwidth(d, aligned, c, checksum=k)))
    cases.append(("torch.save/load", False, lambda d: file_bandwidth(d, aligned, torch_save, torch_load)))
    cases.append(("numpy tofile/fromfile", False, lambda d: file_bandwidth(d, aligned, numpy_save, numpy_load)))

    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for _ in range(args.repeats):
            for set_index, dirs in enumerate(dir_sets):
                for name, every_set, run in cases:
                    if set_index == 0 or every_set:
                        runs.setdefault((name, len(dirs)), []).append(run(dirs))
                        for d in dirs:
                            (d / "fio.dat").unlink(missing_ok=True)
        cache_method = drop_page_cache([])
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    for (name, ndirs), results in runs.items():
        write = statistics.median(w for w, _ in results) / GB
        read = statistics.median(r for _, r in results) / GB
        rows.append({"case": f"{name} x{ndirs}", "dirs": ndirs, "write_GBps": write, "read_GBps": read})
    for row in rows:
        fio = next((r for r in rows if r["case"] == f"fio x{row['dirs']}"), None)
        row["write_vs_fio"] = row["write_GBps"] / fio["write_GBps"] if fio else float("nan")
        row["read_vs_fio"] = row["read_GBps"] / fio["read_GBps"] if fio else float("nan")

    scaling = []
    for threads in sweep:
        plain = next(r for r in rows if r["case"] == f"TensorStore {threads} threads x1")
        checked = next(r for r in rows if r["case"] == f"TensorStore crc32c {threads} threads x1")
        scaling.append({
            "threads": threads,
            "write_GBps": plain["write_GBps"], "write_crc_GBps": checked["write_GBps"],
            "write_crc_ratio": checked["write_GBps"] / plain["write_GBps"],
            "read_GBps": plain["read_GBps"], "read_crc_GBps": checked["read_GBps"],
            "read_crc_ratio": checked["read_GBps"] / plain["read_GBps"],
        })  # fmt: skip
    if scaling:
        print(markdown_table(scaling))
    notes = (
        f"{count} tensors of {args.tensor_mib} MiB ({total / (1 << 30):.2f} GiB) per case, median of "
        f"{args.repeats} interleaved runs. Buffered peers: fsync counted in writes; page cache emptied before "
        f"reads by {cache_method}" + ("" if cache_method == "drop_caches" else " (drop_caches not permitted)")
        + " plus posix_fadvise(DONTNEED). O_DIRECT cases (fio, TensorStore) bypass the page cache. "
        + ("" if have_fio else "fio was not run, so there are no ratios. ")
        + f"Directories: {', '.join(str(r) for r in roots)}."
    )
    settings = {
        "total_bytes": total,
        "tensor_bytes": tensor_bytes,
        "repeats": args.repeats,
        "num_threads": config.num_threads,
        "block_size_bytes": config.block_size_bytes,
        "queue_depth": config.queue_depth,
        "fio": "direct=1 bs=1M iodepth=32 ioengine=libaio, one job per directory" if have_fio else None,
    }
    hashes = hash_bandwidth(aligned[0])
    print(markdown_table(hashes))
    return save_report(
        "bench_io", rows, settings=settings, plot_column="read_GBps", notes=notes, results_dir=args.results_dir,
        extra={"checksums": hashes, "thread_scaling": scaling},
    )  # fmt: skip


def hash_bandwidth(buffer: torch.Tensor, repeats: int = 5) -> list[dict]:
    """GB/s of the checksums over one buffer, best of ``repeats``, on one thread: the native CRC-32C (SSE4.2,
    and its table path), ``zlib.crc32`` (the peer), and a read of the buffer (``max`` over int64: the limit)."""
    data = buffer.view(torch.uint8)
    nbytes = data.numel()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = {
            "crc32c native (SSE4.2)": lambda: crc32c(data),
            "crc32c native (table)": lambda: _aio.crc32c(data.data_ptr(), nbytes, 0, False),
            "zlib.crc32": lambda: zlib.crc32(data.numpy()),
            "memory read (limit)": lambda: data.view(torch.int64).max(),
        }
        best = {}
        for _ in range(repeats):
            for name, run in cases.items():
                start = time.perf_counter()
                run()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    zlib_GBps = nbytes / best["zlib.crc32"] / GB
    return [
        {"case": name, "GBps": nbytes / s / GB, "vs_zlib": nbytes / s / GB / zlib_GBps} for name, s in best.items()
    ]


if __name__ == "__main__":
    main()
