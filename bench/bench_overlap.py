"""Does parameter streaming hide its host-to-device copies behind compute? The streamed step beside its two parts.

One process, one model (a GPT whose blocks are streamed), the same batch:

- ``compute``: forward + backward with every parameter on the device (no
  streaming), gradients dropped as they arrive (as in ``streamed``);
- ``copies``: the streamed step's block copies alone (every block to the
  device in forward, and again in backward but the last, which stays there
  from its forward), issued through the same
  :class:`~nvoffload.transfer.TransferEngine` one after the other;
- ``streamed``: forward + backward through :class:`~nvoffload.streaming.ParameterStreamer`,
  every block cached in host memory (so no NVMe read is timed: the copies are
  the only transfer), gradients dropped as they arrive (as the optimizer's
  ``release_grads`` does).

With the copies overlapped, ``streamed`` is about ``max(compute, copies)``;
run one after the other it would be ``compute + copies``. Both are reported,
with the ratios, and so is the tighter bound that one block of device memory
ahead allows: the copies of a pass cannot run ahead of it, so each of forward
and backward takes at least the longer of its compute and its copies
(forward has as many copies as backward but half its compute), plus how long
compute waited for copies in the streamed step.

Without CUDA the CPU stands in for the GPU, and its copies run at
``--copy-gbps`` (``NVOFFLOAD_SIM_COPY_GBPS``'s mechanism): by default the rate at
which the copies take as long as the compute, where overlap matters most and
the gap between max and sum is widest (on a GPU, PCIe 4.0 x16 is about 25 GB/s
against far faster compute, the same balance for a small batch). After the
timed steps one more streamed step runs under :mod:`nvoffload.trace`, and the
plot is its timeline: each block's forward and backward and the waits for its
weights (host time, which on a GPU is when the work was issued) on one lane, the
copies on their own (timed by CUDA events on the copy streams on a GPU, by the
stand-in's workers on the CPU).

    python bench/bench_overlap.py [--quick] [--device cpu|cuda] [--copy-gbps 0.2]

``--host-profile`` measures instead the streamer's host time per block pass,
as CPU time of the training thread (so waits and a loaded machine do not count):
the streamed step under :mod:`cProfile`, every call into the streaming code
(nvoffload's transfer, streaming, device, memory and I/O modules, torch's module
backward hooks, ``weakref`` and ``threading``) from outside it summed and divided
by the block passes (each block's forward and backward), its top costs by own
time; and, unprofiled, the streamed step over the compute step, in the training
thread's CPU time and in wall time (one intra-op thread, so that compute runs on
the training thread; stand-in copies at 1000 GB/s unless ``--copy-gbps``).
``--against DIR`` runs the same mode with the package of another checkout
(``git worktree add DIR COMMIT``) in a subprocess first, for a before/after in one run.
Results: ``bench_overlap_host_time.*``.

    python bench/bench_overlap.py --device cpu --host-profile --against /tmp/wt-old --repeats 5
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import plot_trace, save_report  # noqa: E402

from nvoffload import trace  # noqa: E402
from nvoffload.device import SimDevice, compute_device  # noqa: E402
from nvoffload.io import TensorStore  # noqa: E402
from nvoffload.memory import MemoryManager  # noqa: E402
from nvoffload.models import GPT, GPTConfig  # noqa: E402
from nvoffload.streaming import ParameterStreamer  # noqa: E402
from nvoffload.transfer import TransferEngine  # noqa: E402

MiB = 1 << 20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model, two repeats: a smoke run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each case (median reported)")
    p.add_argument("--copy-gbps", type=float, default=None, help="stand-in copy rate (default: copies take as long as compute)")
    p.add_argument("--name", default="bench_overlap")
    p.add_argument("--results-dir", type=Path, default=None, help="default: bench/results")
    p.add_argument("--host-profile", action="store_true", help="the streamer's host time per block pass (see above)")
    p.add_argument("--against", type=Path, default=None, help="with --host-profile: a checkout to compare with")
    p.add_argument("--top", type=int, default=12, help="with --host-profile: costs listed")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --host-profile --against: before and after measured in turn this many times; medians")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.seq_len, args.batch, args.repeats = 3, 64, 32, 2, 2
    if args.host_profile and args.name == "bench_overlap":
        args.name = "bench_overlap_host_time"
    return args


def build(args, device: torch.device) -> GPT:
    """The model; its gradients are dropped as they arrive, as the NVMe optimizer's ``release_grads`` does."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=args.seq_len, n_layer=args.layers, n_head=4, d_model=args.d_model)
    model = GPT(cfg).to(device)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_s(model, x, y, device, clock=time.perf_counter) -> tuple[float, float]:
    """(forward, backward) seconds of one step, by ``clock``."""
    sync(device)
    start = clock()
    loss = model(x, y)
    sync(device)
    middle = clock()
    loss.backward()
    sync(device)
    return middle - start, clock() - middle


