"""Activation offload against the alternatives, on a GPT-style model on this machine's CPU.

Cases, each measured in a fresh subprocess so that the peak RSS is its own (with ``--quick`` all in one):

- ``none``: plain training step (the reference);
- ``nvme``: ``offload_activations`` to a swap directory (a TensorStore);
- ``cpu``: ``offload_activations(target="cpu")``;
- ``spill``: ``offload_activations`` to a swap directory keeping ``--spill-mib`` of the tensors in host memory
  (``host_resident_bytes``): the rest go to NVMe;
- ``checkpoint``: ``torch.utils.checkpoint`` around every block (full recomputation);
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (a copy per saved tensor).

Reported per case: median step time (forward + backward), the peak bytes that
saved tensors held in memory, counted exactly with saved-tensor hooks (the
offload's own counters; a counting wrapper for the others), and the process's
peak RSS.

Before the cases, a contention probe (:mod:`nvoffload.planner.contention`) measures how much
compute and I/O slow each other down on this machine; the report gives its
figures (JSON key ``contention``) and the floor they put under the ``nvme``
step: the ``none`` step time as compute and the bytes the ``nvme`` case writes
and reads per step as I/O. Run ``python bench/bench_activations.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import save_report  # noqa: E402

from nvoffload.activations import SavedTensorCounter, offload_activations  # noqa: E402
from nvoffload.memory import retain_freed_host_memory  # noqa: E402
from nvoffload.models.gpt import GPT, GPTConfig  # noqa: E402
from nvoffload.planner.contention import QUICK as CONTENTION_QUICK  # noqa: E402
from nvoffload.planner.contention import measure_contention  # noqa: E402

CASES = ["none", "nvme", "cpu", "spill", "checkpoint", "save_on_cpu"]
OFFLOADED = ("nvme", "cpu", "spill")  # the cases of offload_activations
MiB = 1 << 20


def settings_from(args) -> dict:
    if args.quick:
        return dict(
            preset="tiny", batch=8, steps=2, keep_recent_mib=0.25, prefetch_mib=0.5, pending_write_mib=0.5, min_bytes=16384,
            spill_mib=1,
        )
    return dict(
        preset=args.preset,
        batch=args.batch,
        steps=args.steps,
        keep_recent_mib=args.keep_recent_mib,
        spill_mib=args.spill_mib,
        prefetch_mib=args.prefetch_mib,
        pending_write_mib=args.pending_write_mib,
        min_bytes=256 * 1024,
    )


def checkpointed_loss(model: GPT, idx, targets):
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1]))
    for block in model.blocks:
        # re-entrant: the block input is saved through the hooks, so the counter sees it
        x = checkpoint(block, x, use_reentrant=True)
    logits = F.linear(model.ln_f(x), model.tok_emb.weight)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def run_case(case: str, settings: dict, swap_dir: str) -> dict:
    """One case in this process: warm-up step, then ``steps`` timed steps."""
    retain_freed_host_memory()  # as offload_activations does: every case keeps its freed memory alike
    torch.manual_seed(0)
    config = GPTConfig.preset(settings["preset"])
    model = GPT(config)
    batch = settings["batch"]
    idx = torch.randint(0, config.vocab_size, (batch, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len))

    if case in OFFLOADED:
        hooks = offload_activations(
            None if case == "cpu" else swap_dir,
            target="cpu" if case == "cpu" else "nvme",
            host_resident_bytes=int(settings["spill_mib"] * MiB) if case == "spill" else 0,
            min_bytes=settings["min_bytes"],
            keep_recent_bytes=int(settings["keep_recent_mib"] * MiB),
            prefetch_bytes=int(settings["prefetch_mib"] * MiB),
            max_pending_write_bytes=int(settings["pending_write_mib"] * MiB),
        )
    elif case == "save_on_cpu":
        hooks = SavedTensorCounter(torch.autograd.graph.save_on_cpu(pin_memory=True))
    else:
        hooks = SavedTensorCounter()
    forward = checkpointed_loss if case == "checkpoint" else (lambda m, i, t: m(i, t))

    times, loss = [], None
    for step in range(settings["steps"] + 1):
        if step == 1:  # the first step is a warm-up
            hooks.reset_peaks() if case in OFFLOADED else hooks.reset_peak()
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with hooks:
            loss = forward(model, idx, targets)
            loss.backward()
        if step:
            times.append(time.perf_counter() - start)
    if case in OFFLOADED:
        stats = hooks.stats()
        peak = stats.peak_resident_bytes
        written, read, in_host = (n // (settings["steps"] + 1) for n in (stats.bytes_written, stats.bytes_read, stats.host_bytes_written))
        hooks.close()
    else:
        peak, written, read, in_host = hooks.peak_resident_bytes, hooks.peak_offloaded_bytes, 0, 0
    return {
        "case": case,
        "step_s": statistics.median(times),
        "saved_peak_mib": peak / MiB,
        "moved_mib_per_step": written / MiB,
        "read_mib_per_step": read / MiB,
        "nvme_mib_per_step": 0.0 if case == "cpu" else (written - in_host) / MiB if case in OFFLOADED else 0.0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": float(loss),
    }


def main(argv=None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, the cases in one process: a smoke run")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep-recent-mib", type=float, default=32)
    parser.add_argument("--prefetch-mib", type=float, default=64)
    parser.add_argument("--pending-write-mib", type=float, default=64)
    parser.add_argument("--spill-mib", type=float, default=120, help="the spill case's host_resident_bytes, MiB (half of what the small preset offloads a step)")
    parser.add_argument("--swap-dir", default=None, help="directory for the NVMe case (default: a temp dir in /tmp)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--name", default="bench_activations")
    parser.add_argument("--results-dir", type=Path, default=None, help="default: bench/results")
    parser.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_case:  # child process: each case (separated by commas) in turn, one JSON line each
        for case in args.run_case.split(","):
            print(json.dumps(run_case(case, json.loads(args.settings_json), args.swap_dir)), flush=True)
        return None

    settings = settings_from(args)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {CASES}")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as swap:
        probe = measure_contention(swap, **(CONTENTION_QUICK if args.quick else {}))
        print(probe.describe())
        # each case in a process of its own; --quick: all in one (the tiny model's peak RSS is the imports')
        for group in [cases] if args.quick else [[case] for case in cases]:
            cmd = [sys.executable, __file__, "--run-case", ",".join(group), "--settings-json", json.dumps(settings), "--swap-dir", swap]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"case {','.join(group)} failed:\n{done.stderr[-3000:]}")
            rows.extend(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"case": '))
    base = next((r for r in rows if r["case"] == "none"), None)
    for row in rows:
        row["step_vs_none"] = row["step_s"] / base["step_s"] if base else float("nan")
        row["saved_peak_vs_none"] = row["saved_peak_mib"] / base["saved_peak_mib"] if base else float("nan")
    notes = [
        "saved_peak_mib: peak bytes of distinct storages that saved tensors held in memory, counted with "
        "saved-tensor hooks (parameters and module buffers excluded). moved_mib_per_step: bytes written to the offload target "
        "(nvme/cpu) or copied by save_on_cpu; read_mib_per_step: bytes the offload context read back from its "
        "target (nvme/cpu; 0 for the others); nvme_mib_per_step: of the bytes written, those that went to NVMe (spill: "
        "those beyond what it keeps in host memory). On a CPU-only machine the 'cpu' target and save_on_cpu copy within "
        "the same memory, so peak RSS does not drop for them. Targets: saved peak <= 0.5x none, step <= 1.10x none "
        "and below checkpoint.",
        probe.describe(),
    ]
    contention = probe.to_dict()
    nvme = next((r for r in rows if r["case"] == "nvme"), None)
    if base and nvme:
        compute_s = base["step_s"]
        io_bytes = (nvme["moved_mib_per_step"] + nvme["read_mib_per_step"]) * MiB
        io_s = io_bytes / (probe.io_gb_per_s_alone * 1e9)  # no case moves these bytes alone: the probe's rate
        floor = probe.overlap_floor(compute_s, io_s)
        best_s = floor * max(compute_s, io_s)
        contention.update(overlap_floor=floor, floor_compute_s=compute_s, floor_io_s=io_s)
        notes.append(
            f"floor for nvme on this machine: {best_s:.3g} s a step = {best_s / compute_s:.2f}x none"
            f" (overlap floor {floor:.2f}: none's {compute_s:.3g} s of compute with {io_bytes / MiB:.1f} MiB"
            f" of I/O a step, at the probe's rates); measured {nvme['step_s']:.3g} s = {nvme['step_vs_none']:.2f}x none"
        )
    where = {} if args.results_dir is None else {"results_dir": args.results_dir}
    return save_report(
        args.name, rows, settings=settings, plot_column="saved_peak_mib", notes="\n\n".join(notes),
        extra={"contention": contention}, **where,
    )  # fmt: skip


if __name__ == "__main__":
    main()
