"""One host accounting: the host tier is the session's host slab, the bytes its carves really hold (4 KiB-aligned)."""

from __future__ import annotations

import pytest
import torch

import nvoffload
from nvoffload.distributed import DEFAULT_BUCKET_BYTES, Ranks, reserve_buckets
from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.models import GPT, GPTConfig
from nvoffload.transfer import HostSlab

MiB = 1 << 20
PAGE = 4096


def test_a_carve_counted_by_its_buffers_counts_them_in_the_slab_and_stops_when_closed():
    slab = HostSlab(4 * MiB, "the budget")
    fixed = slab.carve(MiB + 1, "a share")  # counted whole, rounded up to a page
    elastic = slab.carve(2 * MiB, "the rest", by_buffers=True)
    assert slab.used_bytes == MiB + PAGE
    a = elastic.allocate(10_000, "a")
    b = elastic.allocate(PAGE, "b")
    assert elastic.used_bytes == 4 * PAGE and slab.used_bytes == MiB + 5 * PAGE
    elastic.free(a)
    assert slab.used_bytes == MiB + 2 * PAGE and slab.peak_bytes == MiB + 5 * PAGE
    slab.reset_peak()
    assert slab.peak_bytes == MiB + 2 * PAGE
    elastic.close()  # b still out: no longer counted anywhere
    assert slab.used_bytes == MiB + PAGE
    elastic.free(b)
    assert slab.used_bytes == MiB + PAGE
    fixed.close()
    assert slab.used_bytes == 0
    slab.close()


def test_a_host_slab_is_the_host_tier_and_the_tier_counts_nothing_of_its_own():
    memory = MemoryManager(device_memory_bytes=MiB, cpu_memory_bytes=8 * MiB)
    slab = HostSlab(4 * MiB + 100, "the budget")
    memory.use_host_slab(slab)
    buf = slab.allocate(5000, "a buffer")
    stats = memory.stats()["host"]
    assert (stats.used_bytes, stats.peak_bytes, stats.limit_bytes) == (2 * PAGE, 2 * PAGE, 4 * MiB)
    assert memory.available_bytes("host") == 4 * MiB - 2 * PAGE and memory.limit_bytes("host") == 4 * MiB
    for count in (lambda: memory.allocate("host", 1, "x"), lambda: memory.free("host", 1), lambda: memory.track("host", 1)):
        with pytest.raises(ValueError, match="taken from the budget"):
            count()
    slab.free(buf)
    memory.reset_peaks()
    assert memory.stats()["host"].peak_bytes == 0
    slab.close()


def test_gloo_buckets_are_a_carve_of_the_host_slab_and_a_refusal_still_names_bucket_bytes():
    params = list(GPT(GPTConfig.preset("tiny")).parameters())
    grads = sum(p.numel() * p.element_size() for p in params)
    ranks = Ranks(None, 0, 2, torch.device("cpu"))
    memory = MemoryManager(device_memory_bytes=MiB, cpu_memory_bytes=8 * MiB)
    slab = HostSlab(8 * MiB, "the budget")
    memory.use_host_slab(slab)
    carve = reserve_buckets(memory, ranks, params, DEFAULT_BUCKET_BYTES)
    assert memory.stats()["host"].used_bytes == slab.used_bytes == -(-2 * grads // PAGE) * PAGE  # two buckets
    carve.close()
    small = MemoryManager(device_memory_bytes=MiB, cpu_memory_bytes=2 * grads - 1)
    small_slab = HostSlab(2 * grads - 1, "the budget")  # rounded down to a page: one page short
    small.use_host_slab(small_slab)
    with pytest.raises(MemoryBudgetError, match=rf"bucket_bytes={DEFAULT_BUCKET_BYTES} .* raise cpu_memory_bytes"):
        reserve_buckets(small, ranks, params, DEFAULT_BUCKET_BYTES)
    assert small.stats()["host"].used_bytes == 0
    slab.close()
    small_slab.close()


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _held_bytes(session) -> int:
    """What the slab's carves really hold: the optimizer's and activation offload's shares whole, the cached
    blocks of parameter streaming's, each rounded up to 4 KiB."""
    optimizer = session.optimizer.config
    shares = [optimizer.cpu_memory_bytes + optimizer.resident_state_bytes, session.config.activation_bytes]
    return sum(_pages(n) for n in shares if n) + sum(_pages(b.numel()) for b in _streamer_buffers(session))


def _streamer_buffers(session):
    cache = session.streamer.cache
    return [entry.host for entry in cache._lru.values()]


@pytest.mark.parametrize("offload_activations", [False, True])
def test_the_host_tier_is_what_the_session_slab_holds_after_initialize_and_a_step(tmp_path, offload_activations):
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    activations = 4 * MiB if offload_activations else 0
    config = nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], device_memory_bytes=64 * MiB, cpu_memory_bytes=2 * (3 * block + MiB + activations) + 1000,
        offload_activations=offload_activations, activation_memory_bytes=activations or None,
    )  # fmt: skip
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    session = opt.session
    try:
        streamer_slab = session.transfers["streamer"].slab
        for when in ("after initialize", "after a step"):
            if when == "after a step":
                session.reset_stats()
                x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
                model(x, x.roll(-1, dims=1)).backward()
                opt.step()
                opt.zero_grad()
            host = session.memory_stats()["host"]
            assert host.limit_bytes == session.slab.capacity_bytes == config.cpu_memory_bytes // PAGE * PAGE, when
            # the streamer's carve holds only the cached blocks: their aligned bytes are what the tier counts
            assert streamer_slab.used_bytes == sum(_pages(b.numel()) for b in _streamer_buffers(session))
            assert host.used_bytes == _held_bytes(session) == session.slab.used_bytes, when
            assert host.used_bytes % PAGE == 0 and host.used_bytes <= host.peak_bytes <= host.limit_bytes, when
            assert session.memory.available_bytes("host") == host.limit_bytes - host.used_bytes, when
            with pytest.raises(ValueError, match="not allocated in the host tier"):  # no second counter
                session.memory.allocate("host", 1, "a second count")
    finally:
        session.close()
