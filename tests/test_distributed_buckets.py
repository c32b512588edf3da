"""The gradient buckets between ranks take no more memory than the gradients need, and say so in bucket_bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nvoffload.distributed import DEFAULT_BUCKET_BYTES, GradientBuckets, Partition, Ranks, reserve_buckets
from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.models import GPT, GPTConfig
from test_distributed import MODES, alone_and_two_ranks, assert_trained_alike


def tiny_gpt() -> GPT:
    return GPT(GPTConfig.preset("tiny"))


def block_bytes(model: GPT) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())


def test_two_gloo_ranks_stream_half_a_megabyte_of_gradients_within_four_blocks(tmp_path):
    model = tiny_gpt()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < 512 << 10
    args = ["--steps", "3", "--device-memory", str(4 * block_bytes(model)), "--bucket-bytes", str(DEFAULT_BUCKET_BYTES)]
    one, two = alone_and_two_ranks("streaming", tmp_path, *args)
    for name, value in two[0]["weights"].items():
        assert torch.equal(two[1]["weights"][name], value), name
    assert_trained_alike(two[0]["weights"], one["weights"])


@pytest.mark.parametrize("device, tier, budget", [("cuda", "device", "device_memory_bytes"), ("cpu", "host", "cpu_memory_bytes")])
def test_buckets_reserve_two_of_at_most_all_the_gradients_and_a_refusal_names_bucket_bytes(device, tier, budget):
    params = list(tiny_gpt().parameters())
    params[0].requires_grad_(False)  # no gradient, no bucket room
    grads = sum(p.numel() * p.element_size() for p in params[1:])
    ranks = Ranks(None, 0, 2, torch.device(device))
    memory = MemoryManager(device_memory_bytes=4 << 20, cpu_memory_bytes=4 << 20)
    reserve_buckets(memory, ranks, params, DEFAULT_BUCKET_BYTES)
    assert memory.stats()[tier].used_bytes == 2 * grads
    small = MemoryManager(device_memory_bytes=2 * grads - 1, cpu_memory_bytes=2 * grads - 1)
    with pytest.raises(MemoryBudgetError, match=rf"bucket_bytes={DEFAULT_BUCKET_BYTES} .* lower bucket_bytes or raise {budget}"):
        reserve_buckets(small, ranks, params, DEFAULT_BUCKET_BYTES)
    reserve_buckets(small, ranks, params, 1024)  # two buckets of the largest gradient
    largest = max(p.numel() * p.element_size() for p in params[1:])
    assert small.stats()[tier].used_bytes == 2 * largest


def test_no_released_gradient_bucket_passes_bucket_bytes_but_a_gradient_alone(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        numels = [60, 60, 60, 300, 30]
        ranks = Ranks(None, 0, 1, torch.device("cpu"))
        buckets = GradientBuckets(ranks, Partition(numels, 1, align_numel=1024), bucket_bytes=100 * 4, budget_bytes=200 * 4)
        launched: list[tuple[object, int]] = []  # (the bucket's reduction, a gradient's size) in delivery order
        for index, numel in enumerate(numels):
            grad = torch.full((numel,), float(index))

            def deliver(reduced: torch.Tensor, pending, index=index, numel=numel) -> None:
                pending.wait()
                assert torch.equal(reduced, torch.full((numel,), float(index)))
                launched.append((pending, numel))

            buckets.add(index, grad, deliver)
        buckets.flush()
        sizes: list[list[int]] = []
        for i, (pending, numel) in enumerate(launched):
            if i and pending is launched[i - 1][0]:
                sizes[-1].append(numel)
            else:
                sizes.append([numel])
        assert sizes == [[60], [60], [60], [300], [30]]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
def test_a_bucket_is_read_after_its_reduction_ends_however_late_the_other_rank(tmp_path, monkeypatch, mode):
    """Rank 1 starts every backward pass 0.2 s late, so rank 0's reductions end 0.2 s after they start; the
    stand-in's copies land 2 ms after they are queued. A gradient copied out before its bucket's collective
    ended would be rank 0's own (released gradients: the optimizer's worker; held ones: the write-back into
    ``.grad``), and the ranks' weights would part from each other and from one process's."""
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "2000")
    args = ["--steps", "3", "--no-clip"]
    one, two = alone_and_two_ranks(mode, tmp_path, *args, rank_args=("--late-rank", "1"))
    for name, value in two[0]["weights"].items():
        assert torch.equal(two[1]["weights"][name], value), name
    assert_trained_alike(two[0]["weights"], one["weights"], rel=1e-5, per_tensor=1e-3)
