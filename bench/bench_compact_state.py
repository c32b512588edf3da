"""Compact optimizer state and the delayed update beside exact AdamW, in one run: bytes, step time and convergence.

Two parts, every case in the same run:

- **The optimizer alone** on GPT-2 124M's parameters in bfloat16 (random gradients, the same each case):
  ``NVMeAdamW`` with ``state_precision`` ``fp32`` (exact AdamW), ``bf16-moments``, ``bf16`` and ``8bit``. For each: the
  bytes the state takes in the store per parameter, the store bytes read and written a step per parameter (the
  optimizer's counters) and the median step time, with their ratio to exact AdamW's.
- **Convergence**: ``nvoffload finetune --dtype bfloat16`` with ``--optimizer-state`` each of the four, and
  with ``--delayed-update`` (exact state, each step's updates landing one step late; and the same after 30 exact
  steps, ``--delayed-update-after 30``), on ``--preset gpt2-124m``
  (the shipped corpus) and on a small Hugging Face Llama built here from its config (random weights, bytes as
  tokens; nothing downloaded), each case in a process of its own: the last steps' mean loss and the largest gap
  of the loss curve (averaged over 20 steps) from exact AdamW's. The plot shows the curves. (The delayed
  update moves exact AdamW's bytes; its step time is ``bench_offload_optim.py``'s ``full_delayed``.)

    python bench/bench_compact_state.py           # 4 optimizer steps; 300 + 200 finetune steps a case
    python bench/bench_compact_state.py --quick   # tiny sizes, in this process: a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, markdown_table, nvoffload_command, save_report  # noqa: E402

PRECISIONS = ("fp32", "bf16-moments", "bf16", "8bit")
# the convergence part's cases: finetune's optimizer flags
DELAYED_AFTER = 30  # the exact steps before the delayed updates of the last case
OPTIONS = {p: ["--optimizer-state", p] for p in PRECISIONS} | {
    "delayed": ["--optimizer-state", "fp32", "--delayed-update"],
    f"delayed after {DELAYED_AFTER}": ["--optimizer-state", "fp32", "--delayed-update", "--delayed-update-after", str(DELAYED_AFTER)],
}
WINDOW = 20  # steps a loss is averaged over


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps, in this process: a smoke run")
    p.add_argument("--preset", default="gpt2-124m", help="the model of both parts' GPT case")
    p.add_argument("--optimizer-steps", type=int, default=4, help="optimizer-alone steps a case (the first not timed)")
    p.add_argument("--gpt-steps", type=int, default=300)
    p.add_argument("--hf-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--cpu-memory", default="4G", help="finetune's host budget (its state resident where it fits: this part measures the loss, the first the bytes)")
    p.add_argument("--device", default="cpu", help="finetune's --device: cpu (default) or cuda")
    p.add_argument("--swap-dir", default=None, help="default: a temporary directory under /tmp")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.optimizer_steps, args.gpt_steps, args.hf_steps, args.seq_len = "tiny", 3, 4, 4, 16
        args.cpu_memory = "16M"
    return args


def optimizer_case(preset: str, precision: str, steps: int, swap: str) -> dict:
    from nvoffload.models import GPT, GPTConfig
    from nvoffload.optim import NVMeAdamW

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).to(torch.bfloat16)
    params = [p for p in model.parameters()]
    numel = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) * 1e-3 for p in params]
    times, read, written = [], [], []
    with NVMeAdamW(params, lr=1e-4, swap_dir=swap, state_precision=precision) as opt:
        for step in range(steps):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.reset_io_stats()
            start = time.perf_counter()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
            stats = opt.memory_stats()
            read.append(stats.read_bytes)
            written.append(stats.written_bytes)
        stored = opt.memory_stats().nvme_bytes
    return {
        "case": precision,
        "stored_bytes_per_param": stored / numel,
        "read_bytes_per_param": statistics.median(read[1:]) / numel,
        "written_bytes_per_param": statistics.median(written[1:]) / numel,
        "step_s": statistics.median(times[1:]),
        "params": numel,
    }


def tiny_llama(directory: Path, quick: bool) -> str:
    """A small Llama with random weights, saved as a Hugging Face directory (no tokenizer: bytes are tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4) if quick else dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8)  # fmt: skip
    config = LlamaConfig(vocab_size=256, max_position_embeddings=256, num_key_value_heads=size["num_attention_heads"], **size)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def finetune_losses(model_flags: list[str], option: list[str], args, swap: str, log: Path) -> list[dict]:
    flags = [*model_flags, "--dtype", "bfloat16", *option, "--batch-size", str(args.batch_size),
             "--seq-len", str(args.seq_len), "--cpu-memory", args.cpu_memory, "--swap-dir", swap, "--log-dir", str(log),
             "--device", args.device, "--no-progress"]  # fmt: skip
    status, out, err = nvoffload_command(["finetune", *flags], fresh_process=not args.quick)
    if status != 0:
        raise RuntimeError(f"nvoffload finetune {' '.join(flags)} failed:\n{out[-1500:]}{err[-1500:]}")
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(losses))]