def copies_s(engine: TransferEngine, blocks: list[torch.nn.Module], device: torch.device) -> tuple[float, float, int]:
    """The streamed step's copies through ``engine``, one after another: every block for forward, then all but
    the last (which stays on the device) for backward; (forward seconds, backward seconds, bytes)."""
    host = [engine.slab.allocate(sum(p.numel() * p.element_size() for p in b.parameters()), "a block") for b in blocks]
    dev = [torch.empty(h.numel(), dtype=torch.uint8, device=device) for h in host]
    pairs = list(zip(dev, host))
    phases = []
    for batch in (pairs, pairs[:-1][::-1]):
        sync(device)
        start = time.perf_counter()
        for f in [engine.to_device(d, h) for d, h in batch]:
            engine.wait(f)
        sync(device)
        phases.append(time.perf_counter() - start)
    for h in host:
        engine.slab.free(h)
    return phases[0], phases[1], sum(h.numel() for _, h in pairs + pairs[:-1])


def _medians(samples: list[tuple[float, ...]]) -> list[float]:
    return [statistics.median(column) for column in zip(*samples)]


# Where the streamer's host work runs: a call into these files from any other is host time of streaming.
_STREAMING_CODE = (
    "nvoffload/streaming/", "nvoffload/transfer/", "nvoffload/device.py", "nvoffload/memory.py", "nvoffload/io/",
    "nvoffload/core/", "nvoffload/_workers.py", "torch/utils/hooks.py", "/weakref.py", "/threading.py",
)  # fmt: skip (nvoffload/_workers.py: where the worker threads were before e0bc70c, for --against an older tree)


def _streaming(func: tuple) -> bool:
    return any(part in func[0] for part in _STREAMING_CODE)


def streaming_host_s(stats: pstats.Stats) -> tuple[float, dict[str, float]]:
    """(seconds of the calls into the streaming code from outside it, {function: its own seconds}), from a
    profile of the training thread; built-ins called by the streaming code count as its own."""
    total, own = 0.0, {}
    for func, (_, _, own_s, _, callers) in stats.stats.items():
        if _streaming(func):
            total += sum(cum_s for caller, (_, _, _, cum_s) in callers.items() if not _streaming(caller))
            own[pstats.func_std_string(func)] = own_s
        elif func[0] == "~":  # a built-in: the share of its time the streaming code called
            share = sum(t for caller, (_, _, t, _) in callers.items() if _streaming(caller))
            if share:
                own[pstats.func_std_string(func)] = share
    return total, own


