"""Scale run: a GPT whose training state is many times the host and device budgets, all three tiers at once.

The model is built on the meta device and initialized block by block straight
into the store (it never exists in memory whole). Each step reports its time
split into compute (forward + backward minus the time spent waiting for
parameter blocks and for the optimizer), I/O wait (parameter blocks), and the
optimizer (backward waiting for it to take gradients, plus ``step()``), the GB read
and written, each tier's peak, and the process's peak RSS. On this CPU-only
machine the "device" is host memory too, so the RSS bound is the host budget
plus the device budget plus a fixed overhead (the interpreter, torch, the
model's activations, the I/O threads' bounce buffers).

``--recipe`` runs the fine-tuning recipes one after another in one process
(each on a fresh model and store), to compare step time and NVMe bytes per
step with and without gradient clipping and accumulation: ``plain``,
``clip`` (max_grad_norm 1.0), ``accum`` (2 micro-batches), ``clip+accum``,
and ``accum+clip-unbitten`` (max_grad_norm so large it never clips: what
keeping the gradients costs when the speculative updates stand); ``accum4``
(4 micro-batches, each streaming every block) beside ``vertical4`` and
``clip+vertical4`` (the same 4 by :func:`nvoffload.vertical_step`: each block
over the 4 while on the device). Clipping's two ways (``defer_updates``): ``clip+vertical4``
takes the rule (speculate, defer the step after one that clipped); ``-speculative`` and
``-deferred`` force one, with clipping that bites (``clip+vertical4-...``) and that never
does (``unbitten+vertical4-...``). ``plain-delayed`` and ``vertical4-delayed`` take the delayed update (not exact
AdamW: each step's updates run during the next step, which trains on the weights of before them).

    python bench/bench_streaming.py [--quick] [--preset gpt2-1.3b] [--cpu-memory-gib 4] [--device-memory-gib 2]
        [--recipe plain --recipe clip+accum ...] [--trace]

``--bound`` adds the step's limits, measured in the same run: compute alone (plain torch, the model in memory,
no optimizer: the largest recipe's micro-batches, each block recomputed in backward as the streamed step does)
and the NVMe bound (each streamed step's bytes at the swap directory's store bandwidth, reads and writes one
after the other on one drive); each streamed step's time over max(compute alone, NVMe bound) is in the notes.

``--trace`` records the first recipe's last step (:mod:`nvoffload.trace`) and draws its timeline: every
block's compute, the waits for weights, each copy, NVMe read and write and Adam chunk on its own row.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import plot_trace, save_report  # noqa: E402

import nvoffload  # noqa: E402
from nvoffload import trace  # noqa: E402
from nvoffload.models import GPT, GPTConfig  # noqa: E402
from nvoffload.planner.calibrate import store_bandwidth  # noqa: E402
from nvoffload.trace import Trace  # noqa: E402

GiB = 1 << 30
# name: (max_grad_norm, gradient_accumulation_steps, by the vertical schedule, defer_updates, delayed_update)
RECIPES = {
    "plain": (None, 1, False, None, False),
    "clip": (1.0, 1, False, None, False),
    "accum": (None, 2, False, None, False),
    "clip+accum": (1.0, 2, False, None, False),
    "accum+clip-unbitten": (1e9, 2, False, None, False),
    "accum4": (None, 4, False, None, False),
    "vertical4": (None, 4, True, None, False),
    "clip+vertical4": (1.0, 4, True, None, False),
    "clip+vertical4-speculative": (1.0, 4, True, False, False),
    "clip+vertical4-deferred": (1.0, 4, True, True, False),
    "unbitten+vertical4-speculative": (1e9, 4, True, False, False),
    "unbitten+vertical4-deferred": (1e9, 4, True, True, False),
    "plain-delayed": (None, 1, False, None, True),
    "vertical4-delayed": (None, 4, True, None, True),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small preset, tiny budgets: a smoke run")
    p.add_argument("--preset", default="gpt2-1.3b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--cpu-memory-gib", type=float, default=4.0)
    p.add_argument("--device-memory-gib", type=float, default=2.0)
    p.add_argument("--device", default=None, help="the compute device (default: CUDA when present, else the CPU)")
    p.add_argument("--swap-dir", default=None, help="directory on NVMe (default: a temporary one under /tmp)")
    p.add_argument(
        "--retain-host-memory", action="store_true",
        help="keep freed host memory in the process (faster steps, higher peak RSS): OffloadConfig.retain_host_memory",
    )
    p.add_argument("--recipe", action="append", choices=sorted(RECIPES), help="default: plain (repeat for several)")
    p.add_argument("--trace", action="store_true", help="trace the first recipe's last step: <name>_trace.json (Perfetto) and its timeline <name>_trace.png")
    p.add_argument("--bound", action="store_true", help="also measure compute alone and the swap directory's bandwidth: each step against max(compute, NVMe)")
    p.add_argument("--name", default="bench_streaming")
    p.add_argument("--results-dir", type=Path, default=None, help="default: bench/results")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.steps, args.cpu_memory_gib, args.device_memory_gib = "small", 3, 0.03, 0.02
    args.recipe = args.recipe or ["plain"]
    return args


def run_recipe(args, cfg: GPTConfig, recipe: str, traced: bool = False) -> tuple[list[dict], float, Trace | None]:
    """Train ``args.steps`` steps with ``recipe`` on a fresh model built on the meta device; rows, init time, and
    with ``traced`` the trace of the last step."""
    max_grad_norm, accum, vertical, defer, delayed = RECIPES[recipe]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    rows = []
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap:
        t0 = time.perf_counter()
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1),
            nvoffload.OffloadConfig(
                swap_dirs=[swap], cpu_memory_bytes=int(args.cpu_memory_gib * GiB),
                device_memory_bytes=int(args.device_memory_gib * GiB), retain_host_memory=args.retain_host_memory,
                max_grad_norm=max_grad_norm, gradient_accumulation_steps=accum, device=args.device,
                defer_updates=defer, delayed_update=delayed,
            ),
            param_init_fn=model.init_weights,
        )  # fmt: skip
        init_s = time.perf_counter() - t0
        session = opt.session
        x = x.to(session.streamer.device)
        recorded = None
        for step in range(args.steps):
            tracing = traced and step == args.steps - 1
            if tracing:
                trace.start()
            session.reset_stats()
            deferred = opt.defers_updates
            t0 = time.perf_counter()
            micro_batches = [(x.roll(micro, dims=1), x.roll(micro - 1, dims=1)) for micro in range(accum)]
            if vertical:  # forward, backward and step() in one call: its step() is the wait for the last updates
                loss = nvoffload.vertical_step(opt, micro_batches).mean()
                t1 = time.perf_counter()
            else:
                for micro_batch in micro_batches:
                    loss = model(*micro_batch)
                    (loss / accum).backward()
                t1 = time.perf_counter()
                opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            if tracing:
                recorded = trace.stop()
            read, written = session.io_bytes()
            tiers = session.memory_stats()
            streamed = session.streamer.stats()
            io_wait, grad_wait = streamed.io_wait_s, streamed.grad_wait_s
            norm = opt.grad_norm()
            rows.append({
                "case": f"{recipe} step {step}" + (" (traced)" if tracing else ""),
                "loss": float(loss.detach()),  # the last micro-batch's (vertical: the mean of the step's)
                "grad_norm": norm,
                "clipped": max_grad_norm is not None and norm > max_grad_norm,
                "deferred": deferred,
                "step_s": t2 - t0,
                "compute_s": t1 - t0 - io_wait - grad_wait,
                "io_wait_s": io_wait,
                "optimizer_s": grad_wait + (t2 - t1),
                "step_call_s": t2 - t1,
                "read_gb": read / 1e9,
                "written_gb": written / 1e9,
                "io_gb_per_s": (read + written) / 1e9 / (t2 - t0),
                "device_peak_gib": tiers["device"].peak_bytes / GiB,
                "host_peak_gib": tiers["host"].peak_bytes / GiB,
                "nvme_gib": tiers["nvme"].used_bytes / GiB,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
            })  # fmt: skip
            print(rows[-1], flush=True)
        session.close()
    return rows, init_s, recorded


def run_compute_alone(args, cfg: GPTConfig, accum: int) -> list[dict]:
    """``args.steps`` steps of plain torch on the model in memory, without an optimizer: ``accum`` micro-batches
    (those of :func:`run_recipe`) forward and backward, each block under non-reentrant checkpointing so its
    activations are recomputed in backward as in the streamed step. The rows' ``step_s`` is compute alone."""
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device)
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=args.device)
    micro_batches = [(x.roll(micro, dims=1), x.roll(micro - 1, dims=1)) for micro in range(accum)]
    rows = []
    for step in range(args.steps):
        model.zero_grad(set_to_none=True)
        synchronize(args.device)
        t0 = time.perf_counter()
        for micro_batch in micro_batches:
            loss = model(*micro_batch)
            (loss / accum).backward()
        synchronize(args.device)
        seconds = time.perf_counter() - t0
        rows.append({"case": f"compute alone x{accum} step {step}", "loss": float(loss.detach()), "step_s": seconds, "compute_s": seconds})
        print(rows[-1], flush=True)
    return rows


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bound_notes(rows: list[dict], compute_s: float, write_gbps: float, read_gbps: float) -> str:
    """Each streamed step after the first against max(compute alone, its NVMe bytes at the store's bandwidth)."""
    parts = []
    for row in rows:
        if row["case"].startswith("compute alone") or " step 0" in row["case"]:
            continue
        nvme_s = row["read_gb"] / read_gbps + row["written_gb"] / write_gbps
        row["nvme_bound_s"], row["vs_bound"] = nvme_s, row["step_s"] / max(compute_s, nvme_s)
        parts.append(f"{row['case']}: {row['step_s']:.1f} s = {row['vs_bound']:.2f}x max(compute {compute_s:.1f} s, NVMe {nvme_s:.1f} s)")
    return (
        f"\n\nBounds, measured in this run: compute alone (the median step of plain torch, blocks recomputed, no "
        f"optimizer) {compute_s:.1f} s; the swap directory's store writes {write_gbps:.2f} GB/s and reads "
        f"{read_gbps:.2f} GB/s (one drive: a step's NVMe bound is its reads plus its writes at those rates). "
        + "; ".join(parts) + "."
    )


