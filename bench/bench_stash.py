"""More micro-batches a step than the device holds the block inputs of: the vertical schedule's stash (issue 51).

By the vertical schedule each block's input for each micro-batch is kept until that block's backward. On the device,
the number of micro-batches a step, G, is bound by device memory; in the stash (``--stash-host-memory``) those inputs
live in host memory (NVMe beyond) and the device holds only the stash's transfers in flight. Two cases of
``nvoffload finetune --stream``, each in a process of its own, with the same model, micro-batch and budgets:

- ``G = 2, inputs on the device``: a device budget of what streaming needs plus the block inputs of 2 micro-batches,
  the most it holds;
- ``G = 8, inputs in the stash``: the same device budget, and ``--stash-host-memory`` of the block inputs of 8
  micro-batches (taken from ``--cpu-memory``, which grows by as much, so the other engines get what they got).

A step streams every block once and reads and writes the optimizer state once whatever G is; the more micro-batches,
the more tokens that traffic serves. The table gives each case's median tokens/s over the steps after the first, the
NVMe bytes a step (the streamer's, the optimizer's and the stash's: ``read_bytes``/``written_bytes`` of the run's
metrics) and tokens/s over G = 2's. The plot shows each step's tokens/s and NVMe bytes.

On the CPU standing in for the GPU (the default; ``--device cuda`` on a GPU) "device memory" for activations is not
a hard limit, and the device budget counts no activations on a GPU either, so the budget is set as the issue states
it (what streaming needs, plus 2 micro-batches' block inputs) and G = 2 is the most a GPU of that budget would run
with the inputs on it.

    python bench/bench_stash.py              # GPT-2 124M, 1 x 32 tokens a micro-batch, 4 steps a case
    python bench/bench_stash.py --quick      # the tiny preset, in this process: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vertical import finetune_cases, plot_steps  # noqa: E402
from report import RESULTS_DIR, save_report  # noqa: E402

MiB = 1 << 20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny preset, 3 steps, in this process: a smoke run")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--cpu-memory-mib", type=int, default=256, help="host budget besides the stash's (MiB)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="steps of each case (the first is not counted)")
    p.add_argument("--device", default="cpu", help="finetune's --device: cpu (default) or cuda")
    p.add_argument("--swap-dir", default=None, help="default: a temporary directory under /tmp")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.cpu_memory_mib, args.seq_len, args.steps = "tiny", 8, 16, 3
    return args


def budgets(preset: str, batch: int, seq: int) -> tuple[int, int, int]:
    """(the least device memory that streams ``preset`` in fp32, one micro-batch's block inputs, its layers), bytes:
    each block's input is ``batch x seq x d_model`` fp32 values."""
    import torch

    from nvoffload.models import GPT, GPTConfig
    from nvoffload.streaming import device_bytes_needed, partition

    cfg = GPTConfig.preset(preset)
    with torch.device("meta"):
        model = GPT(cfg)
    streamed, resident = partition(model, list(model.blocks))
    return device_bytes_needed(streamed, resident, False), cfg.n_layer * batch * seq * cfg.d_model * 4, cfg.n_layer


def cases(args) -> tuple[list[str], dict[str, list[str]], dict]:
    """The flags every case shares, each case's own, and the budgets (bytes) they come from."""
    streaming, inputs, layers = budgets(args.preset, args.batch_size, args.seq_len)
    device = streaming + 2 * inputs + MiB  # what streaming needs, and two micro-batches' block inputs
    stash = 8 * inputs  # eight micro-batches' block inputs
    staging = 2 * 8 * inputs // layers  # one block's inputs over the 8 micro-batches each way, as the planner's
    host = args.cpu_memory_mib * MiB
    common = ["--preset", args.preset, "--stream", "--device-memory", str(device), "--batch-size", str(args.batch_size),
              "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--device", args.device, "--no-progress"]  # fmt: skip
    own = {
        "G = 2, inputs on the device": ["--grad-accum", "2", "--cpu-memory", str(host)],
        "G = 8, inputs in the stash": ["--grad-accum", "8", "--cpu-memory", str(host + stash + staging),
                                       "--stash-host-memory", str(stash), "--stash-staging", str(staging)],  # fmt: skip
    }
    sizes = {"device_memory_bytes": device, "block_inputs_per_micro_batch_bytes": inputs, "stash_host_bytes": stash,
             "stash_staging_bytes": staging, "streaming_needs_bytes": streaming}  # fmt: skip
    return common, own, sizes


def main(argv=None) -> Path:
    args = parse_args(argv)
    common, own, sizes = cases(args)
    steps = finetune_cases(common, own, args.swap_dir, fresh_process=not args.quick)
    first = None
    rows = []
    for name, recorded in steps.items():
        timed = recorded[1:]
        tokens_per_s = statistics.median(s["tokens_per_s"] for s in timed)
        first = first or tokens_per_s
        rows.append({
            "case": name,
            "tokens_per_s": tokens_per_s,
            "vs_g2": tokens_per_s / first,
            "step_s": statistics.median(s["step_s"] for s in timed),
            "nvme_read_mb_per_step": statistics.median(s["read_bytes"] for s in timed) / 1e6,
            "nvme_written_mb_per_step": statistics.median(s["written_bytes"] for s in timed) / 1e6,
            "loss_last": recorded[-1]["loss"],
        })  # fmt: skip
    notes = (
        f"`nvoffload finetune {' '.join(common)}` with each case's flags, {args.steps} steps (the first not counted),"
        f" {'in this process' if args.quick else 'each case in a process of its own'}; budgets {sizes}."
        f" G = 8 with the block inputs in the stash: {rows[1]['vs_g2']:.2f}x the tokens/s of G = 2 with them on the"
        " device."
    )
    return save_report(
        "bench_stash", rows, settings={**vars(args), "results_dir": str(args.results_dir), **sizes},
        plot_column="tokens_per_s", notes=notes, results_dir=args.results_dir, extra={"steps": steps},
        plot=lambda plt: plot_steps(plt, steps),
    )  # fmt: skip


if __name__ == "__main__":
    main()
