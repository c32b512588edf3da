"""Device memory as the allocator sees it: on CUDA the device tier's stats carry what torch's caching allocator
reserves beside the budget, and the budget bounds what a streamed model's training reserves."""

import pytest
import torch

import nvoffload
from nvoffload.memory import MemoryManager
from nvoffload.models import GPT, GPTConfig

MiB = 1 << 20


def test_the_device_tier_reports_the_allocators_reserved_bytes_on_cuda_only(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: asked.append(d) or 40 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: asked.append(d) or 48 * MiB)
    cuda1 = torch.device("cuda", 1)
    memory = MemoryManager(device_memory_bytes=64 * MiB, cpu_memory_bytes=8 * MiB, device=cuda1)
    memory.allocate("device", 30 * MiB, "a block")
    stats = memory.stats()
    assert (stats["device"].used_bytes, stats["device"].peak_bytes, stats["device"].limit_bytes) == (30 * MiB, 30 * MiB, 64 * MiB)
    assert (stats["device"].reserved_bytes, stats["device"].reserved_peak_bytes) == (40 * MiB, 48 * MiB)
    assert asked == [cuda1, cuda1]  # the session's device, not the current one
    assert stats["host"].reserved_bytes is None and stats["host"].reserved_peak_bytes is None
    for device in (None, torch.device("cpu")):
        cpu = MemoryManager(device_memory_bytes=64 * MiB, cpu_memory_bytes=8 * MiB, device=device).stats()
        assert cpu["device"].reserved_bytes is None and cpu["device"].reserved_peak_bytes is None
    assert len(asked) == 2


# What the caching allocator holds beyond the engines' tensors, which the device budget does not count:
# cuBLAS's and cuBLASLt's workspaces (32 MiB each on Hopper), the large pool's 20 MiB segments for tensors
# of 1-10 MiB (a block's weight matrices here: 1-4 MiB each, rounded into part-used segments) and the small
# pool's 2 MiB segments for the activations of one sequence of 8 tokens (under 100 KB each, about 8 MB
# saved over the 32 blocks).
ALLOCATOR_SLACK_BYTES = 128 * MiB


@pytest.mark.cuda
def test_cuda_the_device_budget_bounds_what_a_streamed_model_reserves(tmp_path):
    """32 blocks of 12 MiB (386 MiB of fp32 weights, as much again in gradients) streamed through a device
    budget of three blocks and the resident parameters twice (39 MiB): for three steps the allocator's reserved
    memory grows by at most the budget plus ALLOCATOR_SLACK_BYTES, and memory_stats() reports it."""
    cfg = GPTConfig(vocab_size=512, seq_len=8, n_layer=32, n_head=8, d_model=512)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    resident = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = 2 * resident + 3 * block + MiB
    assert weights > 2 * (budget + ALLOCATOR_SLACK_BYTES)  # the bound says something: the model does not fit it
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    model, opt = nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4),
        nvoffload.OffloadConfig(swap_dirs=[tmp_path], device="cuda", device_memory_bytes=budget, cpu_memory_bytes=512 * MiB),
        param_init_fn=model.init_weights,
    )  # fmt: skip
    try:
        for _ in range(3):
            x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device="cuda")
            model(x, x.roll(-1, dims=1)).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        reserved_before, peak_before = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
        device = opt.session.memory_stats()["device"]
        assert device.peak_bytes <= budget
        # what the allocator holds then (reserved memory only grows until empty_cache())
        assert reserved_before <= device.reserved_bytes <= torch.cuda.memory_reserved()
        assert peak_before <= device.reserved_peak_bytes <= torch.cuda.max_memory_reserved()
        grown = device.reserved_peak_bytes - before
        assert 0 < grown <= budget + ALLOCATOR_SLACK_BYTES, (grown / MiB, budget / MiB)
    finally:
        opt.close()
