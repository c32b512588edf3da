"""TensorStore round trips, concurrency, striping and space reuse, against references."""

from __future__ import annotations

import gc
import os
import random
import threading

import pytest
import torch
from conftest import SCRIPT_PRELOAD, ForkedRun, fork_server

from nvoffload.io import IOConfig, TensorStore, aligned_empty

MiB = 1 << 20

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def make_tensor(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values of ``dtype`` (every byte pattern matters, so no constant fills)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float64 if dtype != torch.complex64 else dtype).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def store(tmp_path):
    with TensorStore(tmp_path) as s:
        yield s


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "crc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_dtypes(tmp_path, dtype, checksum):
    x = make_tensor((3, 37, 5), dtype, seed=1)
    with TensorStore(tmp_path, checksum=checksum) as store:
        store.put("x", x).result()
        back = store.get("x").result()
    assert same(back, x)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 1, 24 * MiB + 5])
def test_round_trip_sizes(store, nbytes):
    x = make_tensor((nbytes,), torch.uint8, seed=nbytes)
    store.put("x", x).result()
    back = store.get("x").result()
    assert same(back, x)
    assert store.used_bytes == round_up(nbytes)


@pytest.mark.parametrize("shape", [(), (0, 5), (1,), (2, 3, 4, 5), (1025, 3)], ids=str)
def test_round_trip_shapes(store, shape):
    x = make_tensor(shape, torch.float32, seed=2)
    store.put("x", x).result()
    assert same(store.get("x").result(), x)


def test_round_trip_aligned_source_is_written_as_is(store):
    # A tensor already aligned in address and size takes the zero-copy path.
    x = aligned_empty(8 * MiB).view(torch.float32)
    x.copy_(make_tensor((2 * MiB,), torch.float32, seed=3))
    store.put("x", x).result()
    assert same(store.get("x").result(), x)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[::3, 1::2],
        lambda t: t[:, 5],
        lambda t: t[7:400:5].t(),
        lambda t: t[:1].expand(50, -1),
    ],
    ids=["transposed", "strided", "column", "sliced-transposed", "expanded"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_non_contiguous_sources(store, view, dtype):
    base = make_tensor((1000, 301), dtype, seed=4)
    x = view(base)
    assert not x.is_contiguous()
    store.put("x", x).result()
    back = store.get("x").result()
    assert back.is_contiguous()
    assert same(back, x.contiguous())


def _out_aligned(shape, dtype):
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return aligned_empty(nbytes).view(dtype).view(shape)


def _out_unaligned(shape, dtype):
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = torch.Size(shape).numel() * esize
    return aligned_empty(nbytes + 64)[64 - esize : 64 - esize + nbytes].view(dtype).view(shape)


def _out_transposed(shape, dtype):
    return torch.empty(tuple(reversed(shape)), dtype=dtype).t()


@pytest.mark.parametrize("make_out", [_out_aligned, _out_unaligned, _out_transposed],
                         ids=["aligned", "unaligned", "transposed"])
@pytest.mark.parametrize("shape", [(1024, 1024), (333, 7)], ids=["4MiB", "odd"])
def test_get_into_out(store, make_out, shape):
    x = make_tensor(shape, torch.float32, seed=5)
    store.put("x", x).result()
    out = make_out(shape, torch.float32).fill_(-1)
    if make_out is _out_unaligned:
        assert out.data_ptr() % 4096
    back = store.get("x", out=out).result()
    assert back is out
    assert same(out, x)


def test_get_out_of_wrong_type_raises(store):
    store.put("x", torch.zeros(10)).result()
    with pytest.raises(ValueError, match=r"get\('x'\): out has dtype torch.float64"):
        store.get("x", out=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="11 elements"):
        store.get("x", out=torch.zeros(11))


def test_quantized_tensors_are_refused_naming_the_dtype(tmp_path):
    """torch's byte view of a quantized tensor crashes when sliced: put refuses them before any I/O.

    In a subprocess, so that a crash fails this test rather than ending the test run.
    """
    script = (
        "import sys, warnings, torch\nfrom nvoffload.io import TensorStore\n"
        "warnings.simplefilter('ignore')  # quantized tensors are deprecated in torch\n"
        "with TensorStore(sys.argv[1]) as store:\n"
        "    for dtype in (torch.qint8, torch.quint8, torch.qint32):\n"
        "        q = torch.quantize_per_tensor(torch.randn(10), 0.1, 0, dtype)\n"
        "        try:\n"
        "            store.put('q', q)\n"
        "        except TypeError as exc:\n"
        "            print(exc)\n"
        "    print(len(store), store.used_bytes)\n"
    )
    proc = fork_server(SCRIPT_PRELOAD).run(f"-c {script}", [tmp_path], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [
        f"put('q'): quantized tensors ({dtype}) cannot be stored; "
        "store tensor.int_repr() and the quantization parameters instead"
        for dtype in ("torch.qint8", "torch.quint8", "torch.qint32")
    ] + ["0 0"]
    assert os.listdir(tmp_path) == []


def test_device_tensors_are_refused_naming_the_transfer_engine_before_taking_space(store):
    """The store is host-side: a tensor off the CPU (here on the meta device; CUDA in test_io_cuda) is refused with
    the way to move it, before it takes space (it was staged through the store's own slab, or refused as 'only CPU
    and CUDA tensors')."""
    with pytest.raises(ValueError, match=r"put\('m'\): the TensorStore holds host tensors, and this one is on meta: "
                       r"move it with TransferEngine\.save"):  # fmt: skip
        store.put("m", torch.empty(1000, device="meta"))
    assert "m" not in store and store.used_bytes == 0
    store.put("x", torch.ones(1000)).result()
    with pytest.raises(ValueError, match=r"get\('x'\): .* on meta: move it with TransferEngine\.load"):
        store.get("x", out=torch.empty(1000, device="meta"))
    assert torch.equal(store.get("x").result(), torch.ones(1000))


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "crc"])
def test_replace_existing_name(tmp_path, checksum):
    with TensorStore(tmp_path, checksum=checksum) as store:
        first = make_tensor((5000,), torch.float32, seed=6)
        second = make_tensor((3, 7), torch.bfloat16, seed=7)
        store.put("w", first).result()
        store.put("w", second).result()
        assert same(store.get("w").result(), second)
        assert len(store) == 1 and "w" in store
        assert store.used_bytes == 4096  # the older extent was freed
        store.put("w", first).result()
        assert same(store.get("w").result(), first)
        assert store.used_bytes == 20480


