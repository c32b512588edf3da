"""The raw I/O engine and aligned buffers: bytes on disk checked against plain Python file reads."""

from __future__ import annotations

import os

import pytest
import torch

from nvoffload.transfer import Future
from nvoffload.io import IOConfig, IOEngine, StoreIOError, aligned_empty
from nvoffload.io.checksum import crc32c

KiB = 1 << 10
MiB = 1 << 20
SMALL_BLOCKS = IOConfig(num_threads=4, block_size_bytes=16 * KiB, queue_depth=4)


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
    return buf


@pytest.fixture
def engine():
    with IOEngine(SMALL_BLOCKS) as e:
        yield e


@pytest.fixture
def data_file(engine, tmp_path):
    f = engine.open(tmp_path / "data", create=True)
    yield f
    engine.close_file(f)


@pytest.mark.parametrize("nbytes", [4 * KiB, 16 * KiB, 20 * KiB, 1000 * KiB], ids=["1page", "1block", "partial", "63blocks"])
def test_write_then_read_at_offsets_split_in_blocks(engine, data_file, nbytes):
    assert data_file.direct  # ext4 / tmpfs of this machine take O_DIRECT
    offset = 12 * KiB
    src = random_bytes(nbytes, seed=nbytes)
    fut = engine.pwrite(data_file, src, offset)
    assert isinstance(fut, Future)
    assert fut.result() is None and fut.done()
    with open(data_file.path, "rb") as f:  # what a plain reader sees
        raw = f.read()
    assert len(raw) == offset + nbytes
    assert raw[:offset] == bytes(offset)  # the hole before the offset
    assert raw[offset:] == src.numpy().tobytes()
    back = aligned_empty(nbytes)
    engine.pread(data_file, back, offset).result()
    assert torch.equal(back, src)


def test_many_requests_in_flight_through_a_small_queue(engine, data_file):
    """64 requests of 3 blocks each through a queue of 4: back-pressure, nothing lost."""
    chunk = 48 * KiB
    srcs = [random_bytes(chunk, seed=i) for i in range(64)]
    writes = [engine.pwrite(data_file, s, i * chunk) for i, s in enumerate(srcs)]
    for w in writes:
        w.result()
    backs = [aligned_empty(chunk) for _ in srcs]
    reads = [engine.pread(data_file, b, i * chunk) for i, b in enumerate(backs)]
    for r, b, s in zip(reversed(reads), reversed(backs), reversed(srcs)):  # any completion order
        r.result(timeout=60)
        assert torch.equal(b, s)


def test_unaligned_size_or_offset_is_refused(engine, data_file):
    buf = aligned_empty(8 * KiB + 64)
    with pytest.raises(ValueError, match="multiples of 4 KiB"):
        engine.pwrite(data_file, buf[: 4 * KiB + 1], 0)  # size
    with pytest.raises(ValueError, match="offset 512"):
        engine.pwrite(data_file, buf[: 4 * KiB], 512)
    with pytest.raises(ValueError, match="smaller than the buffer"):
        engine.submit(data_file, buf[: 8 * KiB], 0, write=True, nbytes=4 * KiB)
    with pytest.raises(ValueError, match="contiguous CPU"):
        engine.pwrite(data_file, aligned_empty(8 * KiB).view(2, -1).t(), 0)


