"""The NVMe optimizer's device copies: gradients down and weights up through the transfer engine.

On the CPU stand-in the copies land late (a delay of a few milliseconds), so a
missing wait reads a staging buffer before its copy landed; on a GPU the same
code runs on the copy streams.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from nvoffload import trace
from nvoffload.device import CudaDevice, SimDevice
from nvoffload.optim._chunk_io import ChunkIO, ModelWeights
from nvoffload.optim.offload import NVMeAdamW
from nvoffload.transfer import Future, TransferEngine

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
    """The test above fails when the worker does not wait for the gradient's copy to land. (It starts that copy
    ahead of the update, before the fp32 weights' copy it waits for on the same stream: that wait is left out
    too, or it would cover the first.)"""
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "3000")

    def without_wait(self, grad, slot, ready):
        host = slot.grad(grad.dtype, grad.numel())
        self.transfer.to_host(host, grad, after=ready, what="a gradient")  # not waited for
        return Future.completed(host)

    def weights_without_wait(self, elements, out, slot, *, after=None):
        self._transfer.to_host(out, self.flat[elements], after=after, what="weights")  # not waited for

    monkeypatch.setattr(ChunkIO, "grad_to_host", without_wait)
    monkeypatch.setattr(ModelWeights, "read", weights_without_wait)
    model, ref = pair("cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        run(model, opt, 3, "cpu")
    run(ref, ref_opt, 3, "cpu")
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


class _Recorded:
    """A stand-in event, with the name of the thread that recorded it."""

    __slots__ = ("event", "thread")

    def __init__(self, event, thread: str):
        self.event, self.thread = event, thread

    def query(self):
        return self.event.query()

    def synchronize(self, timeout_s):
        return self.event.synchronize(timeout_s)

    def error(self):
        return self.event.error()


class _Noted:
    """A stand-in copy stream that notes, for each copy, what it moved and which thread recorded the event
    it was queued behind."""

    def __init__(self, stream, direction: str, copies: list):
        self._stream, self._direction, self._copies = stream, direction, copies

    def copy(self, dst, src, after, what=None):
        self._copies.append((self._direction, what, after.thread))
        return self._stream.copy(dst, src, after.event, what)


class WitnessDevice(SimDevice):
    """The stand-in, noting behind which thread's event each copy was queued."""

    def __init__(self):
        super().__init__(copy_delay_us=2000)
        self.copies: list[tuple[str, str, str]] = []  # (direction, what, thread that recorded its event)

    def record(self):
        return _Recorded(super().record(), threading.current_thread().name)

    def copy_stream(self, direction):
        return _Noted(super().copy_stream(direction), direction, self.copies)


@pytest.mark.parametrize("release", [False, True])
def test_the_workers_copies_wait_for_the_training_threads_events(tmp_path, release):
    """Every copy of weights or gradients that the optimizer's worker queues waits for the event of the work
    that produced its source, recorded by the training thread (the hook's, or step()'s for an update redone
    from kept gradients): never for an event of the worker's own, which on CUDA orders the copy after the
    worker's stream (all of backward queued so far, or not the stream that produced the tensor). The fp32
    weights' reads, first and later, and the redone updates' uploads recorded their events on the worker."""
    device = WitnessDevice()
    model, ref = pair("cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    # With released gradients a tiny max_grad_norm makes step() redo every update from the kept gradients.
    config = {"release_grads": True, "max_grad_norm": 1e-3} if release else {}
    with TransferEngine(8 << 20, device) as engine, \
         NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK, transfer=engine, **config) as opt:  # fmt: skip
        losses = run(model, opt, 3, "cpu")
    assert {"weights", "a gradient"} <= {what for _, what, _ in device.copies}
    assert {thread for _, _, thread in device.copies} == {threading.main_thread().name}, device.copies
    if not release:
        assert losses == run(ref, ref_opt, 3, "cpu")
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)


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


def test_the_next_chunks_gradient_copy_is_queued_before_this_chunks_update(tmp_path):
    """The worker starts chunk k+1's gradient copy before it runs chunk k's update, so that the copy overlaps
    the kernel: on the device-to-host stream (in order; the trace lists its copies as they ran) the second
    gradient comes before the first fp32 weights' copy, which the first update waits for before it computes.
    (The worker is lent out while backward's hooks queue the step's requests, so it finds them all queued.)"""
    model, ref = pair("cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 64, generator=gen) for _ in range(2)]
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK, release_grads=True) as opt:
        for x in xs:
            with trace.tracing() as recording:
                with opt._pipeline.lend():  # the worker waits: every request of the step is queued first
                    (model(x) - 1).square().mean().backward()
                opt.step()
                opt.zero_grad()
    for x in xs:
        (ref(x) - 1).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    copies = [name for track, name, *_ in recording.spans() if track == "d2h"]  # the second step's
    assert copies[:3] == ["a gradient", "a gradient", "weights"]
