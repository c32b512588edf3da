"""The planner checked against the engine: ``calibrate`` this machine, then for several configurations
``plan`` a step and run it for real, in the same run; the table shows predicted and measured step times,
their ratio, and the worst ratio.

Configurations (a GPT on ``--device``: CUDA when present, else the CPU standing in for it): the optimizer
alone (the model on the device, its AdamW state on NVMe) and streaming (all three tiers), two host budgets,
activation offload on and off, two batch sizes, four micro-batches a step by the vertical schedule
(:func:`nvoffload.vertical_step`). Then ``nvoffload finetune`` commands as a user runs them (each
in a process of its own; with --quick through its entry point in this process; some with ``--plan auto`` and the
profile just measured), each beside ``nvoffload plan`` given the same flags verbatim: the ``small`` preset
(3.3M parameters) optimizer only, streamed with activation offload, and streamed with four micro-batches a
step, and GPT-2 124M (with --quick: the
``tiny`` preset with ``--plan auto``, optimizer only, and streamed with activation offload).

Each case runs ``--repeats`` times, in turns (every case once, then again: a load that comes and goes on the
machine falls on all of them), each time ``--steps`` steps after a warm-up step that is not counted (for
``finetune``: the steps after the first, from the tokens/s it printed). The plan is compared with the median of
all those steps; the table also shows the fastest and the slowest repetition's median (the spread).

    python bench/bench_plan.py            # calibrate (about 40 s), then the configurations
    python bench/bench_plan.py --quick    # smaller sizes: a smoke run
    python bench/bench_plan.py --device cpu   # the CPU as the device, also where a GPU is present
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, nvoffload_command, save_report  # noqa: E402

import nvoffload  # noqa: E402
from nvoffload.models import GPT, GPTConfig  # noqa: E402
from nvoffload.optim import NVMeAdamW  # noqa: E402
from nvoffload.planner import ModelShape, PlanRequest, plan  # noqa: E402
from nvoffload.planner.calibrate import calibrate  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    name: str
    stream: bool
    batch: int
    cpu_memory_bytes: int
    offload_activations: bool = False
    grad_accum: int = 1  # micro-batches a step (streamed: by the vertical schedule)


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("optimizer only", False, 2, 16 * MiB), Case("streaming", True, 2, 24 * MiB),
                Case("streaming, 4 micro-batches", True, 1, 24 * MiB, grad_accum=4)]  # fmt: skip
    return [
        Case("optimizer only, batch 8", False, 8, 64 * MiB),
        Case("optimizer only, batch 16", False, 16, 64 * MiB),
        Case("streaming, 320 MiB host (all cached)", True, 8, 320 * MiB),
        Case("streaming, 96 MiB host (3 of 8 blocks)", True, 8, 96 * MiB),
        Case("streaming, 96 MiB host, batch 16", True, 16, 96 * MiB),
        Case("streaming + activation offload", True, 8, 320 * MiB, offload_activations=True),
        Case("streaming, 96 MiB host, 4 micro-batches of 2", True, 2, 96 * MiB, grad_accum=4),
    ]


def finetune_commands(quick: bool) -> dict[str, list[str]]:
    """``nvoffload finetune`` commands' flags, given to ``nvoffload plan`` as they are."""
    if quick:  # the same three kinds of command, on the tiny preset
        tiny = ["--preset", "tiny", "--batch-size", "2"]
        return {
            "finetune tiny": [*tiny, "--cpu-memory", "16M", "--device-memory", "64M", "--plan", "auto"],
            "finetune tiny, optimizer only": tiny,
            "finetune tiny, streamed, activations offloaded": [*tiny, "--stream", "--offload-activations", "--cpu-memory", "16M"],
        }
    small = {
        "finetune small, optimizer only": ["--preset", "small", "--batch-size", "8"],
        "finetune small, streamed, activations offloaded": ["--preset", "small", "--batch-size", "8", "--stream",
                                                            "--offload-activations", "--cpu-memory", "64M"],
        "finetune small, streamed, 4 micro-batches": ["--preset", "small", "--batch-size", "2", "--grad-accum", "4",
                                                      "--stream", "--cpu-memory", "64M"],
    }  # fmt: skip
    gpt2 = ["--preset", "gpt2-124m", "--seq-len", "128", "--batch-size", "4", "--plan", "auto"]
    return {
        **small,
        "finetune gpt2-124m, 4G device": [*gpt2, "--cpu-memory", "256M", "--device-memory", "4G"],
        "finetune gpt2-124m, 512M device": [*gpt2, "--cpu-memory", "512M", "--device-memory", "512M"],
    }


def finetune_flags(flags: list[str], swap: str, steps: int, device: str) -> list[str]:
    """``flags`` with the run's length (a warm-up step and ``steps``), swap directory and device."""
    return [*flags, "--steps", str(steps + 1), "--swap-dir", swap, "--device", device, "--no-progress"]