def test_get_before_put_result_sees_the_new_value(store):
    x = make_tensor((MiB,), torch.float32, seed=8)
    put = store.put("x", x)
    assert same(store.get("x").result(), x)
    put.result()


def test_pending_get_keeps_old_value_across_replace_and_delete(store):
    old = make_tensor((2 * MiB,), torch.float32, seed=9)
    new = make_tensor((2 * MiB,), torch.float32, seed=10)
    store.put("x", old).result()
    reading = store.get("x")
    store.put("x", new).result()
    assert same(reading.result(), old)
    reading = store.get("x")
    store.delete("x")
    assert same(reading.result(), new)
    assert "x" not in store and store.used_bytes == 0


def test_concurrent_random_ops_against_dict(tmp_path):
    """Four threads, 4000 puts/gets/deletes with futures left in flight, vs a dict."""
    shared = {f"shared{i}": make_tensor((1000 + 77 * i,), torch.float16, seed=100 + i) for i in range(4)}
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.int64]
    config = IOConfig(num_threads=4, block_size_bytes=64 << 10, stripe_min_bytes=32 << 10)
    failures: list[BaseException] = []

    def worker(store: TensorStore, thread: int, ops: int) -> dict:
        rng = random.Random(thread)
        reference: dict[str, torch.Tensor] = {}
        pending: list[tuple] = []  # (future, expected tensor or None for puts)

        def drain(keep: int) -> None:
            while len(pending) > keep:
                future, expected = pending.pop(0)
                value = future.result()
                if expected is not None and not same(value, expected):
                    raise AssertionError(f"thread {thread}: read back a wrong value")

        for step in range(ops):
            op = rng.random()
            name = f"t{thread}-{rng.randrange(12)}"
            if op < 0.4:
                numel = rng.choice([0, 1, rng.randrange(1, 3000), rng.randrange(1, 40000)])
                value = make_tensor((numel,), rng.choice(dtypes), seed=thread * 100000 + step)
                if rng.random() < 0.3 and numel > 1:
                    value = value[::2]  # non-contiguous source
                reference[name] = value.contiguous()
                pending.append((store.put(name, value), None))
            elif op < 0.75:
                if name in reference:
                    pending.append((store.get(name), reference[name]))
                else:
                    with pytest.raises(KeyError):
                        store.get(name)
            elif op < 0.85:
                shared_name = rng.choice(sorted(shared))
                pending.append((store.get(shared_name), shared[shared_name]))
            elif name in reference:
                store.delete(name)
                del reference[name]
            else:
                with pytest.raises(KeyError):
                    store.delete(name)
            drain(rng.randrange(8))
        drain(0)
        return reference

    _mkdirs(tmp_path)
    with TensorStore([tmp_path / "a", tmp_path / "b"], checksum=True, config=config) as store:
        for name, value in shared.items():
            store.put(name, value).result()
        results: dict[int, dict] = {}

        def run(thread: int) -> None:
            try:
                results[thread] = worker(store, thread, 1000)
            except BaseException as exc:  # reported by the main thread
                failures.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        expected = dict(shared)
        for reference in results.values():
            expected.update(reference)
        assert len(store) == len(expected)
        for name, value in expected.items():
            assert same(store.get(name).result(), value), name
        assert store.used_bytes == sum(striped_bytes(v.numel() * v.element_size(), 32 << 10) for v in expected.values())


