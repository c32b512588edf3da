"""CUDA tensors in the TensorStore: staged through the store's slab, or by GPUDirect Storage; ordered after the GPU's work."""

import pytest
import torch

from nvoffload.io import IOConfig, TensorStore

STAGED = pytest.param(False, id="staged")
DIRECT = pytest.param(True, id="gds", marks=pytest.mark.gds)


def _round_trip(store: TensorStore, n: int, dtype: torch.dtype) -> None:
    x = torch.randn(n, device="cuda").to(dtype)
    store.put("x", x).result()
    back = store.get("x").result()
    assert back.device.type == "cpu" and torch.equal(back, x.cpu())
    out = torch.empty_like(x)
    assert store.get("x", out=out).result() is out
    assert torch.equal(out, x)


def _busy_stream() -> torch.Tensor:
    """Queue tens of milliseconds of matmuls on the current stream; returns their (unused) result."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 4097, 3_000_001])
def test_cuda_tensors_staged_through_host(tmp_path, n):
    with TensorStore([tmp_path], config=IOConfig(use_gds=False)) as store:
        _round_trip(store, n, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.gds
@pytest.mark.parametrize("n", [1, 4097, 3_000_001])
def test_cuda_tensors_by_gpudirect_storage(tmp_path, n):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with TensorStore([tmp_path / "a", tmp_path / "b"], config=IOConfig(use_gds=True)) as store:
        _round_trip(store, n, torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("gds", [STAGED, DIRECT])
def test_put_reads_what_the_last_kernel_wrote(tmp_path, gds):
    expected = torch.randn(5_000_000, device="cuda")
    x = torch.zeros_like(expected)
    with TensorStore(tmp_path, config=IOConfig(use_gds=gds), staging_bytes=1 << 20) as store:
        _busy_stream()
        x.copy_(expected)  # runs after the matmuls, on the current stream
        assert not torch.cuda.current_stream().query()  # still queued when put is called
        fut = store.put("x", x)
        fut.result()
        assert torch.equal(store.get("x").result(), expected.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("gds", [STAGED, DIRECT])
def test_get_writes_out_after_the_kernels_that_read_it(tmp_path, gds):
    new = torch.randn(5_000_000, device="cuda")
    out = torch.full_like(new, 3.0)
    with TensorStore(tmp_path, config=IOConfig(use_gds=gds), staging_bytes=1 << 20) as store:
        store.put("x", new).result()
        seen = torch.empty_like(out)  # allocated before: an allocation may synchronize
        _busy_stream()
        seen.copy_(out)  # reads out after the matmuls, on the current stream
        assert not torch.cuda.current_stream().query()
        store.get("x", out=out).result()
        assert bool((seen == 3.0).all())  # the old contents: the read did not overtake the kernel
        assert torch.equal(out, new)


@pytest.mark.cuda
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "crc"])
def test_tensors_larger_than_the_staging_slab(tmp_path, checksum):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = IOConfig(use_gds=False, stripe_min_bytes=4096)
    with TensorStore([tmp_path / "a", tmp_path / "b"], config=config, checksum=checksum, staging_bytes=64 << 10) as s:
        x = torch.randn(1001, 301, device="cuda").to(torch.bfloat16)  # 602 KB: 19 pieces of 32 KiB, striped
        s.put("x", x).result()
        assert torch.equal(s.get("x").result(), x.cpu())  # the CRC of the pieces is that of the whole
        out = torch.empty(301, 1001, dtype=torch.bfloat16, device="cuda").t()  # non-contiguous
        assert s.get("x", out=out).result() is out and torch.equal(out, x)
        s.put("xt", x.t()).result()  # a non-contiguous source
        back = torch.empty(301, 1001, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(s.get("xt", out=back).result(), x.t())
        assert s.pinned_bytes == 64 << 10


@pytest.mark.cuda
def test_the_staging_slab_is_the_whole_pinned_footprint(tmp_path):
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    with TensorStore(tmp_path, config=IOConfig(use_gds=False), staging_bytes=1 << 20) as store:
        assert store.pinned_bytes == 0
        before = stats() if stats is not None else None
        for i in range(4):
            x = torch.randn(3_000_000 + i, device="cuda")
            store.put(f"x{i}", x).result()
            assert torch.equal(store.get(f"x{i}", out=torch.empty_like(x)).result(), x)
        assert store.pinned_bytes == 1 << 20
        if before is None:
            pytest.skip("torch.cuda.memory.host_memory_stats is not available: torch's pinned allocations not checked")
        after = stats()
        assert after.get("num_host_alloc", 0) == before.get("num_host_alloc", 0)
        assert after.get("allocated_bytes.current", 0) == before.get("allocated_bytes.current", 0)
