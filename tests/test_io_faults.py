"""Bad input and faults of the TensorStore: each raises a clear error naming tensor, file and offset."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess

import pytest
import torch

from nvoffload.io import ChecksumError, DirectIO, IOConfig, IOEngine, StoreIOError, TensorStore

MiB = 1 << 20


@contextlib.contextmanager
def mounted(path, fstype: str, options: str | None = None):
    """Mount a small file system at ``path`` for the test; skip where mounting is not allowed."""
    path.mkdir(exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(path)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount {fstype}: {exc}")
    if result.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)


def pattern(nbytes: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)


# -- bad directories and capacity -----------------------------------------------------------


def test_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"swap directory {missing} does not exist"):
        TensorStore(missing)


def test_path_that_is_a_file(tmp_path):
    file = tmp_path / "file"
    file.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match=f"swap directory {file} is not a directory"):
        TensorStore(file)


def test_read_only_dir(tmp_path):
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=1M") as ro:
        with pytest.raises(PermissionError, match=f"swap directory {ro} is not writable"):
            TensorStore(ro)
        with pytest.raises(PermissionError, match="not writable"):
            TensorStore([tmp_path, ro])
    assert sorted(os.listdir(tmp_path)) == ["ro"]  # nothing written in the good directory


def test_too_little_free_space_for_capacity(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    capacity = free + (1 << 30)
    needed = -(-capacity // 4096) * 4096
    with pytest.raises(OSError, match=f"needs {needed} bytes .* only [0-9]+ bytes free") as info:
        TensorStore(tmp_path, capacity_bytes=capacity)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_too_little_free_space_in_second_dir_writes_nothing(tmp_path):
    (tmp_path / "big").mkdir()
    with mounted(tmp_path / "small", "tmpfs", "size=1M") as small:
        with pytest.raises(OSError, match=f"swap directory {small} needs 2097152 bytes .* only [0-9]+ bytes free"):
            TensorStore([tmp_path / "big", small], capacity_bytes=4 * MiB)
        assert os.listdir(tmp_path / "big") == []
        assert os.listdir(small) == []


def test_disk_filling_up(tmp_path):
    """A growing store on an 8 MiB file system: the put that does not fit fails on its future."""
    with mounted(tmp_path / "small", "tmpfs", "size=8M") as small, TensorStore(small) as store:
        a, b = pattern(3 * MiB, 1), pattern(3 * MiB, 2)
        store.put("a", a).result()
        store.put("b", b).result()
        failed = store.put("c", pattern(3 * MiB, 3))
        with pytest.raises(StoreIOError, match=f"tensor 'c' failed .*{store.swap_files[0]}.*No space left") as info:
            failed.result()
        assert info.value.errno == errno.ENOSPC
        assert info.value.tensor == "c" and info.value.filename == store.swap_files[0]
        assert "c" not in store
        # Still usable: what was stored reads back, and after a delete the space is reused.
        assert torch.equal(store.get("a").result(), a)
        capacity = store.capacity_bytes
        store.put("small", pattern(MiB, 4)).result()
        assert torch.equal(store.get("small").result(), pattern(MiB, 4))
        store.delete("a")
        c = pattern(2 * MiB, 5)
        store.put("c", c).result()
        assert torch.equal(store.get("c").result(), c)
        assert torch.equal(store.get("b").result(), b)
        assert store.capacity_bytes == capacity + MiB  # "small" grew the file; "c" reused "a"'s space


# -- injected faults ------------------------------------------------------------------------


def test_injected_enospc_on_write_names_tensor_file_offset(tmp_path):
    # One thread and 1 MiB blocks: the blocks run in order, so the third one fails.
    with TensorStore(tmp_path, config=IOConfig(num_threads=1, block_size_bytes=MiB)) as store:
        old = pattern(8192, 1)
        store.put("w", old).result()
        used = store.used_bytes
        store.inject_fault("enospc", after_ops=2)
        failed = store.put("w", pattern(4 * MiB, 2))
        (path,) = store.swap_files
        offset = 8192 + 2 * MiB
        with pytest.raises(StoreIOError, match=f"pwrite of tensor 'w' failed at offset {offset} of {path}") as info:
            failed.result()
        err = info.value
        assert (err.errno, err.tensor, err.filename, err.offset) == (errno.ENOSPC, "w", path, offset)
        with pytest.raises(StoreIOError):  # the same error again
            failed.result()
        # Nothing lost: the older value under the same name is still there, its space only.
        assert torch.equal(store.get("w").result(), old)
        assert store.used_bytes == used
        new = pattern(4 * MiB, 3)
        store.put("w", new).result()  # the fault was one shot
        assert torch.equal(store.get("w").result(), new)


def test_injected_eio_on_read_then_recovers(tmp_path):
    with TensorStore(tmp_path) as store:
        x = pattern(3 * MiB + 5, 4)
        store.put("x", x).result()
        (path,) = store.swap_files
        store.inject_fault("eio")
        with pytest.raises(StoreIOError, match=f"pread of tensor 'x' failed at offset [0-9]+ of {path}: Input/output error") as info:
            store.get("x").result()
        assert info.value.errno == errno.EIO and info.value.tensor == "x"
        assert info.value.offset in {0, MiB, 2 * MiB, 3 * MiB}  # one of the 1 MiB blocks
        assert torch.equal(store.get("x").result(), x)


def test_injected_eio_on_write(tmp_path):
    with TensorStore(tmp_path, checksum=True) as store:
        store.inject_fault("eio")
        failed = store.put("x", pattern(5000, 5))
        with pytest.raises(StoreIOError, match="pwrite of tensor 'x' failed at offset 0") as info:
            failed.result()
        assert info.value.errno == errno.EIO
        assert "x" not in store and store.used_bytes == 0
        with pytest.raises(KeyError, match="'x'"):
            store.get("x")


def test_injected_short_read(tmp_path):
    with TensorStore(tmp_path) as store:
        store.put("first", pattern(4096, 6)).result()
        x = pattern(10000, 7)
        store.put("x", x).result()
        store.inject_fault("short_read")
        (path,) = store.swap_files
        with pytest.raises(StoreIOError, match=f"short read.* of tensor 'x' failed at offset 4096 of {path}") as info:
            store.get("x", out=torch.empty_like(x)).result()
        assert info.value.errno == errno.ENODATA and info.value.offset == 4096
        assert torch.equal(store.get("x").result(), x)


def test_injected_fault_of_unknown_kind(tmp_path):
    with TensorStore(tmp_path) as store, pytest.raises(ValueError, match="unknown fault 'boom'"):
        store.inject_fault("boom")


def test_checksum_mismatch_from_flipped_byte(tmp_path):
    with TensorStore(tmp_path, checksum=True) as store:
        store.put("pad", torch.zeros(5000, dtype=torch.uint8)).result()
        x = pattern(20000, 8)
        store.put("x", x).result()
        (path,) = store.swap_files
        with open(path, "rb") as f:
            offset = f.read().find(x.numpy().tobytes())
        assert offset == 8192  # after the first tensor's aligned extent
        fd = os.open(path, os.O_RDWR)
        try:
            flipped = bytes([x[1234].item() ^ 0x10])
            os.pwrite(fd, flipped, offset + 1234)
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumError, match=f"checksum mismatch for tensor 'x' at offset 8192 of {path}") as info:
            store.get("x").result()
        err = info.value
        assert isinstance(err, StoreIOError)
        assert (err.tensor, err.filename, err.offset, err.errno) == ("x", path, 8192, errno.EIO)
        assert torch.equal(store.get("pad").result(), torch.zeros(5000, dtype=torch.uint8))


def test_flipped_byte_without_checksum_comes_back(tmp_path):
    # The same corruption goes unnoticed without checksums: the check above is what catches it.
    with TensorStore(tmp_path, checksum=False) as store:
        x = pattern(20000, 8)
        store.put("x", x).result()
        (path,) = store.swap_files
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([x[1234].item() ^ 0x10]), 1234)
        finally:
            os.close(fd)
        back = store.get("x").result()
        assert int((back != x).sum()) == 1 and back[1234].item() == x[1234].item() ^ 0x10


# -- O_DIRECT refusal -----------------------------------------------------------------------


def test_direct_io_refusal_falls_back_with_one_warning(tmp_path):
    IOEngine.inject_direct_refusal()
    with pytest.warns(RuntimeWarning, match=f"file system of {tmp_path} refuses O_DIRECT") as record:
        store = TensorStore(tmp_path)
    with store:
        assert len(record) == 1
        assert store.direct_io is False
        for n in (1, 4097, 3 * MiB + 1):
            x = pattern(n, n)
            store.put(f"x{n}", x).result()
            assert torch.equal(store.get(f"x{n}").result(), x)
        assert sorted(os.listdir(tmp_path))[:-1] == [os.path.basename(p) for p in store.swap_files]  # and the lock


def test_direct_io_on_raises_where_refused(tmp_path):
    IOEngine.inject_direct_refusal()
    with pytest.raises(OSError, match="O_DIRECT") as info:
        TensorStore(tmp_path, config=IOConfig(direct_io=DirectIO.ON))
    assert info.value.errno == errno.EINVAL
    assert os.listdir(tmp_path) == []


def test_real_file_system_refusing_direct_io(tmp_path):
    """ramfs refuses O_DIRECT after creating the file: the fallback must not trip on it."""
    with mounted(tmp_path / "ram", "ramfs") as ram:
        with pytest.warns(RuntimeWarning, match="refuses O_DIRECT") as record:
            store = TensorStore(ram)
        with store:
            assert len(record) == 1 and store.direct_io is False
            x = pattern(10001, 9)
            store.put("x", x).result()
            assert torch.equal(store.get("x").result(), x)
        assert os.listdir(ram) == []
        with pytest.raises(OSError, match="O_DIRECT"):
            TensorStore(ram, config=IOConfig(direct_io=DirectIO.ON))
        assert os.listdir(ram) == []


def test_direct_io_off_uses_buffered_io(tmp_path):
    with TensorStore(tmp_path, config=IOConfig(direct_io=DirectIO.OFF)) as store:
        assert store.direct_io is False
        x = pattern(7777, 10)
        store.put("x", x).result()
        assert torch.equal(store.get("x").result(), x)


# -- names, closed store, bad arguments ---------------------------------------------------------


def test_name_never_written(tmp_path):
    with TensorStore(tmp_path) as store:
        with pytest.raises(KeyError, match="no tensor named 'ghost'"):
            store.get("ghost")
        with pytest.raises(KeyError, match="'ghost'"):
            store.delete("ghost")
        store.put("x", torch.ones(3)).result()
        store.delete("x")
        with pytest.raises(KeyError, match="no tensor named 'x'"):
            store.get("x")


def test_closed_store(tmp_path):
    store = TensorStore(tmp_path)
    store.put("x", torch.ones(3)).result()
    store.close()
    for call in (lambda: store.put("y", torch.ones(3)), lambda: store.get("x"), lambda: store.delete("x")):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert os.listdir(tmp_path) == []


def test_close_waits_for_io_in_flight(tmp_path):
    store = TensorStore(tmp_path)
    x = pattern(8 * MiB, 11)
    store.put("x", x).result()
    reading = store.get("x")
    writing = store.put("y", x)
    store.close()
    assert torch.equal(reading.result(), x)
    writing.result()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_threads": 0}, "num_threads must be a positive int"),
        ({"queue_depth": -1}, "queue_depth must be a positive int"),
        ({"num_threads": 2.5}, "num_threads must be a positive int"),
        ({"block_size_bytes": 1000}, "block_size_bytes must be a positive multiple of 4096"),
        ({"block_size_bytes": 0}, "block_size_bytes must be a positive multiple of 4096"),
        ({"stripe_min_bytes": 4097}, "stripe_min_bytes must be a positive multiple of 4096"),
        ({"direct_io": "auto"}, "direct_io must be a DirectIO"),
    ],
)
def test_io_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IOConfig(**kwargs)


def test_store_argument_validation(tmp_path):
    with pytest.raises(ValueError, match="at least one swap directory"):
        TensorStore([])
    with pytest.raises(ValueError, match="capacity_bytes must be a non-negative int"):
        TensorStore(tmp_path, capacity_bytes=-1)
    with TensorStore(tmp_path) as store:
        with pytest.raises(TypeError, match=r"put\('x'\) needs a torch.Tensor, got list"):
            store.put("x", [1, 2])
        with pytest.raises(ValueError, match="only dense"):
            store.put("x", torch.eye(3).to_sparse())
        assert len(store) == 0 and store.used_bytes == 0
