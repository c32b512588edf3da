"""The staging slab's pieces, on the CPU stand-in: copies land late, so a missing wait reads stale bytes."""


import pytest
import torch

from nvoffload.io.checksum import crc32c
from nvoffload.io.staging import Stager
from nvoffload.transfer import Future

KiB = 1 << 10


@pytest.fixture
def stager(monkeypatch):
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "3000")  # every stand-in copy lands 3 ms late
    s = Stager(16 * KiB, "test staging")
    yield s
    s.close()


class _Disk:
    """A file as a byte tensor; records the pieces moved."""

    def __init__(self, nbytes: int):
        self.bytes = torch.zeros(nbytes, dtype=torch.uint8)
        self.pieces: list[tuple[int, int]] = []

    def write(self, buf: torch.Tensor, at: int) -> Future:
        self.pieces.append((at, buf.numel()))
        self.bytes[at : at + buf.numel()] = buf
        return Future.completed()

    def read(self, buf: torch.Tensor, at: int) -> Future:
        self.pieces.append((at, buf.numel()))
        buf.copy_(self.bytes[at : at + buf.numel()])
        return Future.completed()


def _run(job) -> None:
    Future([job], what="test").result()


def test_pieces_of_half_the_slab_round_trip_through_late_copies(stager):
    n = 45_001
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    disk = _Disk(n)
    job = stager.write(data, stager.ready_event(data, None), disk.write, checksum=True, what="data")
    _run(job)
    assert torch.equal(disk.bytes, data)  # each piece written only after its copy landed
    assert job.value == crc32c(data)
    assert disk.pieces == [(at, min(8 * KiB, n - at)) for at in range(0, n, 8 * KiB)]

    out = torch.zeros(2 * n, dtype=torch.uint8)[::2]  # non-contiguous: filled from a contiguous copy
    job = stager.read(out, stager.ready_event(out, None), disk.read, checksum=True, what="data")
    _run(job)
    assert torch.equal(out, data) and job.value == crc32c(data)
    assert stager.pinned_bytes == (16 * KiB if torch.cuda.is_available() else 0)  # page-locked only with CUDA


def test_a_failed_piece_fails_the_job_and_frees_the_slab(stager):
    data = torch.ones(40 * KiB, dtype=torch.uint8)
    disk = _Disk(40 * KiB)

    def failing(buf: torch.Tensor, at: int) -> Future:
        if at >= 16 * KiB:
            return Future.failed(OSError(28, "disk full"))
        return disk.write(buf, at)

    with pytest.raises(OSError, match="disk full"):
        _run(stager.write(data, stager.ready_event(data, None), failing, checksum=False, what="data"))
    # Both pieces are free again: a transfer needing the whole slab goes through.
    _run(stager.write(data, stager.ready_event(data, None), disk.write, checksum=False, what="data"))
    assert torch.equal(disk.bytes, data)


def test_a_closed_stager_refuses_work(stager):
    stager.close()
    data = torch.ones(10, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="test staging was closed"):
        stager.write(data, stager.ready_event(data, None), _Disk(10).write, checksum=False, what="data")