def plan_finetune(flags: list[str], profile_path: str) -> dict:
    """``nvoffload plan`` of the ``finetune`` command line ``flags`` (its JSON, for the profile's device)."""
    status, out, err = nvoffload_command(["plan", *flags, "--profile", profile_path, "--json"])
    if status != 0:
        raise RuntimeError(f"nvoffload plan {' '.join(flags)} does not fit:\n{out[-3000:]}{err[-3000:]}")
    planned = json.loads(out)
    if "--plan" not in flags and (planned["stream"], planned["activations"]) != ("--stream" in flags, "offload" if "--offload-activations" in flags else "keep"):
        raise RuntimeError(f"nvoffload plan chose another run than finetune {' '.join(flags)} starts: {planned['placement']}")
    return planned


def run_finetune(flags: list[str], profile_path: str, steps: int, tokens: int, fresh_process: bool) -> list[float]:
    """The seconds of each step after the first that ``nvoffload finetune`` with ``flags`` printed (as tokens/s
    of its ``tokens`` a step); ``fresh_process``: run as a user runs it (the measured runs), else in this process
    (the quick smoke run)."""
    if torch.cuda.is_available() and not fresh_process:
        torch.cuda.empty_cache()  # the memory the cases before it freed, for its device budget
    status, out, err = nvoffload_command(["finetune", *flags, *(["--profile", profile_path] if "--plan" in flags else [])], fresh_process)
    if status != 0:
        raise RuntimeError(f"nvoffload finetune {' '.join(flags)} failed:\n{err[-3000:]}")
    tokens_per_s = [float(m.replace(",", "")) for m in re.findall(r"\| ([\d,.]+) tok/s", out)]
    if len(tokens_per_s) != steps + 1:
        raise RuntimeError(f"expected {steps + 1} step lines from finetune, got:\n{out[-3000:]}")
    return [tokens / t for t in tokens_per_s[1:]]


def measure(case: Case, cfg: GPTConfig, swap: str, steps: int, device_memory_bytes: int, device: str) -> list[float]:
    """The time of each of ``steps`` steps of the real engine on ``device`` (after a warm-up step)."""
    torch.manual_seed(0)
    if case.stream:
        with torch.device("meta"):
            model = GPT(cfg)
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4),
            nvoffload.OffloadConfig(
                swap_dirs=[swap], cpu_memory_bytes=case.cpu_memory_bytes, device_memory_bytes=device_memory_bytes,
                offload_activations=case.offload_activations, device=device,
            ),
            param_init_fn=model.init_weights,
        )  # fmt: skip
    else:
        model = GPT(cfg).to(device)
        opt = NVMeAdamW(model.parameters(), lr=1e-4, swap_dir=swap, cpu_memory_bytes=case.cpu_memory_bytes)
    x = torch.randint(0, cfg.vocab_size, (case.batch, cfg.seq_len), device=device)
    micro_batches = [(x.roll(i, dims=1), x.roll(i - 1, dims=1)) for i in range(case.grad_accum)]
    times = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            if case.grad_accum > 1:  # streamed: forward, backward and step() by the vertical schedule
                nvoffload.vertical_step(opt, micro_batches)
            else:
                model(*micro_batches[0]).backward()
                opt.step()
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - start)
    finally:
        opt.close()
    return times


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=6, help="steps timed each repetition, after a warm-up step")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each case, in turns")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when present")
    p.add_argument("--swap-dir", default=None, help="default: a temporary directory under /tmp")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    cfg = GPTConfig(seq_len=64 if args.quick else 128, n_layer=4 if args.quick else 8, n_head=8, d_model=256 if args.quick else 512)
    shape = ModelShape("bench", cfg.n_layer, cfg.d_model, cfg.n_head, cfg.mlp_ratio * cfg.d_model, cfg.vocab_size, cfg.seq_len)
    device_memory_bytes = 256 * MiB
    steps, repeats = (2, 1) if args.quick else (args.steps, args.repeats)
    loads = [os.getloadavg()[0]]  # at the start and after each run
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap:
        profile = calibrate([swap], device=args.device, quick=args.quick)
        profile_path = str(Path(swap) / "profile.json")
        profile.save(profile_path)
        runs = {}  # name: (the plan as a dict, how to run it once: its steps' seconds)
        for case in cases(args.quick):
            request = PlanRequest(
                shape, batch_size=case.batch, seq_len=cfg.seq_len, dtype="float32",
                cpu_memory_bytes=case.cpu_memory_bytes, device_memory_bytes=device_memory_bytes,
                stream=case.stream, activations="offload" if case.offload_activations else "keep",
                grad_accum_steps=case.grad_accum,
            )  # fmt: skip
            runs[case.name] = (plan(request, profile).to_dict(),
                               lambda case=case: measure(case, cfg, swap, steps, device_memory_bytes, args.device))  # fmt: skip
        commands = []
        for name, flags in finetune_commands(args.quick).items():
            flags = finetune_flags(flags, swap, steps, args.device)
            planned = plan_finetune(flags, profile_path)
            label = f"{name}: stream {planned['stream']}, activations {planned['activations']}"
            runs[label] = (planned, lambda flags=flags, planned=planned: run_finetune(flags, profile_path, steps, tokens_per_step(planned), not args.quick))
            commands.append(f"{label}: `nvoffload finetune {' '.join(flags[: flags.index('--steps')])} --device {args.device}`")
        times = {name: [] for name in runs}  # each repetition's step times
        for turn in range(repeats):
            for name, (_, run) in runs.items():
                times[name].append(run())
                loads.append(os.getloadavg()[0])
                print(f"{name} ({turn + 1}/{repeats}): steps {', '.join(f'{t:.3f}' for t in times[name][-1])} s", flush=True)
        rows = [row(name, planned, times[name]) for name, (planned, _) in runs.items()]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    load = (f"Load average (1 minute) {loads[0]:.1f} at the start, {loads[-1]:.1f} at the end, {min(loads):.1f} to {max(loads):.1f}"
            f" after the runs, on {os.cpu_count()} cores.")
    notes = (
        f"GPT d_model {cfg.d_model}, {cfg.n_layer} layers, seq {cfg.seq_len}, fp32 ({shape.params / 1e6:.1f}M parameters)."
        f" Profile calibrated in this run: {profile.source}. Worst ratio {worst['ratio']:.3f} ({worst['case']});"
        f" every ratio within 15%: {all(abs(r['ratio'] - 1) <= 0.15 for r in rows)}. Measured: the median of {repeats} x {steps}"
        f" steps, each repetition after a warm-up step; low and high: the fastest and slowest repetition's median. {load}\n\n"
        + "\n".join(f"- {c}" for c in commands)
    )
    return save_report(
        "bench_plan", rows, settings={"steps": steps, "repeats": repeats, "quick": args.quick, "device": args.device, "model": shape.__dict__},
        plot_column="ratio", notes=notes, results_dir=args.results_dir,
        extra={"profile": profile.to_json(), "worst_ratio": worst["ratio"]},
        plot=lambda plt: plot_predicted_vs_measured(plt, rows),
    )  # fmt: skip