def main(argv=None) -> Path:
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    base = GPTConfig.preset(args.preset)
    cfg = GPTConfig(**{**base.__dict__, "seq_len": args.seq_len})
    n_params = cfg.num_parameters
    # fp32 parameters and gradients, fp32 master weights (the parameters themselves) and two moments
    state_bytes = n_params * (4 + 4 + 12)
    host_budget, device_budget = int(args.cpu_memory_gib * GiB), int(args.device_memory_gib * GiB)
    rows, init_s, recorded = [], 0.0, None
    for i, recipe in enumerate(args.recipe):
        recipe_rows, init_s, traced = run_recipe(args, cfg, recipe, traced=args.trace and i == 0)
        recorded = recorded or traced
        rows += recipe_rows
    bounds, alone = "", []
    if args.bound:
        accum = max(RECIPES[recipe][1] for recipe in args.recipe)
        alone = run_compute_alone(args, cfg, accum)
        with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap:
            drive = store_bandwidth([swap], (256 if args.quick else 2048) << 20)
        compute_s = statistics.median(row["step_s"] for row in alone[1:] or alone)
        bounds = bound_notes(rows, compute_s, drive.write_gbps, drive.read_gbps)
    budget = host_budget + device_budget
    settings = {
        "preset": args.preset, "params": n_params, "batch": args.batch, "seq_len": args.seq_len,
        "cpu_memory_bytes": host_budget, "device_memory_bytes": device_budget,
        "training_state_bytes": state_bytes, "state_vs_host_budget": state_bytes / host_budget,
        "state_vs_device_budget": state_bytes / device_budget, "init_s": init_s,
        "retain_host_memory": args.retain_host_memory, "device": args.device, "recipes": {r: RECIPES[r] for r in args.recipe},
    }  # fmt: skip
    overhead = max(r["peak_rss_gib"] for r in rows) - budget / GiB
    notes = (
        f"{n_params / 1e9:.2f}B parameters; training state {state_bytes / GiB:.1f} GiB = "
        f"{state_bytes / host_budget:.1f}x the host budget and {state_bytes / device_budget:.1f}x the device budget. "
        f"Peak RSS minus (host + device budgets) = {overhead:.2f} GiB (the fixed overhead: interpreter, torch, "
        "activations, I/O buffers). "
        + ("On the CPU the device tier is host memory. " if args.device == "cpu" else f"Computed on {args.device}. ")
        + f"Built on the meta device and written to the store block by block in {init_s:.1f} s."
        + (" Recipes run one after another in this process: peak RSS is the process's so far." if len(rows) > args.steps else "")
        + bounds
    )
    where = {} if args.results_dir is None else {"results_dir": args.results_dir}
    path = save_report(args.name, rows + alone, settings=settings, plot_column="step_s", notes=notes, **where)
    if recorded is not None:
        save_trace(recorded, path.parent / f"{args.name}_trace", f"{args.preset}: one streamed step ({args.recipe[0]})")
    return path


def save_trace(recorded: Trace, stem: Path, title: str) -> None:
    """The trace as ``<stem>.json`` (open it in https://ui.perfetto.dev) and its timeline as ``<stem>.png``."""
    recorded.write(stem.with_suffix(".json"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_trace(plt, recorded.spans(), title)
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
