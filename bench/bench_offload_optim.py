"""The NVMe optimizer against its engines: does the step cost little more than its slowest engine?

A GPT-style model (``gpt2-350m`` by default, ~350M parameters, on this
machine's CPU), five cases, each in its own process so that its peak resident
memory is its own (with ``--quick``: the first four in one process):

1. ``fwd_bwd``: forward + backward alone.
2. ``optim``: ``NVMeAdamW.step()`` alone (gradients given), state on NVMe.
3. ``full``: forward + backward + step, updates overlapping backward.
4. ``adamw_ram``: forward + backward + ``torch.optim.AdamW`` with its state in RAM.
5. ``full_unretained``: ``full`` with glibc's default of handing freed memory
   back to the OS (every other case runs after
   :func:`nvoffload.memory.retain_freed_host_memory`, as the optimizer does by default).
6. ``full_delayed``: ``full`` with ``delayed_update=True`` (opt-in, not exact AdamW): each step's updates
   run during the next step's forward and backward instead of during backward and ``step()``.

Reports the median step time and peak RSS of each case and
``overlap = full / max(fwd_bwd, optim)`` (target: <= 1.2), and the same for
``full_delayed``. Choose ``--batch`` and ``--seq-len`` so that cases 1 and 2 are
within a factor of two. After its timed steps, each of ``full`` and
``full_delayed`` traces two more steps (:mod:`nvoffload.trace`: the training
thread's forward + backward and, on a lane of their own, its ``step()`` calls; the Adam kernel's chunks, the
store's reads and writes); the plot is those two timelines, one above the other.

Before the cases, a contention probe (:mod:`nvoffload.planner.contention`) measures how much
compute and I/O slow each other down on this machine; the report gives its
figures (JSON key ``contention``) and the overlap floor they allow for this
step: the fwd_bwd time as compute and the bytes the optim case moves per step
as I/O.

    python bench/bench_offload_optim.py [--quick] [--swap-dir DIR] [--batch B] [--seq-len T]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, plot_trace, save_report  # noqa: E402

from nvoffload.planner.contention import QUICK as CONTENTION_QUICK  # noqa: E402
from nvoffload.planner.contention import measure_contention  # noqa: E402

CASES = ["fwd_bwd", "optim", "full", "adamw_ram", "full_unretained", "full_delayed"]
TRACED = ("full", "full_delayed")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model, two timed steps, four cases in one process (smoke test)")
    p.add_argument("--preset", default="gpt2-350m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up step)")
    p.add_argument("--cpu-memory-mib", type=int, default=512)
    p.add_argument("--swap-dir", default=None, help="directory on NVMe (default: a temporary one under /tmp)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="bench_offload_optim", help="the results' file name")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.batch, args.seq_len, args.steps, args.cpu_memory_mib = "small", 2, 64, 2, 16
    return args


def run_case(args) -> dict:
    import torch

    from nvoffload import trace
    from nvoffload.memory import retain_freed_host_memory
    from nvoffload.models import GPT, GPTConfig
    from nvoffload.optim.offload import NVMeAdamW

    torch.manual_seed(0)
    base = GPTConfig.preset(args.preset)
    cfg = GPTConfig(**{**base.__dict__, "seq_len": args.seq_len})
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    opt = None
    retain = args.case != "full_unretained"
    if retain:
        retain_freed_host_memory()
    if args.case in ("optim", "full", "full_unretained", "full_delayed"):
        opt = NVMeAdamW(
            model.parameters(), lr=1e-4, swap_dir=args.swap_dir, cpu_memory_bytes=args.cpu_memory_mib << 20,
            retain_host_memory=retain, delayed_update=args.case == "full_delayed",
        )  # fmt: skip
    elif args.case == "adamw_ram":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.case == "optim":
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    times, io_bytes = [], []

    def step() -> None:
        recording = trace.active()
        t0 = time.monotonic_ns()
        if args.case != "optim":
            model(x, x).backward()
        t1 = time.monotonic_ns()
        if opt is not None:
            opt.step()
        if args.case != "optim":
            model.zero_grad(set_to_none=True)
        if recording is not None:
            recording.add("compute", "forward + backward", t0, t1)
            recording.add("step() call", "step() + zero_grad()", t1, time.monotonic_ns())

    for i in range(args.steps + 2):  # two warm-up steps: the first learns the gradient order
        if opt is not None and hasattr(opt, "reset_io_stats"):
            opt.reset_io_stats()
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        if i >= 2:
            times.append(dt)
            if hasattr(opt, "memory_stats"):
                st = opt.memory_stats()
                io_bytes.append(st.read_bytes + st.written_bytes)
    row = {
        "case": args.case,
        "step_s": statistics.median(times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "io_gb_per_s": (statistics.median(io_bytes) / statistics.median(times) / 1e9) if io_bytes else 0.0,
    }
    if args.case in TRACED:
        with trace.tracing() as recorded:
            for _ in range(2):
                step()
            opt.synchronize()  # the delayed update of the second step lands inside the trace
        row["timeline"] = recorded.spans()
    if hasattr(opt, "close"):
        row["host_staging_mib"] = opt.memory_stats().host_peak_bytes / 2**20
        opt.close()
    return row


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.case:  # child process: each case (separated by commas) in turn, their rows as a JSON list
        rows = [run_case(argparse.Namespace(**{**vars(args), "case": case})) for case in args.case.split(",")]
        Path(args.out).write_text(json.dumps(rows))
        return Path(args.out)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap, tempfile.TemporaryDirectory() as tmp:
        probe = measure_contention(swap, **(CONTENTION_QUICK if args.quick else {}))
        print(probe.describe())
        # each case in a process of its own; --quick: the retained cases in one (the model's peak RSS is small
        # beside the imports') and full_unretained in another (glibc's settings are the process's)
        retained = [c for c in cases if c != "full_unretained"]
        groups = [retained, [c for c in cases if c not in retained]] if args.quick else [[c] for c in cases]
        for group in filter(None, groups):
            out = os.path.join(tmp, f"{group[0]}.json")
            cmd = [sys.executable, __file__, "--case", ",".join(group), "--out", out, "--swap-dir", swap,
                   "--preset", args.preset, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                   "--steps", str(args.steps), "--cpu-memory-mib", str(args.cpu_memory_mib)]  # fmt: skip
            subprocess.run(cmd, check=True)
            for row in json.loads(Path(out).read_text()):
                row.setdefault("host_staging_mib", 0.0)
                rows.append(row)
    rows.sort(key=lambda r: cases.index(r["case"]))
    by = {r["case"]: r for r in rows}
    notes = [probe.describe()]
    contention = probe.to_dict()
    if {"fwd_bwd", "optim"} <= set(by):
        compute_s, io_s = by["fwd_bwd"]["step_s"], by["optim"]["step_s"]
        floor = probe.overlap_floor(compute_s, io_s)
        contention.update(overlap_floor=floor, floor_compute_s=compute_s, floor_io_s=io_s)
        notes.append(
            f"overlap floor on this machine = {floor:.2f} (fwd_bwd's {compute_s:.3g} s beside optim's {io_s:.3g} s,"
            " each slowed by the probe's factors while the other runs)"
        )
    if {"fwd_bwd", "optim", "full"} <= set(by):
        slowest = max(by["fwd_bwd"]["step_s"], by["optim"]["step_s"])
        ratio = by["full"]["step_s"] / slowest
        notes.insert(
            0,
            f"overlap = full / max(fwd_bwd, optim) = {ratio:.2f} (target <= 1.2);"
            f" fwd_bwd / optim = {by['fwd_bwd']['step_s'] / by['optim']['step_s']:.2f}",
        )
        for r in rows:
            r["overlap"] = ratio if r["case"] == "full" else 0.0
        if "full_delayed" in by:
            delayed = by["full_delayed"]["step_s"] / slowest
            by["full_delayed"]["overlap"] = delayed
            notes.insert(
                1,
                f"delayed update: full_delayed / max(fwd_bwd, optim) = {delayed:.2f}; full_delayed / full ="
                f" {by['full_delayed']['step_s'] / by['full']['step_s']:.2f} (each step's updates during the next"
                " forward and backward; not exact AdamW)",
            )
    timelines = {r["case"]: r.pop("timeline") for r in rows if "timeline" in r}
    settings = {k: getattr(args, k) for k in ("preset", "batch", "seq_len", "steps", "cpu_memory_mib", "quick")}

    def plot(plt):
        fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 3 * len(timelines)), squeeze=False)
        for ax, (case, spans) in zip(axes[:, 0], timelines.items()):
            plot_trace(plt, spans, f"{case}: two traced steps ({args.preset}, median step {by[case]['step_s']:.3g} s)", ax=ax)
        fig.tight_layout()
        return fig

    return save_report(args.name, rows, settings=settings, plot_column="step_s", notes="\n\n".join(notes),
                       results_dir=Path(args.results_dir), extra={"contention": contention, "timelines": timelines},
                       plot=plot if timelines else None)  # fmt: skip


if __name__ == "__main__":
    main()