def tokens_per_step(planned: dict) -> int:
    r = planned["request"]
    return r["batch_size"] * r["seq_len"] * r["grad_accum_steps"]


def row(name: str, planned: dict, repetitions: list[list[float]]) -> dict:
    """A table row: the plan (``Plan.to_dict()``) beside the measured steps (their median; the fastest and slowest
    repetition's median)."""
    engines = planned["engine_s"]
    measured_s = statistics.median(t for times in repetitions for t in times)
    each = [statistics.median(times) for times in repetitions]
    return {
        "case": name, "predicted_s": planned["step_s"], "measured_s": measured_s, "ratio": planned["step_s"] / measured_s,
        "measured_low_s": min(each), "measured_high_s": max(each),
        "tokens_per_s_predicted": planned["tokens_per_s"], "tokens_per_s_measured": tokens_per_step(planned) / measured_s,
        "bottleneck": planned["bottleneck"], "forward_s": planned["phases_s"]["forward"], "backward_s": planned["phases_s"]["backward"],
        "compute_s": engines["compute"], "nvme_s": engines["nvme"], "cached_blocks": planned["cached_blocks"],
    }  # fmt: skip


def plot_predicted_vs_measured(plt, rows: list[dict]):
    """Each case's predicted step (split into its forward and backward phases) beside the measured one."""
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        ax.barh(i - 0.2, r["forward_s"], 0.38, color="tab:blue", label="predicted forward" if i == 0 else None)
        ax.barh(i - 0.2, r["predicted_s"] - r["forward_s"], 0.38, left=r["forward_s"], color="tab:cyan",
                label="predicted backward and step()" if i == 0 else None)  # fmt: skip
        spread = [[r["measured_s"] - r["measured_low_s"]], [r["measured_high_s"] - r["measured_s"]]]
        ax.barh(i + 0.2, r["measured_s"], 0.38, xerr=spread, color="tab:orange", label="measured (repetitions' spread)" if i == 0 else None)
        ax.text(max(r["predicted_s"], r["measured_high_s"]), i, f" x{r['ratio']:.2f}", va="center")
    ax.set_yticks(range(len(rows)), [r["case"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds a step (ratio: predicted / measured)")
    ax.set_xlim(0, 1.12 * max(max(r["predicted_s"], r["measured_high_s"]) for r in rows))
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
