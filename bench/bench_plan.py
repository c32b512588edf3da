"""The planner checked against the engine: ``calibrate`` this machine, then for several configurations
``plan`` a step and run it for real, in the same run; the table shows predicted and measured step times,
their ratio, and the worst ratio.

Configurations (a GPT on the CPU standing in for the device): the optimizer alone (the model on the
device, its AdamW state on NVMe) and streaming (all three tiers), two host budgets, activation offload on
and off, two batch sizes. Each runs ``--steps`` steps after one warm-up step; the median step is compared.

    python bench/bench_plan.py            # calibrate (about 30 s), then the configurations
    python bench/bench_plan.py --quick    # smaller sizes: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, save_report  # noqa: E402

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


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("optimizer only", False, 2, 16 * MiB), Case("streaming", True, 2, 24 * MiB)]
    return [
        Case("optimizer only, batch 8", False, 8, 64 * MiB),
        Case("optimizer only, batch 16", False, 16, 64 * MiB),
        Case("streaming, 320 MiB host (all cached)", True, 8, 320 * MiB),
        Case("streaming, 96 MiB host (3 of 8 blocks)", True, 8, 96 * MiB),
        Case("streaming, 96 MiB host, batch 16", True, 16, 96 * MiB),
        Case("streaming + activation offload", True, 8, 320 * MiB, offload_activations=True),
    ]


def measure(case: Case, cfg: GPTConfig, swap: str, steps: int, device_memory_bytes: int) -> float:
    """The median step time of ``steps`` steps of the real engine (after a warm-up step)."""
    torch.manual_seed(0)
    if case.stream:
        with torch.device("meta"):
            model = GPT(cfg)
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4),
            nvoffload.OffloadConfig(
                swap_dirs=[swap], cpu_memory_bytes=case.cpu_memory_bytes, device_memory_bytes=device_memory_bytes,
                offload_activations=case.offload_activations,
            ),
            param_init_fn=model.init_weights,
        )  # fmt: skip
    else:
        model = GPT(cfg)
        opt = NVMeAdamW(model.parameters(), lr=1e-4, swap_dir=swap, cpu_memory_bytes=case.cpu_memory_bytes)
    x = torch.randint(0, cfg.vocab_size, (case.batch, cfg.seq_len))
    times = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            model(x, x.roll(-1, dims=1)).backward()
            opt.step()
            opt.zero_grad()
            if step:
                times.append(time.perf_counter() - start)
    finally:
        opt.close()
    return statistics.median(times)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--swap-dir", default=None, help="default: a temporary directory under /tmp")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    cfg = GPTConfig(seq_len=64 if args.quick else 128, n_layer=4 if args.quick else 8, n_head=8, d_model=256 if args.quick else 512)
    shape = ModelShape("bench", cfg.n_layer, cfg.d_model, cfg.n_head, cfg.mlp_ratio * cfg.d_model, cfg.vocab_size, cfg.seq_len)
    device_memory_bytes = 256 * MiB
    rows = []
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap:
        profile = calibrate([swap], quick=args.quick)
        for case in cases(args.quick):
            request = PlanRequest(
                shape, batch_size=case.batch, seq_len=cfg.seq_len, dtype="float32",
                cpu_memory_bytes=case.cpu_memory_bytes, device_memory_bytes=device_memory_bytes,
                stream=case.stream, activations="offload" if case.offload_activations else "keep",
            )  # fmt: skip
            predicted = plan(request, profile)
            measured = measure(case, cfg, swap, 2 if args.quick else args.steps, device_memory_bytes)
            rows.append({
                "case": case.name, "predicted_s": predicted.step_s, "measured_s": measured,
                "ratio": predicted.step_s / measured, "bottleneck": predicted.bottleneck,
                "compute_s": predicted.engine_s["compute"], "adam_s": predicted.engine_s["cpu adam"],
                "nvme_s": predicted.engine_s["nvme"], "copies_s": predicted.engine_s["copies"],
                "cached_blocks": predicted.cached_blocks,
            })  # fmt: skip
            print(rows[-1], flush=True)
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    notes = (
        f"GPT d_model {cfg.d_model}, {cfg.n_layer} layers, seq {cfg.seq_len}, fp32 ({shape.params / 1e6:.1f}M parameters)."
        f" Profile calibrated in this run: {profile.source}. Worst ratio {worst['ratio']:.3f} ({worst['case']});"
        f" every ratio within 15%: {all(abs(r['ratio'] - 1) <= 0.15 for r in rows)}."
    )
    return save_report(
        "bench_plan", rows, settings={"steps": args.steps, "quick": args.quick, "model": shape.__dict__},
        plot_column="ratio", notes=notes, results_dir=args.results_dir,
        extra={"profile": profile.to_json(), "worst_ratio": worst["ratio"]},
    )  # fmt: skip


if __name__ == "__main__":
    main()
