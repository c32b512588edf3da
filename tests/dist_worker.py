"""One training run for tests/test_distributed.py: as ranks (torchrun's environment: ``WORLD_SIZE``, ``RANK``,
``MASTER_ADDR``...) each rank on its part of every batch, alone the one-process reference on the whole batches.
Writes ``<out>/rank<r>.pt``: the final weights, the losses, the optimizer's NVMe byte counters and, before each
``step()``, the sum of the gradients in ``.grad`` and whether updates were queued during backward.

    python tests/dist_worker.py MODE OUT SWAP_ROOT [--steps N] [--accum K | --accums K1,K2,..] [--no-clip]
                                [--ckpt DIR [--save-at S] [--resume]] [--device-memory B] [--bucket-bytes B]
                                [--late-rank R]

MODE is ``optimizer`` (NVMeAdamW over the model, gradients in ``.grad``) or ``streaming``
(``nvoffload.initialize``: parameters streamed, gradients released during backward). With ``--save-at S`` a
training checkpoint is saved in DIR after step S; ``--resume`` starts from the latest one there.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

import nvoffload
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim import NVMeAdamW

MiB = 1 << 20
BATCH = 12  # rows per micro-batch, split between the ranks
MAX_GRAD_NORM = 0.05  # small enough that every step clips
BUCKET_BYTES = 48 << 10  # many buckets, some holding one parameter larger than this


def main(argv: list[str] | None = None) -> None:
    """One run; ``argv`` as on the command line (default: ``sys.argv[1:]``). Alone (no ``WORLD_SIZE``) the tests
    run it in their own process (``test_distributed.in_process``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["optimizer", "streaming"])
    parser.add_argument("out")
    parser.add_argument("swap_root")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--accums", help="micro-batches of each step, cycled (optimizer mode; default: --accum)")
    parser.add_argument("--no-clip", action="store_true", help="no max_grad_norm")
    parser.add_argument("--ckpt")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective_timeout_s")
    parser.add_argument("--fail-rank", type=int, help="this rank fails at --fail-at: exits, or stalls (--stall)")
    parser.add_argument("--fail-at", type=int, default=3)
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--missing-swap-rank", type=int, help="this rank is given a swap directory that does not exist")
    parser.add_argument("--device-memory", type=int, default=16 * MiB, help="device_memory_bytes (streaming mode)")
    parser.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    parser.add_argument("--late-rank", type=int, help="this rank starts each backward pass 0.2 s after the others")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        # The ranks start seconds apart (torch's import; torch._dynamo's, imported by the first optimizer): a
        # long timeout until they meet, then gloo's own timeout as the optimizer's, so that a stalled peer ends
        # the run --timeout after the others started waiting for it.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        importlib.import_module("torch._dynamo")

        dist.barrier()
        _set_pg_timeout(datetime.timedelta(seconds=args.timeout))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.makedirs(args.out, exist_ok=True)
    swap = os.path.join(args.swap_root, f"rank{rank}")
    if rank != args.missing_swap_rank:
        os.makedirs(swap, exist_ok=True)
    accums = [int(k) for k in args.accums.split(",")] if args.accums else [args.accum]
    max_grad_norm = None if args.no_clip else MAX_GRAD_NORM
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    if args.mode == "optimizer":
        opt = NVMeAdamW(
            model.parameters(), lr=3e-3, weight_decay=0.1, swap_dir=swap, max_grad_norm=max_grad_norm,
            cpu_memory_bytes=4 * MiB, chunk_bytes=16 << 10, collective_timeout_s=args.timeout, bucket_bytes=args.bucket_bytes,
        )  # fmt: skip
    else:
        config = nvoffload.OffloadConfig(
            swap_dirs=[swap], cpu_memory_bytes=8 * MiB, device_memory_bytes=args.device_memory,
            max_grad_norm=max_grad_norm, gradient_accumulation_steps=args.accum, collective_timeout_s=args.timeout,
            bucket_bytes=args.bucket_bytes,
            defer_updates=False,  # one process speculates as the ranks do (deferral is one process's), same bytes
        )  # fmt: skip
        model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    ckpt_dir = args.ckpt
    start = 0
    if args.resume:
        start = nvoffload.load_training_checkpoint(ckpt_dir, model=model, optimizer=opt).step
    data = torch.Generator().manual_seed(1)
    for _ in range(sum(accums[s % len(accums)] for s in range(start))):  # the batches before the checkpoint
        torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=data)
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    losses, grad_sums, queued = [], [], []
    opt.reset_io_stats()
    for step in range(start, args.steps):
        if step == args.fail_at and rank == args.fail_rank:
            if args.stall:
                time.sleep(3600)  # alive, but never joins the step's collectives
            os._exit(3)  # dies
        total = 0.0
        accum = accums[step % len(accums)]
        for _ in range(accum):
            x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=data)
            loss = model(x[lo:hi], x.roll(-1, dims=1)[lo:hi]) / accum
            if rank == args.late_rank:  # the others' collectives of this pass end 0.2 s after they start
                time.sleep(0.2)
            loss.backward()
            total += float(loss.detach())
        grad_sums.append(math.fsum(float(p.grad.double().sum()) for p in model.parameters() if p.grad is not None))
        queued.append(opt.updates_queued)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if args.save_at is not None and step + 1 == args.save_at:
            nvoffload.save_training_checkpoint(ckpt_dir, step=step + 1, model=model, optimizer=opt)
    stats = opt.memory_stats()  # with the checkpoint's reads, when one was saved
    state = opt.state_dict()  # gathered from every rank's share
    if args.mode == "optimizer":  # and scattered again: a new optimizer takes its share of the whole state
        opt.close()  # first: a parameter belongs to one open optimizer
        again = NVMeAdamW(model.parameters(), lr=3e-3, swap_dir=swap, cpu_memory_bytes=4 * MiB, chunk_bytes=16 << 10)
        again.load_state_dict(state)
        reloaded = again.state_dict()
        again.close()
        for idx, st in state["state"].items():
            for key, value in st.items():
                assert torch.equal(reloaded["state"][idx][key], value), (idx, key)
    torch.save(
        {
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": losses,
            "grad_sums": grad_sums,
            "queued": queued,
            "read_bytes": stats.read_bytes,
            "written_bytes": stats.written_bytes,
            "state": state,
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    opt.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