def _profile_against(args) -> dict:
    """:func:`_profile` of the checkout ``args.against``, in a subprocess that imports its package."""
    with tempfile.TemporaryDirectory(prefix="nvoffload-bench-against-") as out:
        skip = ("--against", "--rounds")
        argv, rest = [], iter(sys.argv[1:])
        for a in rest:
            if a in skip:
                next(rest)
            else:
                argv.append(a)
        env = dict(os.environ, PYTHONPATH=str(args.against))
        subprocess.run(
            [sys.executable, __file__, *argv, "--name", "against", "--results-dir", out], env=env, check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return json.loads((Path(out) / "against.json").read_text())["profile"]


def _median_run(runs: list[dict]) -> dict:
    """The run whose host time per block pass is the median of ``runs`` (an odd count: the middle one)."""
    return sorted(runs, key=lambda r: r["host_ms_per_block_pass"])[(len(runs) - 1) // 2]


def host_profile(args) -> dict:
    """The streamer's host time per block pass (profiled) and the streamed step over the compute step (not); with
    ``--against``, before and after in turn ``--rounds`` times, each case's median round reported."""
    if args.against is None:
        return _report(args, [("this", _profile(args))], [])
    befores, afters = [], []
    for _ in range(args.rounds):  # alternated, so that the machine's load weighs on both alike
        befores.append(_profile_against(args))
        afters.append(_profile(args))
    ratios = [a["host_ms_per_block_pass"] / b["host_ms_per_block_pass"] for b, a in zip(befores, afters)]
    return _report(args, [("before", _median_run(befores)), ("after", _median_run(afters))], ratios,
                   rounds={"before": befores, "after": afters})  # fmt: skip


def _profile(args) -> dict:
    """One measurement of this process's package: host time per block pass under cProfile, and unprofiled
    streamed and compute steps."""
    device = torch.device(args.device or "cpu")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (args.batch, args.seq_len), generator=g).to(device)
    y = x.roll(-1, dims=1)
    compute_model, model = build(args, device), build(args, device)
    block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks]
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    host_bytes = sum(-(-b // 4096) * 4096 for b in block_bytes) + 8 * MiB
    gbps = args.copy_gbps or 1000.0
    compute_dev = SimDevice(copy_gbps=gbps, copy_delay_us=0) if device.type == "cpu" else compute_device(device)
    engine = TransferEngine(host_bytes, compute_dev, what="the benchmark's host cache")
    memory = MemoryManager(device_memory_bytes=2 * resident + 6 * max(block_bytes) + 8 * MiB, cpu_memory_bytes=host_bytes)
    passes = 2 * len(block_bytes)  # each block's forward and backward
    with tempfile.TemporaryDirectory(prefix="nvoffload-bench-overlap-") as swap, TensorStore(swap) as store:
        streamer = ParameterStreamer(model, store, memory, device=device, transfer=engine)
        step_s(model, x, y, device), step_s(compute_model, x, y, device)  # warm-up: every block in the host cache
        times = {(m, c): [] for m in ("compute", "streamed") for c in ("cpu", "wall")}
        for _ in range(args.repeats):  # alternated, so that the machine's load weighs on both alike
            for case, m in (("compute", compute_model), ("streamed", model)):
                for clock, c in ((time.thread_time, "cpu"), (time.perf_counter, "wall")):
                    times[case, c].append(sum(step_s(m, x, y, device, clock)))
        profiler = cProfile.Profile(time.thread_time)
        profiled_s = 0.0
        for _ in range(args.repeats):
            profiler.enable()
            profiled_s += sum(step_s(model, x, y, device, time.thread_time))
            profiler.disable()
        streamer.close()
    engine.close()
    compute_dev.close()
    host_s, own = streaming_host_s(pstats.Stats(profiler))
    steps = args.repeats * passes
    top = sorted(own.items(), key=lambda kv: -kv[1])[: args.top]
    profile = {
        "package": str(Path(sys.modules["nvoffload"].__file__).parents[1]),
        "commit": _commit(Path(sys.modules["nvoffload"].__file__).parents[1]),
        "host_ms_per_block_pass": host_s / steps * 1e3,
        "profiled_step_ms_per_block_pass": profiled_s / steps * 1e3,
        **{f"{case}_{c}_s": statistics.median(t) for (case, c), t in times.items()},
        **{f"streamed/compute_{c}": statistics.median(times["streamed", c]) / statistics.median(times["compute", c])
           for c in ("cpu", "wall")},
        "top_ms_per_block_pass": [(name, s / steps * 1e3) for name, s in top],
    }  # fmt: skip
    return profile


def _report(args, runs: list[tuple[str, dict]], ratios: list[float], rounds: dict | None = None) -> dict:
    """Save the runs' table, their top costs and (with ``--against``) each round's after/before ratio."""
    gbps = args.copy_gbps or 1000.0
    rows = [
        {"case": f"{label} ({run['commit']})", "host ms per block pass": run["host_ms_per_block_pass"],
         "streamed/compute (CPU time)": run["streamed/compute_cpu"], "streamed/compute (wall)": run["streamed/compute_wall"],
         "streamed s (CPU time)": run["streamed_cpu_s"], "compute s (CPU time)": run["compute_cpu_s"]}
        for label, run in runs
    ]  # fmt: skip
    notes = "\n".join(
        f"{label} ({run['commit']}), top own host time per block pass: "
        + "; ".join(f"{name} {ms:.3f} ms" for name, ms in run["top_ms_per_block_pass"])
        for label, run in runs
    ) + f"\n\nload average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; stand-in copies at {gbps:g} GB/s."
    if ratios:
        notes += (f"\n\nafter/before host time, each of {len(ratios)} rounds (before and after in turn): "
                  + ", ".join(f"{r:.3f}" for r in ratios) + f"; median {statistics.median(ratios):.3f}; the table "
                  "shows each case's median round")  # fmt: skip
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "results_dir"}
    settings.update(device=args.device or "cpu", copy_gbps=gbps)
    extra = {"profile": runs[-1][1], "runs": dict(runs), "after/before per round": ratios, "rounds": rounds}
    save_report(
        args.name, rows, settings=settings, plot_column="host ms per block pass", notes=notes, extra=extra,
        **({"results_dir": args.results_dir} if args.results_dir else {}),
    )  # fmt: skip
    return dict(runs)


def _commit(checkout: Path) -> str:
    """The short commit of a checkout, with ``+`` when its files differ from it."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--", "nvoffload"], capture_output=True, text=True, check=True).stdout
    return head + ("+" if changed.strip() else "")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.host_profile:
        return host_profile(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (args.batch, args.seq_len), generator=g).to(device)
    y = x.roll(-1, dims=1)

    # compute alone: everything resident
    model = build(args, device)
    step_s(model, x, y, device)  # warm-up
    compute_f, compute_b = _medians([step_s(model, x, y, device) for _ in range(args.repeats)])
    compute = compute_f + compute_b
    block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks]
    del model

    copy_bytes = 2 * sum(block_bytes) - block_bytes[-1]  # the last block stays on the device for backward
    simulated = device.type == "cpu"
    gbps = args.copy_gbps or (copy_bytes / compute / 1e9 if simulated else None)
    compute_dev = SimDevice(copy_gbps=gbps) if simulated else compute_device(device)
    host_bytes = sum(-(-b // 4096) * 4096 for b in block_bytes) + 8 * MiB
    engine = TransferEngine(host_bytes, compute_dev, what="the benchmark's host cache")

    # the copies alone, on the same engine
    model = build(args, device)
    copies_f, copies_b = _medians([copies_s(engine, list(model.blocks), device)[:2] for _ in range(args.repeats)])
    copies = copies_f + copies_b
    del model

    # streamed
    model = build(args, device)
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    memory = MemoryManager(device_memory_bytes=2 * resident + 6 * max(block_bytes) + 8 * MiB, cpu_memory_bytes=host_bytes)
    with tempfile.TemporaryDirectory(prefix="nvoffload-bench-overlap-") as swap, TensorStore(swap) as store:
        streamer = ParameterStreamer(model, store, memory, device=device, transfer=engine)
        step_s(model, x, y, device)  # warm-up: reads every block into the host cache
        times, waits = [], []
        for _ in range(args.repeats):
            streamer.reset_stats()
            times.append(sum(step_s(model, x, y, device)))
            waits.append(streamer.stats().io_wait_s)
        streamed = statistics.median(times)
        waited = statistics.median(waits)
        with trace.tracing() as recorded:  # one more step, for the timeline
            traced_s = sum(step_s(model, x, y, device))
        spans = recorded.spans()
        streamer.close()
    engine.close()
    compute_dev.close()

    # A block's copy can only start once the device has room (one block ahead) and the forward and backward
    # copies cannot run ahead of their pass: each pass takes at least the longer of its compute and its copies.
    bound = max(compute_f, copies_f) + max(compute_b, copies_b)
    rows = [
        {"case": "compute", "seconds": compute},
        {"case": "copies", "seconds": copies},
        {"case": "max(compute, copies)", "seconds": max(compute, copies)},
        {"case": "compute + copies", "seconds": compute + copies},
        {"case": "per phase: max(compute, copies) forward + backward", "seconds": bound},
        {"case": "streamed", "seconds": streamed},
        {"case": "streamed: compute waiting for copies", "seconds": waited},
    ]
    ratios = {
        "streamed/max": streamed / max(compute, copies), "streamed/sum": streamed / (compute + copies),
        "streamed/per_phase": streamed / bound,
    }  # fmt: skip
    notes = (
        f"streamed step / max(compute, copies) = {ratios['streamed/max']:.2f}; "
        f"streamed step / per-phase bound = {ratios['streamed/per_phase']:.2f} (forward: compute {compute_f:.3f} s, "
        f"copies {copies_f:.3f} s; backward: compute {compute_b:.3f} s, copies {copies_b:.3f} s); "
        f"streamed step / (compute + copies) = {ratios['streamed/sum']:.2f}; "
        f"compute waited {waited:.3f} s for copies ({waited / copies:.0%} of the copy time not hidden). "
        f"{copy_bytes / MiB:.1f} MiB copied per step"
        + (f", stand-in copies at {gbps:.3g} GB/s." if simulated else f" on {torch.cuda.get_device_name(device)}.")
    )
    settings = {k: v for k, v in vars(args).items() if k != "results_dir"}
    settings.update(device=str(device), copy_gbps=gbps)

    title = (f"one traced streamed step, {traced_s * 1e3:.1f} ms (median {streamed * 1e3:.1f} ms); "
             f"compute {compute * 1e3:.1f} ms, copies {copies * 1e3:.1f} ms alone")  # fmt: skip

    save_report(
        args.name, rows, settings=settings, plot_column="seconds", notes=notes,
        extra={"ratios": ratios, "timeline": spans},
        plot=lambda plt: plot_trace(plt, spans, title), **({"results_dir": args.results_dir} if args.results_dir else {}),
    )  # fmt: skip
    return {"rows": rows, "ratios": ratios, "spans": spans}


if __name__ == "__main__":
    main()
