"""Data parallel training: 1 rank against 2 (torchrun, gloo), for nvoffload's two modes and its peer.

Each case trains a GPT (``gpt2-124m`` by default) for a warm-up step and ``--steps`` timed steps on the
same global batch (``--batch`` sequences per micro-batch, two micro-batches per step), split between the
ranks, in its own processes (with ``--quick``: the cases of each number of ranks one after the other in
the same processes):

* ``compute``: forward and backward alone on 1 rank (no optimizer): the compute limit of this machine;
* ``ddp``: the peer, ``DistributedDataParallel`` with ``torch.optim.AdamW`` (fused, state in RAM);
* ``optimizer``: the model in memory, AdamW's state on NVMe (``NVMeAdamW``), each rank 1/N of it;
* ``streaming``: ``nvoffload.initialize``: parameters streamed from each rank's store too.

This machine has 2 cores and no GPU: two ranks share the cores one rank had (each rank gets
``cores / ranks`` threads), so their compute is no faster than one rank's; what splits is the optimizer's
work (each rank updates, reads and writes half of the state) and what is added is the communication and a
second process. The report adds the planner's prediction for one 8-GPU server with 4 NVMe drives
per GPU (``8x-h100-sxm-2t-32xgen4``), which this machine cannot measure.

    python bench/bench_distributed.py [--quick] [--preset P] [--batch B] [--seq-len T] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, save_report  # noqa: E402

CASES = [("compute", 1), ("ddp", 1), ("ddp", 2), ("optimizer", 1), ("optimizer", 2), ("streaming", 1), ("streaming", 2)]
MiB = 1 << 20
GB = 1e9


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny preset, one timed step, the cases in 2 launches (smoke test)")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch, split between the ranks")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up step)")
    p.add_argument("--swap-dir", default=None, help="directory on NVMe (default: a temporary one under /tmp)")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: one rank of one case
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.batch, args.seq_len, args.steps = "tiny", 4, 32, 1
    return args


def run_rank(args) -> None:
    """One rank of each case of ``args.case`` (cases separated by commas, one after the other): writes each
    case's step spans (wall clock) and NVMe bytes to ``args.out`` (its ``{case}`` replaced by the case)."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(max(1, os.cpu_count() // world))
    for case in args.case.split(","):
        run_case(args, case, world, rank)
    if world > 1:
        dist.destroy_process_group()


def run_case(args, case: str, world: int, rank: int) -> None:
    import torch

    import nvoffload
    from nvoffload.models import GPT, GPTConfig
    from nvoffload.optim import NVMeAdamW

    swap = Path(args.swap_dir) / case / f"rank{rank}"
    swap.mkdir(parents=True, exist_ok=True)
    cfg = GPTConfig.preset(args.preset)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = None
    if case == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif case == "optimizer":
        opt = NVMeAdamW(model.parameters(), lr=1e-4, swap_dir=str(swap), cpu_memory_bytes=256 * MiB)
    elif case == "streaming":
        block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
        config = nvoffload.OffloadConfig(
            swap_dirs=[swap], cpu_memory_bytes=512 * MiB, device_memory_bytes=1024 * MiB + 4 * block,
            gradient_accumulation_steps=2,
        )  # fmt: skip
        model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    data = torch.Generator().manual_seed(1)
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    spans, nvme = [], 0
    for step in range(1 + args.steps):
        if step == 1 and isinstance(opt, nvoffload.optim.OffloadOptimizer):
            opt.reset_io_stats()
        start = time.time()
        for _ in range(2):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=data)
            (model(x[rows], x.roll(-1, dims=1)[rows]) / 2).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            model.zero_grad()
        spans.append((start, time.time()))
    if isinstance(opt, nvoffload.optim.OffloadOptimizer):
        stats = opt.memory_stats()
        nvme = (stats.read_bytes + stats.written_bytes) / args.steps
        opt.close()
    Path(args.out.replace("{case}", case)).write_text(json.dumps({"spans": spans[1:], "nvme_bytes_per_step": nvme}))