@pytest.mark.parametrize("shift", [1, 64, 2048])
def test_unaligned_and_padded_buffers_bounce_in_the_io_threads(engine, data_file, shift):
    """Any address, a size that ends mid-block: padding written as zeros, read back dropped."""
    nbytes = 3 * MiB + 123  # several blocks, the last one partial
    raw = random_bytes(nbytes + shift, seed=shift)
    src = raw[shift:]
    assert src.data_ptr() % 4096 != 0
    padded = -(-nbytes // (4 * KiB)) * 4 * KiB
    Future([engine.submit(data_file, src, 0, write=True, nbytes=padded)]).result(timeout=60)
    with open(data_file.path, "rb") as f:
        on_disk = f.read(padded)
    assert on_disk[:nbytes] == src.numpy().tobytes()
    assert on_disk[nbytes:] == bytes(padded - nbytes)

    back_raw = torch.full((nbytes + shift + 1,), 0xAB, dtype=torch.uint8)
    back = back_raw[shift : shift + nbytes]
    Future([engine.submit(data_file, back, 0, write=False, nbytes=padded)]).result(timeout=60)
    assert torch.equal(back, src)
    assert int(back_raw[shift + nbytes]) == 0xAB  # nothing written past the buffer
    assert torch.all(back_raw[:shift] == 0xAB)


def test_faults_hit_only_the_operations_they_apply_to(engine, data_file):
    src = random_bytes(64 * KiB, seed=1)  # 4 blocks
    engine.pwrite(data_file, src, 0).result()
    back = aligned_empty(64 * KiB)

    engine.inject_fault("enospc")  # armed for writes: reads pass untouched
    engine.pread(data_file, back, 0).result()
    assert torch.equal(back, src)
    with pytest.raises(StoreIOError) as info:
        engine.pwrite(data_file, src, 0).result()
    assert info.value.errno == 28 and info.value.call == "pwrite"
    engine.pwrite(data_file, src, 0).result()  # one shot

    engine.inject_fault("short_read")  # armed for reads: writes pass
    engine.pwrite(data_file, src, 64 * KiB).result()
    with pytest.raises(StoreIOError, match=r"short read.*at offset \d+ of .*data") as info:
        engine.pread(data_file, back, 0).result()
    # the first of the read's 4 blocks to run fails, on whichever engine thread starts first (under load not
    # always block 0's): the error names that block's own offset
    assert info.value.offset in (0, 16 * KiB, 32 * KiB, 48 * KiB) and info.value.filename == data_file.path
    assert f"at offset {info.value.offset} of" in str(info.value)

    engine.inject_fault("eio", after_ops=2)  # one block of this read fails (the third to run)
    with pytest.raises(StoreIOError, match="Input/output error") as info:
        engine.pread(data_file, back, 0).result()
    assert info.value.errno == 5
    assert info.value.offset in (0, 16 * KiB, 32 * KiB, 48 * KiB)  # the failing block's own offset
    engine.pread(data_file, back, 64 * KiB).result()
    assert torch.equal(back, src)


def test_read_past_the_end_of_the_file_is_a_short_read(engine, data_file):
    engine.pwrite(data_file, random_bytes(4 * KiB, seed=2), 0).result()
    with pytest.raises(StoreIOError, match="short read") as info:
        engine.pread(data_file, aligned_empty(8 * KiB), 0).result()
    assert info.value.offset == 0


def test_closed_engine_refuses_new_io(tmp_path):
    engine = IOEngine(SMALL_BLOCKS)
    f = engine.open(tmp_path / "x", create=True)
    pending = engine.pwrite(f, random_bytes(256 * KiB, seed=3), 0)
    engine.close()  # drains what is queued
    assert pending.done()
    pending.result()
    assert os.path.getsize(tmp_path / "x") == 256 * KiB
    with pytest.raises(RuntimeError, match="IOEngine is closed"):
        engine.pwrite(f, aligned_empty(4 * KiB), 0)
    engine.close()
    engine.close_file(f)


def test_open_existing_file_with_create_fails(engine, tmp_path):
    (tmp_path / "taken").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        engine.open(tmp_path / "taken", create=True)
    with pytest.raises(FileNotFoundError):
        engine.open(tmp_path / "missing")


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 1 << 20])
def test_aligned_empty(nbytes):
    buf = aligned_empty(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    assert buf.data_ptr() % 4096 == 0
    if nbytes % 8 == 0:
        assert buf.view(torch.float64).numel() == nbytes // 8


def test_aligned_empty_rejects_negative():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        aligned_empty(-1)


@pytest.mark.parametrize("shift", [0, 5], ids=["aligned", "bounced"])
def test_the_io_threads_checksum_the_blocks_they_move(engine, data_file, shift):
    """With checksum=True each I/O thread computes its blocks' CRC-32C; the request's CRC is joined from them and
    equals the CRC of the buffer's bytes (padding excluded), for a write and for the read of the same bytes."""
    nbytes = 3 * MiB + 123  # 193 blocks of 16 KiB, the last partial, padded to 4 KiB
    src = random_bytes(nbytes + shift, seed=7)[shift:]
    padded = -(-nbytes // (4 * KiB)) * 4 * KiB
    write = engine.submit(data_file, src, 0, write=True, nbytes=padded, checksum=True)
    Future([write]).result(timeout=60)
    assert write.crc() == crc32c(src)
    back = torch.zeros(nbytes + shift, dtype=torch.uint8)[shift:]
    read = engine.submit(data_file, back, 0, write=False, nbytes=padded, checksum=True)
    Future([read]).result(timeout=60)
    assert torch.equal(back, src) and read.crc() == crc32c(src)
    with open(data_file.path, "r+b") as f:  # one flipped bit on disk: the read's CRC differs
        f.seek(2 * MiB + 17)
        byte = f.read(1)[0]
        f.seek(2 * MiB + 17)
        f.write(bytes([byte ^ 0x10]))
    read = engine.submit(data_file, back, 0, write=False, nbytes=padded, checksum=True)
    Future([read]).result(timeout=60)
    assert read.crc() != crc32c(src) and read.crc() == crc32c(back)


def test_a_request_without_checksum_has_no_crc(engine, data_file):
    part = engine.submit(data_file, random_bytes(16 * KiB, seed=1), 0, write=True)
    Future([part]).result(timeout=60)
    with pytest.raises(ValueError, match="without checksum=True"):
        part.crc()
