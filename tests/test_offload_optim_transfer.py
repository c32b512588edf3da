"""The NVMe optimizer's device copies: gradients down and weights up through the transfer engine.

On the CPU stand-in the copies land late (a delay of a few milliseconds), so a
missing wait reads a staging buffer before its copy landed; on a GPU the same
code runs on the copy streams.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nvoffload.device import CudaDevice, SimDevice
from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim.offload import NVMeAdamW
from nvoffload.transfer import TransferEngine

CHUNK = 4096 * 4


class MLP(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def run(model, opt, steps: int, device: str) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen).to(device)
        loss = (model(x) - 1).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pair(device: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = MLP().to(device=device, dtype=dtype)
    return model, copy.deepcopy(model)


def test_late_copies_give_adamw_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "3000")
    model, ref = pair("cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        assert isinstance(opt._io.transfer.device, SimDevice) and opt._io.transfer.device.copy_delay_us == 3000
        assert run(model, opt, 4, "cpu") == run(ref, ref_opt, 4, "cpu")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_gradient_copy_not_waited_for_gives_wrong_weights(tmp_path, monkeypatch):
    """The test above fails when the worker does not wait for the gradient's copy to land."""
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "3000")

    def without_wait(self, grad, slot, ready):
        host = slot.grad(grad.dtype, grad.numel())
        self.transfer.to_host(host, grad, after=ready, what="a gradient")  # .result() left out
        return host

    monkeypatch.setattr(ChunkIO, "grad_to_host", without_wait)
    model, ref = pair("cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        run(model, opt, 3, "cpu")
    run(ref, ref_opt, 3, "cpu")
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_shared_engine_carves_the_slots_and_keeps_running(tmp_path):
    model, ref = pair("cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with TransferEngine(8 << 20, "cpu") as engine:
        with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK, transfer=engine) as opt:
            assert engine.slab.used_bytes == opt.memory_stats().host_bytes
            assert run(model, opt, 3, "cpu") == run(ref, ref_opt, 3, "cpu")
        assert engine.slab.used_bytes == 0  # the carved share went back; the engine stays open
        engine.to_host(torch.empty(4), torch.ones(4)).result()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_parameters_match_fused_adamw(tmp_path, dtype):
    """Bitwise against torch's fused AdamW on the CPU, given the same (GPU) gradients: the NVMe optimizer's
    update is the CPU kernel's, so that is its reference (CUDA's fused AdamW rounds differently in the last ulp)."""
    model, ref = pair("cuda", dtype)
    master = [p.detach().float().cpu().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2, fused=True)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        assert isinstance(opt._io.transfer.device, CudaDevice) and opt._io.transfer.slab.page_locked
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(16, 64, generator=gen).to("cuda", dtype)
            (model(x).float() - 1).square().mean().backward()
            opt.step()
            opt.zero_grad()
            (ref(x).float() - 1).square().mean().backward()
            for p, q in zip(master, ref.parameters()):
                p.grad = q.grad.float().cpu()
            ref_opt.step()
            with torch.no_grad():
                for p, q in zip(master, ref.parameters()):
                    q.copy_(p)
                    q.grad = None
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p, q)
