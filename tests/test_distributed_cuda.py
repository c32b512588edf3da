"""Gradient buckets over NCCL: the copy out of a reduced bucket is ordered after the reduction on the GPU, and no
host thread waits for the collective (one rank: an NCCL group of one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nvoffload.distributed import GradientBuckets, Partition, Ranks
from nvoffload.transfer import TransferEngine


@pytest.mark.cuda
def test_an_nccl_bucket_is_copied_out_after_its_reduction_while_the_host_runs_ahead(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        numels = [3000, 5000, 7000]
        ranks = Ranks(None, 0, 1, torch.device("cuda", 0))
        buckets = GradientBuckets(ranks, Partition(numels, 1, align_numel=1024), bucket_bytes=32 << 10, budget_bytes=64 << 10)
        dist.all_reduce(torch.zeros(1, device="cuda"))  # NCCL makes its communicator at the first collective
        torch.cuda.synchronize()
        with TransferEngine(1 << 20, "cuda") as engine:
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU work before the gradients exist
            grads = [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(numels)]
            produced = torch.cuda.Event()
            produced.record()
            copies = []

            def deliver(reduced: torch.Tensor, pending, index: int) -> None:
                ready = engine.record()  # as the optimizer's hook does; its worker then waits and copies
                pending.wait()
                host = engine.slab.allocate(reduced.numel() * 4, f"gradient {index}").view(torch.float32)
                copies.append((index, engine.to_host(host, reduced, after=ready)))

            for i, grad in enumerate(grads):
                buckets.add(i, grad, lambda reduced, pending, i=i: deliver(reduced, pending, i))
            buckets.flush()
            assert not produced.query()  # the host queued every copy while the GPU still computed the gradients
            assert [index for index, _ in copies] == [0, 1, 2]
            for index, future in copies:
                assert torch.equal(future.result(), torch.full((numels[index],), float(index + 1))), index
    finally:
        dist.destroy_process_group()
