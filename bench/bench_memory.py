"""Host memory of GPT-2 124M training: plain torch in RAM vs nvoffload with everything on NVMe.

Each case runs in a fresh subprocess (so one case's heap never inflates the
next), trains a few steps, and records the process's resident memory:

- a timeline of VmRSS sampled every few milliseconds by a thread, with markers
  at each phase (after imports, after the model is built, after
  ``initialize``/the optimizer, each forward, backward and step);
- per phase, the peak reached inside it (VmHWM, reset at the start of the phase
  through ``/proc/self/clear_refs``) and the RSS at its end;
- where the memory is at each phase end and at the moment of the peak:
  file-backed pages (the libraries' code), the main heap, glibc's per-thread
  arenas, other anonymous mappings (large tensors, the host slab), the C
  heap's bytes in use and held free (``mallinfo2``), and, at phase ends, the
  tensors alive (parameters, gradients, optimizer state, others, counted once
  per storage through ``gc``) and the autograd-saved bytes held in memory.

Cases (``--cases``):

- ``torch``: plain torch, model and AdamW in RAM (the model's own loss, whose
  logits are computed a chunk of rows at a time: ``nvoffload.models.gpt.lm_head_loss``);
- ``torch_full_logits``: the same with the loss written the usual way,
  ``F.cross_entropy(model(x).view(-1, vocab), y)`` (the whole fp32 logits);
- ``nvoffload``: model built on the meta device, ``nvoffload.initialize`` with
  ``--cpu-memory-mib``/``--device-memory-mib`` (256/400), activations offloaded;
  ``initialize`` fixes glibc's mmap threshold at 8 MiB
  (:func:`nvoffload.memory.release_freed_host_memory`);
- ``nvoffload_glibc_default``: the same with glibc's dynamic threshold left
  alone (``release_freed_host_memory`` made a no-op): what it saves;
- ``nvoffload_retained``: the same with ``retain_host_memory=True`` (freed
  memory kept for the next step: the faster, larger trade).

Ratios printed: each case's peak vs plain torch, and vs the budgets (host +
device; on a CPU the device tier is host memory too).

    python bench/bench_memory.py [--quick] [--preset gpt2-124m] [--batch 1] [--seq-len 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
CASES = ("torch", "torch_full_logits", "nvoffload", "nvoffload_glibc_default", "nvoffload_retained")
# glibc's settings read from the environment at start: every case runs without them
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


# --------------------------------------------------------------------------- probes (cheap, no torch)
def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    """Restart VmHWM at the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_HEAP_MAX = 64 * MiB  # glibc's per-thread arena heaps are 64 MiB-aligned reservations of at most 64 MiB


def _smaps() -> dict[str, int]:
    """Resident bytes by kind of mapping: file (libraries), heap (main arena), arenas (threads' heaps),
    stacks, anon_large (anonymous mappings: big tensors, the host slab, the I/O buffers)."""
    kinds = {"file": 0, "heap": 0, "arenas": 0, "stack": 0, "anon_large": 0, "arena_count": 0}
    start = size = 0
    name = ""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return kinds
    for line in lines:
        first = line.split(None, 5)
        if "-" in first[0] and len(first) >= 5 and not first[0].endswith(":"):
            lo, hi = first[0].split("-")
            start, size = int(lo, 16), int(hi, 16) - int(lo, 16)
            name = first[5].strip() if len(first) > 5 else ""
            if not name and start % _HEAP_MAX == 0 and size <= _HEAP_MAX:
                kinds["arena_count"] += 1
        elif first[0] == "Rss:":
            rss = int(first[1]) * 1024
            if name.startswith("/"):
                kinds["file"] += rss
            elif name == "[heap]":
                kinds["heap"] += rss
            elif name.startswith("[stack"):
                kinds["stack"] += rss
            elif name:
                kinds["file"] += rss  # [vdso], [vvar], ...
            elif start % _HEAP_MAX == 0 and size <= _HEAP_MAX:
                kinds["arenas"] += rss
            else:
                kinds["anon_large"] += rss
    return kinds


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


try:
    _LIBC = ctypes.CDLL(None)
    _LIBC.mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):
    _LIBC = None


def _mallinfo() -> dict[str, int]:
    """glibc's heap, over all arenas: bytes in use, free but held, and in mmapped chunks."""
    if _LIBC is None:
        return {}
    m = _LIBC.mallinfo2()
    return {"malloc_in_use": m.uordblks, "malloc_free_held": m.fordblks, "malloc_mmapped": m.hblkhd}