def launch(args, cases: list[str], ranks: int, root: Path) -> dict[str, list[dict]]:
    """Run ``cases`` one after the other in the same ``ranks`` processes; each case's records of each rank."""
    script = Path(__file__).resolve()
    outs = {case: [root / f"{case}-{ranks}-rank{r}.json" for r in range(ranks)] for case in cases}
    common = ["--case", ",".join(cases), "--preset", args.preset, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
              "--steps", str(args.steps), "--swap-dir", str(root / f"swap-{ranks}")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    if ranks == 1:
        command = [sys.executable, str(script), *common, "--out", str(root / f"{{case}}-{ranks}-rank0.json")]
    else:  # each rank writes its own file: the worker adds its rank to --out
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "--log-dir", str(root / "torchrun"),  # else torchrun leaves a /tmp/torchelastic_* per run
                   str(script), *common, "--out", str(root / f"{{case}}-{ranks}-rank{{rank}}.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"case {','.join(cases)} on {ranks} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {case: [json.loads(out.read_text()) for out in case_outs] for case, case_outs in outs.items()}


def eight_gpu_plan() -> dict:
    """The planner's prediction for llama2-70b on 8 H100 SXM with 4 Gen4 NVMe drives each."""
    from nvoffload.planner import ModelShape, PlanRequest, load_profile, plan

    request = PlanRequest(
        ModelShape.named("llama2-70b"), batch_size=64, seq_len=2048, dtype="bfloat16", cpu_memory_bytes=224 << 30,
        device_memory_bytes=78 << 30, swap_dirs=4, ranks=8, max_grad_norm=True,
    )  # fmt: skip
    chosen = plan(request, load_profile("8x-h100-sxm-2t-32xgen4"))
    return {"request": "llama2-70b, batch 64 x 2048, bfloat16, 8 ranks x 4 NVMe, max_grad_norm", "fits": chosen.fits,
            "stream": chosen.stream, "activations": chosen.activations, "step_s": chosen.step_s,
            "tokens_per_s": chosen.tokens_per_s, "bottleneck": chosen.bottleneck, "engine_s": chosen.engine_s,
            "communication_bytes": chosen.communication_bytes}  # fmt: skip


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.case is not None:
        args.out = args.out.replace("{rank}", os.environ.get("RANK", "0"))
        run_rank(args)
        return Path(args.out)
    root = Path(tempfile.mkdtemp(prefix="bench_distributed_", dir=args.swap_dir or "/tmp"))
    started = time.time()
    try:
        if args.quick:  # each number of ranks' cases in the same processes (two launches, not seven)
            ran = {n: launch(args, [c for c, r in CASES if r == n], n, root) for n in sorted({r for _, r in CASES})}
            runs = {(case, ranks): ran[ranks][case] for case, ranks in CASES}
        else:  # each case in processes of its own
            runs = {(case, ranks): launch(args, [case], ranks, root)[case] for case, ranks in CASES}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    tokens = 2 * args.batch * args.seq_len
    step_s = {key: statistics.median(max(r["spans"][i][1] - r["spans"][i][0] for r in rs) for i in range(args.steps))
              for key, rs in runs.items()}  # fmt: skip
    rows = []
    for (case, ranks), ranks_runs in runs.items():
        rows.append({
            "case": f"{case} x{ranks}", "ranks": ranks, "step_s": step_s[(case, ranks)],
            "tokens_per_s": tokens / step_s[(case, ranks)],
            "vs_1_rank": step_s[(case, 1)] / step_s[(case, ranks)],
            "vs_compute_limit": step_s[("compute", 1)] / step_s[(case, ranks)],
            "vs_ddp_same_ranks": step_s[("ddp", ranks)] / step_s[(case, ranks)],
            "optimizer_nvme_GB_per_rank_step": statistics.mean(r["nvme_bytes_per_step"] for r in ranks_runs) / GB,
        })  # fmt: skip
    predicted = eight_gpu_plan()

    def plot(plt):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        labels = []
        for y, ((case, ranks), rs) in enumerate(runs.items()):
            t0 = min(r["spans"][0][0] for r in rs)
            for r, record in enumerate(rs):
                bars = [(s - t0, e - s) for s, e in record["spans"]]
                ax.broken_barh(bars, (y + r * 0.4 - 0.2, 0.35), facecolors=f"C{r}", edgecolor="black", linewidth=0.5)
            labels.append(f"{case} x{ranks}")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("seconds from the case's first timed step (one bar per step; colour = rank)")
        ax.set_title(f"{args.preset}, {tokens} tokens a step, {os.cpu_count()} cores: steps of each rank")
        fig.tight_layout()
        return fig

    notes = (
        f"{args.preset}, global batch {args.batch} x {args.seq_len} tokens x 2 micro-batches, split between the"
        f" ranks; median of {args.steps} timed steps (a step's time: its slowest rank's). This machine: {os.cpu_count()} cores,"
        " gloo over loopback (the ranks compute on the CPU); each rank gets cores/ranks threads, so 2 ranks compute no faster than 1 (on a"
        " multi-GPU server each rank has its own GPU), while the optimizer's work and NVMe traffic split between"
        " them. optimizer_nvme_GB_per_rank_step: the optimizer"
        " store's bytes read + written per step per rank (streaming's weight traffic is each rank's own, not"
        " split). Planner, 8x H100 SXM + 4 Gen4 NVMe each (predicted, not measured):"
        f" {predicted['request']}: {predicted['step_s']:.3g} s a step, {predicted['tokens_per_s']:,.0f} tokens/s,"
        f" {predicted['bottleneck']} bound."
    )
    return save_report(
        "bench_distributed", rows, settings={"preset": args.preset, "batch": args.batch, "seq_len": args.seq_len,
                                              "steps": args.steps, "wall_s": time.time() - started},
        plot_column="tokens_per_s", notes=notes, results_dir=Path(args.results_dir),
        extra={"spans": {f"{c} x{n}": [r["spans"] for r in rs] for (c, n), rs in runs.items()}, "eight_gpu_plan": predicted},
        plot=plot,
    )  # fmt: skip


if __name__ == "__main__":
    main()
    # Everything is written (and a rank's process group destroyed): leave without interpreter finalization.
    # There, torch 2.13's gloo thread can still release a DDP collective, take the GIL and abort the process
    # ("terminate called without an active exception", no Python frame left): 5 of 45 exits of the ddp case
    # on 2 ranks beside a busy loop, none of 40 of nvoffload's optimizer case (TORCH_GLOO_EXIT in
    # tests/test_distributed.py). The torchrun of the peer then failed the whole benchmark.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
