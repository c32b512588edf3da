"""More tokens a step for the same traffic: ``nvoffload finetune --stream`` with one micro-batch a step and with G,
by the vertical schedule and micro-batch after micro-batch, in the same run.

Each case is the command a user runs, in a process of its own, with the same budgets and micro-batch. The
defaults are those of issue 33: GPT-2 124M with 256M of host memory and 512M of device memory, one sequence of
32 tokens a micro-batch. There the optimizer state's and the weights' NVMe traffic bounds the step, not compute:

- ``G = 1``: one micro-batch a step;
- ``G = 4, vertical``: four micro-batches, each block over all four while it is on the device (the default);
- ``G = 4, micro-batch after micro-batch``: the same with ``--no-vertical``, each micro-batch streaming every
  block and keeping the fp32 gradient sums in the store.

The table gives, for each case, the median tokens/s of the steps after the first, the NVMe bytes a step (from the
run's metrics) and tokens/s over ``G = 1``'s. The plot shows each step's tokens/s, and its NVMe bytes, by case.

    python bench/bench_vertical.py              # GPT-2 124M, G = 4, 5 steps a case
    python bench/bench_vertical.py --quick      # the tiny preset, in this process: a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, nvoffload_command, save_report  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny preset, 3 steps, in this process: a smoke run")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--cpu-memory", default="256M")
    p.add_argument("--device-memory", default="512M")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=4, help="G, the micro-batches a step of the two G cases")
    p.add_argument("--steps", type=int, default=5, help="steps of each case (the first is not counted)")
    p.add_argument("--device", default="cpu", help="finetune's --device: cpu (default) or cuda")
    p.add_argument("--swap-dir", default=None, help="default: a temporary directory under /tmp")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.cpu_memory, args.device_memory, args.seq_len, args.steps = "tiny", "4M", "64M", 16, 3
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    common = ["--preset", args.preset, "--stream", "--cpu-memory", args.cpu_memory, "--device-memory", args.device_memory,
              "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
              "--device", args.device, "--no-progress"]  # fmt: skip
    g = str(args.grad_accum)
    cases = {
        "G = 1": ["--grad-accum", "1"],
        f"G = {g}, vertical": ["--grad-accum", g],
        f"G = {g}, micro-batch after micro-batch": ["--grad-accum", g, "--no-vertical"],
    }
    steps = finetune_cases(common, cases, args.swap_dir, fresh_process=not args.quick)
    one = statistics.median(s["tokens_per_s"] for s in steps["G = 1"][1:])
    rows = []
    for name, recorded in steps.items():
        timed = recorded[1:]
        tokens_per_s = statistics.median(s["tokens_per_s"] for s in timed)
        rows.append({
            "case": name,
            "tokens_per_s": tokens_per_s,
            "vs_g1": tokens_per_s / one,
            "read_gb_per_step": statistics.median(s["read_bytes"] for s in timed) / 1e9,
            "written_gb_per_step": statistics.median(s["written_bytes"] for s in timed) / 1e9,
            "loss_last": recorded[-1]["loss"],
        })  # fmt: skip
    vertical, each = rows[1]["tokens_per_s"], rows[2]["tokens_per_s"]
    notes = (
        f"`nvoffload finetune {' '.join(common)}` with each case's flags, {args.steps} steps (the first not counted),"
        f" {'in this process' if args.quick else 'each case in a process of its own'}. G = {g} by the vertical"
        f" schedule: {rows[1]['vs_g1']:.2f}x the tokens/s of G = 1 and {vertical / each:.2f}x those of micro-batch"
        " after micro-batch."
    )
    return save_report(
        "bench_vertical", rows, settings={**vars(args), "results_dir": str(args.results_dir)}, plot_column="tokens_per_s",
        notes=notes, results_dir=args.results_dir, extra={"steps": steps}, plot=lambda plt: plot_steps(plt, steps),
    )  # fmt: skip


def finetune_cases(common: list[str], cases: dict[str, list[str]], swap_dir: str | None, *,
                   fresh_process: bool) -> dict[str, list[dict]]:  # fmt: skip
    """``nvoffload finetune`` with the ``common`` flags and each case's, one after the other (``fresh_process``: each
    in a process of its own) in a temporary swap directory under ``swap_dir``: each case's metrics, a record a
    step. Prints each step's tokens/s and NVMe MB (read + written)."""
    steps = {}
    with tempfile.TemporaryDirectory(dir=swap_dir) as swap:
        for i, (name, extra) in enumerate(cases.items()):
            log = Path(swap) / f"log{i}"
            flags = [*common, *extra, "--swap-dir", swap, "--log-dir", str(log)]
            status, out, err = nvoffload_command(["finetune", *flags], fresh_process=fresh_process)
            if status != 0:
                raise RuntimeError(f"nvoffload finetune {' '.join(flags)} failed:\n{out[-1500:]}{err[-1500:]}")
            steps[name] = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
            rates = ", ".join(f"{s['tokens_per_s']:.1f}" for s in steps[name])
            nvme = ", ".join(f"{(s['read_bytes'] + s['written_bytes']) / 1e6:.0f}" for s in steps[name])
            print(f"{name}: {rates} tokens/s; NVMe MB read + written: {nvme}", flush=True)
    return steps


def plot_steps(plt, steps: dict[str, list[dict]]):
    """Each step's tokens/s and NVMe bytes (read + written), one line a case."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, recorded in steps.items():
        x = [s["step"] for s in recorded]
        top.plot(x, [s["tokens_per_s"] for s in recorded], marker="o", label=name)
        bottom.plot(x, [(s["read_bytes"] + s["written_bytes"]) / 1e9 for s in recorded], marker="o", label=name)
    top.set_ylabel("tokens/s")
    top.set_title("finetune --stream: tokens/s and NVMe bytes of each step")
    bottom.set_ylabel("NVMe GB read + written")
    bottom.set_xlabel("step")
    top.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