class Recorder:
    """The RSS timeline (a sampling thread), phase markers and the breakdown at the peak."""

    def __init__(self, interval_s: float = 0.005):
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self.phases: list[dict] = []
        self.peak = {"rss": 0}  # and, at the last big rise: the phase it rose in, smaps and mallinfo
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        _reset_hwm()

    def _run(self) -> None:
        snapped = 0
        while not self._stop.is_set():
            rss = _rss()
            self.samples.append((time.perf_counter() - self.t0, rss))
            if rss > self.peak["rss"]:
                self.peak["rss"] = rss
                if rss > snapped + 32 * MiB:  # a new peak: where is the memory now?
                    snapped = rss
                    self.peak.update(phase=len(self.phases), smaps=_smaps(), malloc=_mallinfo(), at_s=self.samples[-1][0])
            self._stop.wait(self._interval)

    def mark(self, name: str, extra: dict | None = None) -> dict:
        """End the current phase (named ``name``): its peak (VmHWM since the last mark) and the state now."""
        status = _status()
        entry = {
            "phase": name,
            "t_s": time.perf_counter() - self.t0,
            "rss": status.get("VmRSS", 0),
            "phase_peak": max(status.get("VmHWM", 0), status.get("VmRSS", 0)),
            "anon": status.get("RssAnon", 0),
            "file": status.get("RssFile", 0),
            **_smaps(),
            **_mallinfo(),
            **(extra or {}),
        }
        self.phases.append(entry)
        _reset_hwm()
        return entry

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- what tensors are alive
def _tensor_census(params=(), state_tensors=()) -> dict[str, int]:
    """Bytes of CPU tensors alive (each storage counted once): parameters, gradients, optimizer state, other."""
    import torch

    seen: set[int] = set()
    out = {"t_params": 0, "t_grads": 0, "t_optim": 0, "t_other": 0}

    def add(kind: str, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            return
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            return
        if key and key not in seen:
            seen.add(key)
            out[kind] += nbytes

    for p in params:
        add("t_params", p)
    for p in params:
        add("t_grads", p.grad)
    for t in state_tensors:
        add("t_optim", t)
    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated module objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    add("t_other", obj)
            except ReferenceError:
                pass
    return out


class _SavedCounter:
    """Autograd-saved tensors held in memory (plain torch): bytes, each storage once."""

    def __init__(self):
        import torch

        self.live: dict[int, int] = {}
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.live and not isinstance(t, __import__("torch").nn.Parameter):
            self.live[key] = st.nbytes()
            self.peak += st.nbytes()
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


# --------------------------------------------------------------------------- one case, in its own process
def _worker(args) -> None:
    rec = Recorder()
    import torch

    import nvoffload
    from nvoffload.models import GPT, GPTConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    rec.mark("imports")
    torch.manual_seed(0)
    base = GPTConfig.preset(args.preset)
    cfg = GPTConfig(**{**base.__dict__, "seq_len": args.seq_len})
    offload = args.case.startswith("nvoffload")
    swap = tempfile.TemporaryDirectory(dir=args.swap_dir) if offload else None
    if offload:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    rec.mark("model built")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    session = None
    if args.case == "nvoffload_glibc_default":
        import nvoffload.training

        nvoffload.training.release_freed_host_memory = lambda: False
    if offload:
        model, opt = nvoffload.initialize(
            model, opt,
            nvoffload.OffloadConfig(
                swap_dirs=[swap.name], cpu_memory_bytes=int(args.cpu_memory_mib * MiB),
                device_memory_bytes=int(args.device_memory_mib * MiB), device="cpu", offload_activations=True,
                retain_host_memory=args.case == "nvoffload_retained",
            ),
            param_init_fn=model.init_weights,
        )  # fmt: skip
        session = opt.session
        rec.mark("initialize", _census(model, opt, session))
    else:
        rec.mark("optimizer built", _census(model, opt, session))
    g = torch.Generator().manual_seed(1)
    losses = []
    saved_peak = 0
    for step in range(1, args.steps + 1):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g)
        if session is not None:
            session.reset_stats()
        counter = _SavedCounter() if session is None else None
        if counter is not None:
            with counter:
                if args.case == "torch_full_logits":
                    logits = model(x)
                    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.roll(-1, dims=1).view(-1))
                    del logits
                else:
                    loss = model(x, x.roll(-1, dims=1))
            saved = counter.peak
        else:
            loss = model(x, x.roll(-1, dims=1))
            saved = _activation_held(session)
        saved_peak = max(saved_peak, saved)
        rec.mark(f"forward {step}", {"saved": saved, **(_census(model, opt, session) if step == 1 else {})})
        loss.backward()
        rec.mark(f"backward {step}", _census(model, opt, session) if step == 1 else {})
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        del loss
        extra = {}
        if session is not None:
            tiers = session.memory_stats()
            extra = {"host_tier_peak": tiers["host"].peak_bytes, "device_tier_peak": tiers["device"].peak_bytes}
        if step == 1:
            extra.update(_census(model, opt, session))
        rec.mark(f"step {step}", extra)
    if session is not None:
        session.close()
    if swap is not None:
        swap.cleanup()
    rec.stop()
    if "phase" in rec.peak:  # the index of the phase the peak was reached in -> its name
        rec.peak["phase"] = rec.phases[min(rec.peak["phase"], len(rec.phases) - 1)]["phase"]
    result = {
        "case": args.case,
        "n_params": n_params,
        "losses": losses,
        "saved_peak": saved_peak,
        "phases": rec.phases,
        "peak": rec.peak,
        "timeline": rec.samples[:: max(1, len(rec.samples) // 1500)],
        "env": {k: os.environ[k] for k in _MALLOC_ENV if k in os.environ},
    }
    Path(args.out).write_text(json.dumps(result))


def _census(model, opt, session) -> dict[str, int]:
    params = list(model.parameters())
    state = [] if session is not None else [t for s in opt.state.values() for t in s.values()]
    out = _tensor_census(params, state)
    if session is not None:
        tiers = session.memory_stats()
        out["host_tier_used"], out["device_tier_used"] = tiers["host"].used_bytes, tiers["device"].used_bytes
    return out


def _activation_held(session) -> int:
    act = getattr(session, "_activations", None)
    if act is None:
        return 0
    return int(act.stats().peak_resident_bytes)


# --------------------------------------------------------------------------- the driver
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny preset, tiny budgets, 2 steps: a smoke run")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--cpu-memory-mib", type=float, default=256)
    p.add_argument("--device-memory-mib", type=float, default=400)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--swap-dir", default=None, help="directory on NVMe (default: a temporary one under /tmp)")
    p.add_argument("--name", default="bench_memory")
    p.add_argument("--results-dir", type=Path, default=None, help="default: bench/results")
    p.add_argument("--worker", dest="case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.seq_len, args.batch, args.steps = "tiny", 64, 2, 2
        args.cpu_memory_mib, args.device_memory_mib = 8, 8
    return args


def _run_case(case: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{case}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--out", out,
           "--preset", args.preset, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--lr", str(args.lr), "--cpu-memory-mib", str(args.cpu_memory_mib),
           "--device-memory-mib", str(args.device_memory_mib), "--threads", str(args.threads)]  # fmt: skip
    if args.swap_dir:
        cmd += ["--swap-dir", args.swap_dir]
    env = {k: v for k, v in os.environ.items() if k not in _MALLOC_ENV}
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    result = json.loads(Path(out).read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def _mib(n) -> float:
    return round(n / MiB, 1)


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.case:
        _worker(args)
        return Path(args.out)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import RESULTS_DIR, save_report

    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            print(f"--- {case}", flush=True)
            results[case] = _run_case(case, args, tmp)
    budget = int((args.cpu_memory_mib + args.device_memory_mib) * MiB)
    base = next((c for c in ("torch_full_logits", "torch") if c in results), None)
    torch_peak = max(p["phase_peak"] for p in results[base]["phases"]) if base else None

    rows, phase_rows = [], []
    for case, r in results.items():
        phases = r["phases"]
        peak = max(p["phase_peak"] for p in phases)
        peak_phase = max(phases, key=lambda p: p["phase_peak"])["phase"]
        steady = [p for p in phases if p["phase"].split()[-1].isdigit() and int(p["phase"].split()[-1]) >= 2]
        ends = [p["t_s"] for p in phases if p["phase"].startswith("step ")]
        step_s = sorted(b - a for a, b in zip(ends, ends[1:]))
        rows.append({
            "case": case,
            "peak_rss_mib": _mib(peak),
            "peak_phase": peak_phase,
            "imports_mib": _mib(phases[0]["rss"]),
            "after_init_mib": _mib(phases[2]["rss"]),
            "steady_peak_mib": _mib(max((p["phase_peak"] for p in steady), default=peak)),
            "over_budgets_mib": _mib(peak - budget) if case.startswith("nvoffload") else None,
            "vs_torch": round(peak / torch_peak, 3) if torch_peak else None,
            "saved_peak_mib": _mib(r["saved_peak"]),
            "step_s": round(step_s[len(step_s) // 2], 2) if step_s else None,
            "loss_last": round(r["losses"][-1], 4),
            "wall_s": round(r["wall_s"], 1),
        })  # fmt: skip
        for p in phases:
            phase_rows.append({
                "case": case, "phase": p["phase"], "rss_mib": _mib(p["rss"]), "phase_peak_mib": _mib(p["phase_peak"]),
                "file_mib": _mib(p["file"]), "heap_mib": _mib(p["heap"]), "arenas_mib": _mib(p["arenas"]),
                "arena_count": p["arena_count"], "anon_large_mib": _mib(p["anon_large"]),
                "malloc_in_use_mib": _mib(p.get("malloc_in_use", 0)), "malloc_free_held_mib": _mib(p.get("malloc_free_held", 0)),
                "tensors_mib": _mib(sum(p.get(k, 0) for k in ("t_params", "t_grads", "t_optim", "t_other")))
                if "t_params" in p else None,
            })  # fmt: skip

    settings = {
        "preset": args.preset, "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
        "cpu_memory_bytes": int(args.cpu_memory_mib * MiB), "device_memory_bytes": int(args.device_memory_mib * MiB),
        "n_params": next(iter(results.values()))["n_params"], "threads": args.threads or None,
    }  # fmt: skip
    lines = []
    for row in rows:
        if row["case"].startswith("nvoffload"):
            lines.append(
                f"{row['case']}: peak {row['peak_rss_mib'] / 1024:.2f} GiB = budgets + {row['over_budgets_mib'] / 1024:.2f} GiB"
                + (f", {row['vs_torch']:.2f}x plain torch ({base}: {torch_peak / GiB:.2f} GiB)" if torch_peak else "")
                + f"; peak in '{row['peak_phase']}'"
            )
    for case, r in results.items():
        pk = r["peak"]
        if "smaps" in pk:
            s, m = pk["smaps"], pk.get("malloc", {})
            lines.append(
                f"{case} at its peak (in {pk['phase']!r}, {pk['rss'] / GiB:.2f} GiB): file {s['file'] / MiB:.0f} MiB, "
                f"main heap {s['heap'] / MiB:.0f}, {s['arena_count']} thread arenas {s['arenas'] / MiB:.0f}, "
                f"anonymous mappings {s['anon_large'] / MiB:.0f} MiB; malloc in use {m.get('malloc_in_use', 0) / MiB:.0f}, "
                f"free but held {m.get('malloc_free_held', 0) / MiB:.0f}, mmapped chunks {m.get('malloc_mmapped', 0) / MiB:.0f} MiB"
            )
    notes = "\n".join(["Budgets: host + device = %.0f MiB." % (budget / MiB)] + lines)
    notes += "\n\n## Phases\n\n" + _markdown(phase_rows)
    results_dir = args.results_dir or RESULTS_DIR
    path = save_report(
        args.name, rows, settings=settings, plot_column="peak_rss_mib", notes=notes, results_dir=results_dir,
        extra={"phases": phase_rows, "runs": {c: {k: v for k, v in r.items() if k != "timeline"} for c, r in results.items()}},
        plot=lambda plt: _timeline(plt, results, budget, torch_peak),
    )  # fmt: skip
    timeline = {c: r["timeline"] for c, r in results.items()}
    (Path(results_dir) / f"{args.name}_timeline.json").write_text(json.dumps(timeline))
    return path


def _markdown(rows):
    from report import markdown_table

    return markdown_table(rows)


def _timeline(plt, results, budget, torch_peak):
    fig, ax = plt.subplots(figsize=(11, 5))
    for case, r in results.items():
        t = [s[0] for s in r["timeline"]]
        y = [s[1] / GiB for s in r["timeline"]]
        (line,) = ax.plot(t, y, label=case, lw=1)
        for p in r["phases"]:
            ax.axvline(p["t_s"], color=line.get_color(), lw=0.4, alpha=0.5)
            if p["phase"] in ("imports", "initialize", "optimizer built", "forward 1", "backward 1", "step 1"):
                ax.annotate(p["phase"], (p["t_s"], p["rss"] / GiB), fontsize=6, rotation=60, color=line.get_color())
    ax.axhline(budget / GiB, color="k", ls="--", lw=0.8, label="host + device budgets")
    ax.axhline(budget / GiB + 1, color="k", ls=":", lw=0.8, label="budgets + 1 GiB (target)")
    if torch_peak:
        ax.axhline(0.5 * torch_peak / GiB, color="r", ls=":", lw=0.8, label="0.5x plain torch peak (target)")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("RSS (GiB)")
    ax.set_title("RSS over time, phase markers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
