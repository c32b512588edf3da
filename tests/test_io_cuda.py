"""CUDA tensors in the TensorStore: staged through host buffers, or by GPUDirect Storage."""

import pytest
import torch

from nvoffload.io import IOConfig, TensorStore


def _round_trip(store: TensorStore, n: int, dtype: torch.dtype) -> None:
    x = torch.randn(n, device="cuda").to(dtype)
    store.put("x", x).result()
    back = store.get("x").result()
    assert back.device.type == "cpu" and torch.equal(back, x.cpu())
    out = torch.empty_like(x)
    assert store.get("x", out=out).result() is out
    assert torch.equal(out, x)


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
