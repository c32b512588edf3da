"""CUDA tensors to and from NVMe: through the transfer engine (its slab, or GPUDirect Storage), ordered after the
GPU's work; the store itself refuses them."""

import pytest
import torch

from nvoffload.io import IOConfig, TensorStore
from nvoffload.transfer import TransferEngine

STAGED = pytest.param(False, id="staged")
DIRECT = pytest.param(True, id="gds", marks=pytest.mark.gds)


def _store(path, gds: bool) -> TensorStore:
    """A store whose CUDA tensors move by GPUDirect Storage (no checksums) or through host memory."""
    return TensorStore(path, config=IOConfig(use_gds=gds), checksum=not gds)


def _staging(engine: TransferEngine, like: torch.Tensor) -> torch.Tensor:
    return engine.slab.allocate(like.numel() * like.element_size(), "staging").view(like.dtype)


def _check_path(engine: TransferEngine, store: TensorStore, x: torch.Tensor, gds: bool) -> None:
    if engine.direct(store, x) != gds:
        pytest.skip("kvikio is not installed, or in compatibility mode: no GPUDirect Storage here")


def _busy_stream() -> torch.Tensor:
    """Queue tens of milliseconds of matmuls on the current stream; returns their (unused) result."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.cuda
def test_the_store_refuses_cuda_tensors_naming_the_transfer_engine(tmp_path):
    with TensorStore(tmp_path) as store:
        with pytest.raises(ValueError, match=r"put\('x'\): .* on cuda:0: move it with TransferEngine\.save"):
            store.put("x", torch.ones(10, device="cuda"))
        store.put("x", torch.ones(10)).result()
        with pytest.raises(ValueError, match=r"get\('x'\): .* on cuda:0: move it with TransferEngine\.load"):
            store.get("x", out=torch.empty(10, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("gds", [STAGED, DIRECT])
@pytest.mark.parametrize("n", [1, 4097, 3_000_001])
def test_cuda_tensors_round_trip(tmp_path, gds, n):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with _store([tmp_path / "a", tmp_path / "b"], gds) as store, TransferEngine(32 << 20, "cuda") as engine:
        x = torch.randn(n, device="cuda").to(torch.bfloat16)
        _check_path(engine, store, x, gds)
        staging = _staging(engine, x)
        engine.save(store, "x", x, staging).result()
        assert torch.equal(store.get("x").result(), x.cpu())
        out = torch.empty_like(x)
        engine.wait(engine.load(store, "x", out, staging))
        assert torch.equal(out, x)
        engine.slab.free(staging)


@pytest.mark.cuda
@pytest.mark.parametrize("gds", [STAGED, DIRECT])
def test_save_reads_what_the_last_kernel_wrote(tmp_path, gds):
    expected = torch.randn(5_000_000, device="cuda")
    x = torch.zeros_like(expected)
    with _store(tmp_path, gds) as store, TransferEngine(32 << 20, "cuda") as engine:
        _check_path(engine, store, x, gds)
        staging = _staging(engine, x)
        _busy_stream()
        x.copy_(expected)  # runs after the matmuls, on the current stream
        saved = engine.save(store, "x", x, staging)
        assert not torch.cuda.current_stream().query()  # save returned while the kernels still run: no host wait
        saved.result()
        assert torch.equal(store.get("x").result(), expected.cpu())
        engine.slab.free(staging)


@pytest.mark.cuda
@pytest.mark.parametrize("gds", [STAGED, DIRECT])
def test_load_writes_dst_after_the_kernels_that_read_it(tmp_path, gds):
    new = torch.randn(5_000_000, device="cuda")
    out = torch.full_like(new, 3.0)
    with _store(tmp_path, gds) as store, TransferEngine(32 << 20, "cuda") as engine:
        _check_path(engine, store, out, gds)
        staging = _staging(engine, new)
        engine.save(store, "x", new, staging).result()
        seen = torch.empty_like(out)  # allocated before: an allocation may synchronize
        _busy_stream()
        seen.copy_(out)  # reads out after the matmuls, on the current stream
        loaded = engine.load(store, "x", out, staging)
        assert not torch.cuda.current_stream().query()  # load returned while the kernels still run: no host wait
        engine.wait(loaded)
        assert bool((seen == 3.0).all())  # the old contents: the read did not overtake the kernel
        assert torch.equal(out, new)
        engine.slab.free(staging)


@pytest.mark.cuda
def test_the_engines_slab_is_the_whole_pinned_footprint(tmp_path):
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None:
        pytest.skip("torch.cuda.memory.host_memory_stats is not available: torch's pinned allocations not checked")
    with TensorStore(tmp_path) as store, TransferEngine(16 << 20, "cuda") as engine:
        before = stats()
        for i in range(4):
            x = torch.randn(3_000_000 + i, device="cuda")
            staging = _staging(engine, x)
            engine.save(store, f"x{i}", x, staging).result()
            out = torch.empty_like(x)
            engine.wait(engine.load(store, f"x{i}", out, staging))
            assert torch.equal(out, x)
            engine.slab.free(staging)
        after = stats()
        assert after.get("num_host_alloc", 0) == before.get("num_host_alloc", 0)
        assert after.get("allocated_bytes.current", 0) == before.get("allocated_bytes.current", 0)