def main(argv=None) -> Path:
    args = parse_args(argv)
    rows, curves = [], {}
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as tmp:
        tmp = Path(tmp)
        for precision in PRECISIONS:
            (tmp / precision).mkdir()
            rows.append(optimizer_case(args.preset, precision, args.optimizer_steps, str(tmp / precision)))
            print(rows[-1], flush=True)
        exact = rows[0]
        for row in rows:
            row["step_vs_exact"] = row["step_s"] / exact["step_s"]
            row["bytes_vs_exact"] = (row["read_bytes_per_param"] + row["written_bytes_per_param"]) / (
                exact["read_bytes_per_param"] + exact["written_bytes_per_param"])  # fmt: skip
        llama = tiny_llama(tmp / "llama", args.quick)
        models = {
            f"{args.preset}, {args.gpt_steps} steps": ["--preset", args.preset, "--steps", str(args.gpt_steps)],
            f"small Llama, {args.hf_steps} steps": ["--model", llama, "--steps", str(args.hf_steps)],
        }
        for name, model_flags in models.items():
            curves[name] = {}
            for i, (case, option) in enumerate(OPTIONS.items()):
                steps = finetune_losses(model_flags, option, args, str(tmp), tmp / f"log-{len(curves)}-{i}")
                curves[name][case] = [s["loss"] for s in steps]
                print(f"{name}, {case}: last loss {steps[-1]['loss']:.4f}", flush=True)
    convergence = []
    for name, by_precision in curves.items():
        reference = smoothed(by_precision["fp32"])
        for precision, losses in by_precision.items():
            curve = smoothed(losses)
            convergence.append({
                "model": name,
                "case": precision,
                "final_loss": statistics.fmean(losses[-WINDOW:]),
                "final_vs_exact": statistics.fmean(losses[-WINDOW:]) - statistics.fmean(by_precision["fp32"][-WINDOW:]),
                "largest_gap": max(abs(a - b) for a, b in zip(curve, reference)),
            })  # fmt: skip
    for row in convergence:
        print(row)
    case = {r["case"]: r for r in rows}
    moments, bf16, eight = case["bf16-moments"], case["bf16"], case["8bit"]
    notes = (
        f"The optimizer alone on {args.preset}'s {exact['params']:,} parameters (bf16 weights and gradients),"
        f" {args.optimizer_steps} steps a case, the first not timed: bf16 moments move"
        f" {moments['bytes_vs_exact']:.2f}x exact AdamW's store bytes in {moments['step_vs_exact']:.2f}x its step time,"
        f" bf16 weights without an fp32 master {bf16['bytes_vs_exact']:.2f}x in {bf16['step_vs_exact']:.2f}x, and"
        f" with 8-bit moments {eight['bytes_vs_exact']:.2f}x in {eight['step_vs_exact']:.2f}x"
        " (the delayed update moves exact AdamW's bytes: its step time is bench_offload_optim's full_delayed)."
        f" Convergence (finetune --dtype bfloat16, --batch-size {args.batch_size} --seq-len {args.seq_len}, loss averaged"
        f" over {WINDOW} steps):\n\n" + markdown_table(convergence)
    )
    return save_report(
        "bench_compact_state", rows, settings={**vars(args), "results_dir": str(args.results_dir)},
        plot_column="step_s", notes=notes, results_dir=args.results_dir,
        extra={"convergence": convergence, "curves": curves}, plot=lambda plt: plot_curves(plt, curves),
    )  # fmt: skip


def plot_curves(plt, curves: dict[str, dict[str, list[float]]]):
    """Each model's loss curves (averaged over WINDOW steps), one line a case."""
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4))
    for ax, (name, by_precision) in zip(axes, curves.items()):
        for precision, losses in by_precision.items():
            ax.plot(range(1, len(losses) + 1), smoothed(losses), label=precision)
        ax.set_title(f"{name}: loss ({WINDOW}-step mean)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