def round_up(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def striped_bytes(nbytes: int, stripe_min_bytes: int) -> int:
    """Aligned bytes a tensor takes in a two-directory store: halves when striped."""
    if nbytes < stripe_min_bytes:
        return round_up(nbytes)
    half = round_up(-(-nbytes // 2))
    return half + round_up(nbytes - half)


def _mkdirs(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


def _file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_striping_over_two_dirs(tmp_path):
    _mkdirs(tmp_path)
    with TensorStore([tmp_path / "a", tmp_path / "b"]) as store:
        a_file, b_file = store.swap_files
        assert os.path.dirname(a_file) == str(tmp_path / "a") and os.path.dirname(b_file) == str(tmp_path / "b")
        big = make_tensor((16 * MiB + 3,), torch.uint8, seed=11)  # >= stripe_min_bytes: split in two
        store.put("big", big).result()
        half = 8 * MiB + 4096  # round_up(ceil(size / 2))
        rest = 8 * MiB  # round_up(size - half)
        assert os.path.getsize(a_file) == half
        assert os.path.getsize(b_file) == rest
        assert store.capacity_bytes == half + rest
        raw = big.numpy().tobytes()
        assert _file_bytes(a_file) == raw[:half]
        assert _file_bytes(b_file)[: len(raw) - half] == raw[half:]

        # Small tensors are not split: they go to the files in turn.
        smalls = [make_tensor((4096,), torch.uint8, seed=20 + i) for i in range(4)]
        for i, s in enumerate(smalls):
            store.put(f"s{i}", s).result()
        assert os.path.getsize(a_file) == half + 2 * 4096
        assert os.path.getsize(b_file) == rest + 2 * 4096
        a, b = _file_bytes(a_file), _file_bytes(b_file)
        assert a[half : half + 4096] == smalls[0].numpy().tobytes()
        assert b[rest : rest + 4096] == smalls[1].numpy().tobytes()
        assert a[half + 4096 :] == smalls[2].numpy().tobytes()
        assert b[rest + 4096 :] == smalls[3].numpy().tobytes()
        assert same(store.get("big").result(), big)
        for i, s in enumerate(smalls):
            assert same(store.get(f"s{i}").result(), s)


def test_reuse_of_freed_space_without_growth(tmp_path):
    _mkdirs(tmp_path)
    with TensorStore([tmp_path / "a", tmp_path / "b"], config=IOConfig(stripe_min_bytes=64 << 10)) as store:
        # Four small tensors (round-robin, an even count) and four striped ones.
        sizes = [100, 70000, 5000, 300000, 4097, 200000, 65536, 1]
        values = {f"t{i}": make_tensor((n,), torch.uint8, seed=i) for i, n in enumerate(sizes)}
        for name, value in values.items():
            store.put(name, value).result()
        capacity = store.capacity_bytes
        assert capacity == sum(striped_bytes(n, 64 << 10) for n in sizes)
        sizes_on_disk = [os.path.getsize(p) for p in store.swap_files]
        for cycle in range(4):
            for name in values:
                store.delete(name)
            assert store.used_bytes == 0
            for name, value in values.items():
                store.put(name, value).result()
            assert store.capacity_bytes == capacity, f"grew in cycle {cycle}"
        # Replacing a tensor needs room for the new copy before the old is freed:
        # after the first replacement the two extents alternate without growth.
        store.put("t3", values["t3"]).result()
        grown = store.capacity_bytes
        for _ in range(4):
            store.put("t3", values["t3"]).result()
            assert store.capacity_bytes == grown
        assert grown - capacity == striped_bytes(300000, 64 << 10)
        assert [os.path.getsize(p) for p in store.swap_files] == [
            size + striped_bytes(300000, 64 << 10) // 2 for size in sizes_on_disk
        ]
        for name, value in values.items():
            assert same(store.get(name).result(), value)


def test_capacity_preallocates_and_full_store_raises_enospc(tmp_path):
    _mkdirs(tmp_path)
    capacity = 3 * MiB + 100
    with TensorStore([tmp_path / "a", tmp_path / "b"], capacity_bytes=capacity) as store:
        share = 3 * MiB // 2 + 4096  # round_up(ceil(capacity / 2))
        for path in store.swap_files:
            st = os.stat(path)
            assert st.st_size == share
            assert st.st_blocks * 512 >= share  # really allocated, not sparse
        assert store.capacity_bytes == 2 * share
        store.put("a", torch.ones(MiB, dtype=torch.uint8)).result()  # small: one file each
        store.put("b", torch.ones(MiB, dtype=torch.uint8)).result()
        failed = store.put("c", torch.ones(MiB, dtype=torch.uint8))
        with pytest.raises(OSError, match=r"tensor 'c'.* is full: 1048576 bytes needed") as info:
            failed.result()
        assert info.value.errno == 28  # ENOSPC
        assert "c" not in store
        store.delete("a")
        store.put("c", torch.full((MiB,), 3, dtype=torch.uint8)).result()
        assert store.capacity_bytes == 2 * share
        assert int(store.get("c").result().sum()) == 3 * MiB


def test_swap_files_removed_at_close(tmp_path):
    store = TensorStore(tmp_path, capacity_bytes=MiB)
    (path,) = store.swap_files
    assert os.path.exists(path)
    store.put("x", torch.ones(10)).result()
    store.close()
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []
    store.close()  # idempotent


def test_swap_files_removed_without_close(tmp_path):
    """A store dropped without close(), or alive when the interpreter exits, still removes its files."""
    store = TensorStore(tmp_path)
    store.put("x", torch.ones(10)).result()
    del store
    gc.collect()
    assert os.listdir(tmp_path) == []
    script = (
        "import sys, torch\nfrom nvoffload.io import TensorStore\n"
        "store = TensorStore(sys.argv[1])\nstore.put('x', torch.ones(1 << 20)).result()\n"
        "assert sorted(__import__('os').listdir(sys.argv[1]))[-1] == 'nvoffload.lock'\n"
        "assert sum(f.endswith('.swap') for f in __import__('os').listdir(sys.argv[1])) == 1\n"
    )
    assert fork_server(SCRIPT_PRELOAD).run(f"-c {script}", [tmp_path]).returncode == 0
    assert os.listdir(tmp_path) == []


def test_warns_about_swap_files_of_killed_processes(tmp_path):
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # above pid_max: no process can have it
    orphan = tmp_path / f"nvoffload-{dead}-0123456789ab.swap"
    orphan.write_bytes(b"\0" * 4096)
    (tmp_path / f"nvoffload-{os.getpid()}-0123456789ab.swap").write_bytes(b"")  # this process: not an orphan
    with pytest.warns(UserWarning, match=rf"1 swap file\(s\) .* no longer run .*nvoffload-{dead}-0123456789ab\.swap"):
        TensorStore(tmp_path).close()
    assert orphan.exists()  # only named, never deleted


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_adjacent_freed_extents_coalesce_for_a_larger_tensor(store, order):
    for name in "abc":
        store.put(name, torch.full((4096,), ord(name), dtype=torch.uint8)).result()
    capacity = store.capacity_bytes
    for name in order:  # freed after, then before, its neighbour (or the other way)
        store.delete(name)
    store.put("d", torch.full((8192,), 7, dtype=torch.uint8)).result()
    assert store.capacity_bytes == capacity  # one range of 8 KiB, not two of 4 KiB: no growth
    assert int(store.get("d").result().sum()) == 7 * 8192
    assert int(store.get("c").result()[0]) == ord("c")


def test_non_contiguous_cpu_tensors_round_trip(store):
    x = make_tensor((1000, 3), torch.float32, seed=3)
    store.put("x", x).result()
    out = torch.empty(3, 1000).t()  # non-contiguous: read into an aligned buffer, then copied
    assert store.get("x", out=out).result() is out and same(out, x)
    store.put("xt", x.t()).result()
    assert same(store.get("xt").result(), x.t().contiguous())


def test_a_read_does_not_wait_for_the_lock_behind_a_write_blocked_in_a_full_native_queue(tmp_path):
    """The native engine's submit blocks while its queue is full; the store submitted under its lock, so a read that
    compute waits for queued behind the background writes for the lock, not just for the disk."""
    with TensorStore(tmp_path) as store:
        x = make_tensor((5000,), torch.float32, seed=8)
        store.put("r", x).result()
        native_submit = store._engine.submit
        blocked, release = threading.Event(), threading.Event()

        def submit(file, buffer, offset, *, write, **kwargs):
            if write:  # as the native submit does when 128 blocks are queued
                blocked.set()
                release.wait(60)
            return native_submit(file, buffer, offset, write=write, **kwargs)

        store._engine.submit = submit
        writer = threading.Thread(target=lambda: store.put("w", torch.ones(8192)).result())
        writer.start()
        try:
            assert blocked.wait(10)
            read = []
            reader = threading.Thread(target=lambda: read.append(store.get("r").result(timeout=30)))
            reader.start()
            reader.join(10)
            assert read and same(read[0], x)  # done while the write is still blocked in its submit
            assert "w" in store and "r" in store  # neither waits for the lock either
        finally:
            release.set()
            writer.join(30)
        assert torch.equal(store.get("w").result(), torch.ones(8192))


def test_sigterm_unwinds_and_removes_the_swap_file_as_sigint_does(tmp_path):
    """SIGTERM (a job scheduler's kill, ``kill PID``) ended the process on the spot and left the swap file; it now
    exits 143 through the ordinary unwinding, which removes it."""
    child = _holder(tmp_path)
    assert any(p.suffix == ".swap" for p in tmp_path.iterdir())
    child.terminate()
    assert child.wait(60) == 143
    assert not list(tmp_path.iterdir())


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path):
    import signal

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        TensorStore(tmp_path).close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


_HOLD_THE_DIRECTORY = """
import sys, time, torch
from nvoffload.io import TensorStore
store = TensorStore(sys.argv[1])
store.put("x", torch.ones(1 << 18)).result()
print("ready", flush=True)
time.sleep(120)
"""


def _holder(directory) -> ForkedRun:
    """A process holding ``directory`` (``python -c`` forked from the session's server), once it said so."""
    return fork_server(SCRIPT_PRELOAD).start_saying(f"-c {_HOLD_THE_DIRECTORY}", [directory], "ready")


def test_a_directory_another_live_process_holds_is_refused_and_a_subdirectory_works(tmp_path):
    import errno

    from nvoffload.io.ownership import SwapDirectoryInUse

    child = _holder(tmp_path)
    try:
        with pytest.raises(SwapDirectoryInUse, match=rf"in use by process {child.pid} on .*\(a subdirectory will do\)") as info:
            TensorStore(tmp_path)
        assert info.value.errno == errno.EBUSY
        (tmp_path / "mine").mkdir()
        TensorStore(tmp_path / "mine").close()
    finally:
        child.kill()
        child.wait()


def test_a_killed_processs_lock_and_swap_files_are_cleaned_by_the_next_store(tmp_path):
    """SIGKILL leaves the lock and the swap file; the next store on that directory removes both, saying so."""
    child = _holder(tmp_path)
    child.kill()
    child.wait()
    left = sorted(os.listdir(tmp_path))
    assert left[-1] == "nvoffload.lock" and left[0].startswith(f"nvoffload-{child.pid}-")
    with pytest.warns(UserWarning, match=rf"removed 1 swap file\(s\) .* left by process {child.pid}, which no longer runs"):
        store = TensorStore(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(p) for p in store.swap_files] + ["nvoffload.lock"])
    store.close()
    assert os.listdir(tmp_path) == []


def test_stores_of_one_process_share_a_directory_and_the_last_one_unlocks_it(tmp_path):
    a, b = TensorStore(tmp_path), TensorStore(tmp_path)
    a.close()
    assert "nvoffload.lock" in os.listdir(tmp_path)
    b.close()
    assert os.listdir(tmp_path) == []
