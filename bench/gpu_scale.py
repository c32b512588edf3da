"""The scale run (issue 50): a Llama-shaped full fine-tune, streamed, beside its bound and the planner, in one run.

One process, in this order, each case within what is left of ``--budget-s`` (a case that finds too little time
left is skipped with a message), each written to the results as it ends (a case that fails leaves the others'):

- ``calibrate``: the machine's profile (:func:`nvoffload.planner.calibrate.calibrate`), for the planner's
  predictions below and for the copy and disk rates of the bounds;
- ``ram``: a Llama-2-7B-shaped model (``--model``; random weights from its configuration, built on the meta device
  and filled block by block by :func:`nvoffload.initialize`, nothing downloaded), bf16, streamed, exact AdamW
  (fp32 master and moments), every block cached and the whole optimizer state resident in host memory, the
  vertical schedule (:func:`nvoffload.vertical_step`) over ``--micro-batches`` sequences of ``--seq-len`` tokens,
  ``--warmup-steps`` then ``--timed-steps`` timed steps and one traced step (its timeline: ``gpu_scale_trace.json``,
  Perfetto, and ``gpu_scale.png``). Beside it, measured in this process: compute alone (the same micro-batches,
  the model resident on the device, each block recomputed in backward as the streamed step recomputes it, no
  optimizer), the copies (the step's bytes at the copy rates calibrated here) and the CPU Adam (the fused kernel
  over every parameter, state in host memory); the step against max(those), and the planner's prediction;
- ``overlap``: ``bench/bench_overlap.py`` at the sizes of its H100 run (``bench/results/bench_overlap_h100.*``),
  unprofiled: the streamed step against compute alone;
- ``gds``: the ``gds``-marked tests (pytest, junit XML beside the results), kvikio's version and whether cuFile
  runs in compatibility mode, and the store's GPUDirect Storage path against its bounce-buffer path (the
  transfer engine's ``save``/``load``), the same bytes each way;
- ``nvme``: the same model with at least ``--nvme-state`` bytes of its optimizer state in the store at a step's
  peak (two generations: one read, one written; the host budget cut to hold the rest), the step against max(compute alone, its NVMe bytes at the
  swap directory's calibrated rates, the copies, the CPU Adam), and the planner's prediction.

The model's layers: a Llama-2-7B has 32; without ``--layers`` the run takes the most of its layers (the same blocks, so the
same kernels) whose exact-AdamW state fits the host memory (``--host-memory``) with every block cached, and that
:func:`nvoffload.initialize` accepts for the swap directory's free space; every refusal is kept in the results.
Exact AdamW keeps two generations of fp32 master and moments resident, 24 bytes a parameter, so a whole 7B needs
162 GB of host memory for its state alone: more than the 128 GiB the GPU machine has. ``initialize`` also asks
the swap directory for the weights and two generations of the whole state, resident or not (26 bytes a parameter:
175 GB for a 7B, against that machine's 64 GiB disk). See ``bench/results/gpu_scale/README.md``.

Model TFLOP/s count ``6 x P x tokens + 12 x layers x d_model x seq_len x tokens``: P every parameter but the
input embedding (a lookup), the LM head included; attention's QK^T and AV forward and backward, the causal mask
not halved; recomputation not counted. The formula, with its figures, is in the output.

    python bench/gpu_scale.py                      # on the GPU machine (one H200): about 7 minutes
    python bench/gpu_scale.py --dry                # the same cases on the CPU stand-in, a tiny Llama: ~30 s
    python bench/gpu_scale.py --cases ram,nvme --profile bench/results/gpu_scale/nvidia-h200/gpu_scale.json

Results in ``--results-dir`` (default ``bench/results/gpu_scale/<device>/``): ``gpu_scale.json`` (rewritten as
each case ends), ``gpu_scale.md`` (the table), ``gpu_scale.png`` (the traced step's timeline),
``gpu_scale_trace.json``, ``gpu_scale_overlap.png``, ``gds_tests.xml``. Exit status 0 when no case failed, 1
otherwise, 2 for bad arguments or no GPU without ``--dry``.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from report import machine_info, markdown_table, plot_trace  # noqa: E402

import nvoffload  # noqa: E402
from nvoffload import trace  # noqa: E402
from nvoffload.core.atomic import replace_file  # noqa: E402
from nvoffload.planner import ModelShape, PlanRequest, load_profile, plan  # noqa: E402
from nvoffload.streaming import find_blocks  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
PAGE = 4096
CASES = ("ram", "overlap", "gds", "nvme")
# Meta's published config.json files (meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B); "tiny" for --dry.
LLAMA = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=128, rope_theta=10000.0),
}  # fmt: skip
# Host bytes of the optimizer's staging slots: 4 slots of its largest chunk (16 MiB of fp32 master, 4 Mi elements
# x 18 bytes: three fp32 rows, the gradient's and the weights' staging), with room to spare; the dry run's tiny
# chunks need far less.
OPTIMIZER_BYTES = {"gpu": 512 * MiB, "dry": 8 * MiB}
# What a case needs at least, in seconds, to be started (on the GPU machine; the dry run's are a tenth): the
# RAM case's initialize (page-locking its host budget, writing the weights), five steps and compute alone; the
# NVMe case's need is the planner's when a profile is at hand.
NEED_S = {"calibrate": 60, "ram": 120, "overlap": 15, "gds": 45, "nvme": 150}


@dataclass(frozen=True)
class Run:
    """What the run is asked for (``--dry`` sets the tiny sizes)."""

    dry: bool
    device: str
    model: str
    layers: int | None  # None: the most that fit (see the module docs)
    seq_len: int
    micro_batches: int
    warmup_steps: int
    timed_steps: int
    host_memory_bytes: int
    device_memory_bytes: int
    nvme_state_bytes: int
    swap_dir: str
    adam_pool_bytes: int  # host memory the CPU Adam bound's kernel runs over (beyond the caches)
    gds_bytes: int  # bytes each way of the GDS comparison
    overlap_args: tuple[str, ...]

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.seq_len

    @property
    def optimizer_bytes(self) -> int:
        return OPTIMIZER_BYTES["dry" if self.dry else "gpu"]


def parse_size(text: str) -> int:
    """``"30G"`` -> 30 * 2**30: a byte count with K, M, G or T (of 1024), or plain bytes."""
    units = {"K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}
    try:
        return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 30G, 512M, 4096)") from None


def parse_args(argv) -> tuple[argparse.Namespace, Run]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="every case on the CPU stand-in at a tiny shape (the suite's run)")
    p.add_argument("--budget-s", type=float, default=450.0, help="seconds for the whole run; a case that finds too little left is skipped")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--model", choices=sorted(set(LLAMA) - {"tiny"}), default="llama2-7b")
    p.add_argument("--layers", type=int, default=None, help="of the model's layers (default: the most that fit)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=64, help="sequences a step, one a micro-batch (the vertical schedule's G)")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--timed-steps", type=int, default=3)
    p.add_argument("--host-memory", type=parse_size, default=None, help="host bytes the RAM case may take (default: MemTotal less 16G)")
    p.add_argument("--device-memory", type=parse_size, default=32 * GiB, help="the streamed cases' device_memory_bytes")
    p.add_argument("--nvme-state", type=parse_size, default=30 * 10**9, help="optimizer state bytes the NVMe case keeps in the store at the step's peak (two generations)")
    p.add_argument("--swap-dir", default=None, help="where the swap files go (default: TMPDIR or /tmp)")
    p.add_argument("--profile", default=None, help="a profile JSON to plan with instead of calibrating (a rerun's)")
    p.add_argument("--results-dir", type=Path, default=None, help="default: bench/results/gpu_scale/<device>/")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    if unknown := set(args.cases) - set(CASES):
        p.error(f"--cases: unknown {', '.join(sorted(unknown))} (choose from {', '.join(CASES)})")
    for name in ("layers", "seq_len", "micro_batches", "timed_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.swap_dir is not None and not os.path.isdir(args.swap_dir):
        p.error(f"--swap-dir {args.swap_dir}: not a directory")
    if args.dry:
        return args, Run(
            dry=True, device="cpu", model="tiny", layers=args.layers, seq_len=32, micro_batches=2, warmup_steps=1,
            timed_steps=3, host_memory_bytes=args.host_memory or 256 * MiB, device_memory_bytes=64 * MiB,
            nvme_state_bytes=2 * MiB, swap_dir=args.swap_dir or tempfile.gettempdir(), adam_pool_bytes=16 * MiB,
            gds_bytes=8 * MiB, overlap_args=("--quick",),
        )  # fmt: skip
    if not torch.cuda.is_available():
        p.exit(2, "gpu_scale.py: torch sees no CUDA device here; --dry runs the cases on the CPU stand-in\n")
    return args, Run(
        dry=False, device="cuda", model=args.model, layers=args.layers, seq_len=args.seq_len,
        micro_batches=args.micro_batches, warmup_steps=args.warmup_steps, timed_steps=args.timed_steps,
        host_memory_bytes=args.host_memory or _meminfo("MemTotal") - 16 * GiB, device_memory_bytes=args.device_memory,
        nvme_state_bytes=args.nvme_state, swap_dir=args.swap_dir or tempfile.gettempdir(), adam_pool_bytes=4 * GiB,
        gds_bytes=2 * GiB, overlap_args=("--repeats", "10"),
    )  # fmt: skip


# -- the run's record ---------------------------------------------------------------


class Budget:
    """The seconds left of ``--budget-s``."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Results:
    """``gpu_scale.json`` and ``gpu_scale.md``, rewritten (atomically) whenever a case records something."""

    def __init__(self, directory: Path, record: dict):
        self.directory = directory
        self.record = record
        directory.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        with replace_file(self.directory / "gpu_scale.json", "w", encoding="utf-8") as f:
            f.write(json.dumps(self.record, indent=1, default=str) + "\n")
        with replace_file(self.directory / "gpu_scale.md", "w", encoding="utf-8") as f:
            f.write(summary_markdown(self.record))

    def run_case(self, name: str, need_s: float, budget: Budget, body) -> dict:
        """``body(case)`` with ``case`` the case's record (it fills it as it goes, and may call :meth:`write`),
        unless less than ``need_s`` is left of the budget; an exception fails the case, not the run."""
        case = self.record["cases"][name] = {"status": "running"}
        if budget.left() < need_s:
            case.update(status="skipped", reason=f"{budget.left():.0f} s left of the budget, the case needs about {need_s:.0f} s")
            print(f"gpu_scale: {name}: {case['reason']}", flush=True)
            self.write()
            return case
        began = time.monotonic()
        print(f"gpu_scale: {name}: started, {budget.left():.0f} s left", flush=True)
        try:
            body(case)
            case["status"] = "passed"
        except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
            case.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            print(case["traceback"], flush=True)
        case["elapsed_s"] = time.monotonic() - began
        print(f"gpu_scale: {name}: {case['status']} after {case['elapsed_s']:.0f} s. {case.get('summary', '')}", flush=True)
        self.write()
        return case


def summary_markdown(record: dict) -> str:
    """The run as a page: where, what, then a row a case."""
    rows = []
    for name, case in record["cases"].items():
        row = {"case": name, "status": case["status"]}
        for key in ("step_s", "bound_s", "step_vs_bound", "tokens_per_s", "model_tflops", "planned_step_s", "planned_vs_measured"):
            row[key] = case.get(key, "")
        note = case.get("note") or case.get("reason") or case.get("error", "")
        row["note"] = " ".join(note.replace("|", "/").split())[:300]  # one table cell
        rows.append(row)
    settings = record["settings"]
    lines = [
        f"# gpu_scale on {record['environment'].get('device_name', '?')}{' (dry run: the CPU stand-in, a tiny Llama)' if record['dry'] else ''}",
        "", f"Started {record['machine']['date']} at commit {record['environment'].get('commit')}; budget {settings['budget_s']:.0f} s.",
        "", markdown_table(rows), "",
    ]  # fmt: skip
    lines += [f"- {name}: {case['summary']}" for name, case in record["cases"].items() if case.get("summary")]
    if formula := record.get("flops_formula"):
        lines += ["", f"Model FLOPs: {formula}"]
    return "\n".join(lines) + "\n"


def environment(run: Run) -> dict:
    """What the figures are measured on, beside ``report.machine_info()``."""
    env = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": run.device,
        "device_name": torch.cuda.get_device_name() if run.device == "cuda" else "cpu-stand-in-dry-run",
        "host_mem_total_bytes": _meminfo("MemTotal"), "host_mem_available_bytes": _meminfo("MemAvailable"),
        "swap_dir": run.swap_dir, "swap_dir_free_bytes": shutil.disk_usage(run.swap_dir).free,
        "commit": _commit(), "kvikio": None, "kvikio_compat_mode": None,
    }  # fmt: skip
    if importlib.util.find_spec("kvikio") is not None:
        try:
            import kvikio

            from nvoffload.transfer import gds

            env["kvikio"], env["kvikio_compat_mode"] = kvikio.__version__, gds.compat_mode(kvikio)
        except Exception as exc:  # noqa: BLE001 - recorded: the GDS case says why it cannot use it
            env["kvikio"] = f"does not import: {type(exc).__name__}: {exc}"
    return env


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _commit() -> str:
    try:
        ran = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    except OSError:  # no git
        return "unknown"
    return ran.stdout.strip() or "unknown"


def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``, as ``bench/gpu_check.sh`` names its folder."""
    return "-".join("".join(c if c.isalnum() or c == "." else " " for c in name.lower()).split())


def sync(run: Run) -> None:
    if run.device == "cuda":
        torch.cuda.synchronize()


# -- the model and its budgets ----------------------------------------------------------


def llama_config(run: Run, layers: int):
    """The model's ``transformers.LlamaConfig`` with ``layers`` of its decoder layers."""
    import transformers

    return transformers.LlamaConfig(
        **{**LLAMA[run.model], "num_hidden_layers": layers}, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False
    )


def meta_model(config) -> torch.nn.Module:
    from nvoffload.pretrained import build_meta_model

    return build_meta_model(config, dtype=torch.bfloat16)


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass(frozen=True)
class Sizes:
    """A model's bytes, as the budgets and the bounds need them (from its meta-device build)."""

    layers: int
    params: int
    matmul_params: int  # every parameter but the input embedding (a lookup): what the 6 x P of the FLOPs counts
    weight_bytes: int
    block_bytes: list[int]  # each streamed block's weights
    state_bytes: int  # one generation of exact AdamW's state: fp32 master and two moments, 12 bytes a parameter
    state_pages_bytes: int  # what resident chunks' page rounding can add to two generations of it

    @classmethod
    def of(cls, model: torch.nn.Module) -> Sizes:
        params = list(model.parameters())
        embedding = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight is embedding
        blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in find_blocks(model)]
        numel = sum(p.numel() for p in params)
        return cls(
            layers=model.config.num_hidden_layers, params=numel, matmul_params=numel - (0 if tied else embedding.numel()),
            weight_bytes=sum(p.numel() * p.element_size() for p in params), block_bytes=blocks,
            state_bytes=12 * numel,
            state_pages_bytes=2 * PAGE * (len(params) + numel // MiB),  # a page a generation a chunk, at most
        )  # fmt: skip

    def flops_per_token(self, config, seq_len: int) -> float:
        return 6 * self.matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len

    def flops_formula(self, config, seq_len: int) -> str:
        return (
            f"tokens x (6 x {self.matmul_params} parameters (all {self.params} but the input embedding's"
            f" {self.params - self.matmul_params}: a lookup; the LM head counted) + 12 x {config.num_hidden_layers} layers x"
            f" {config.hidden_size} d_model x {seq_len} tokens of context (attention's QK^T and AV, forward and backward,"
            f" the causal mask not halved)) = tokens x {self.flops_per_token(config, seq_len):.4g} FLOPs; recomputation"
            " not counted"
        )

    def host_budget(self, run: Run, resident_bytes: int) -> tuple[int, float]:
        """``(cpu_memory_bytes, optimizer_memory_fraction)``: the optimizer's slots, every block cached and
        ``resident_bytes`` left for resident optimizer state, as :func:`nvoffload.initialize` splits the host budget
        (:func:`nvoffload.memory.resident_state_share`)."""
        block_pages = [pages(b) for b in self.block_bytes]
        cache = max(sum(block_pages), 3 * max(block_pages))  # every block, and at least the three streaming needs
        cpu = pages(run.optimizer_bytes) + cache + pages(resident_bytes) + 16 * PAGE  # the slab's carves round to pages
        return cpu, run.optimizer_bytes / cpu

    def resident_for_ram(self, run: Run) -> int:
        """Host bytes that keep both generations of the whole state resident."""
        return 2 * self.state_bytes + self.state_pages_bytes

    def resident_for_nvme(self, run: Run) -> int:
        """Host bytes that keep all but ``run.nvme_state_bytes`` of the state's two generations resident."""
        return max(0, 2 * self.state_bytes - run.nvme_state_bytes)


def open_streamed(run: Run, case: dict, resident, swap: str, layers: int | None):
    """:func:`nvoffload.initialize` of the model with ``layers`` layers, or (None) the most whose host budget (with
    ``resident(sizes, run)`` bytes of resident state) fits ``run.host_memory_bytes`` and that ``initialize`` accepts
    for the swap directory's free space; each count refused is recorded in ``case["refused"]``. Returns
    ``(model, optimizer, sizes)``; the case gets the budgets."""
    refused = case.setdefault("refused", [])
    count = layers or LLAMA[run.model]["num_hidden_layers"]
    while count >= 1:
        config = llama_config(run, count)
        model = meta_model(config)
        sizes = Sizes.of(model)
        cpu, fraction = sizes.host_budget(run, resident(sizes, run))
        if layers is None and cpu > run.host_memory_bytes:
            refused.append({"layers": count, "why": f"host budget {cpu} bytes > --host-memory {run.host_memory_bytes}"})
            print(f"gpu_scale: {count} layers: {refused[-1]['why']}", flush=True)
            count -= 1
            continue
        offload = nvoffload.OffloadConfig(
            swap_dirs=[swap], cpu_memory_bytes=cpu, device_memory_bytes=run.device_memory_bytes,
            optimizer_memory_fraction=fraction, device=run.device,
        )  # fmt: skip
        began = time.perf_counter()
        try:
            model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1), offload)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or layers is not None:
                raise
            refused.append({"layers": count, "why": f"initialize refused: {exc}"})
            print(f"gpu_scale: {count} layers: {refused[-1]['why']}", flush=True)
            count -= 1
            continue
        resident_state = opt.memory_stats().resident_state_bytes  # a generation, as the optimizer counts it
        case.update(
            layers=count, params=sizes.params, init_s=time.perf_counter() - began, cpu_memory_bytes=cpu,
            optimizer_memory_fraction=fraction, device_memory_bytes=run.device_memory_bytes,
            state_bytes=sizes.state_bytes, resident_state_bytes=resident_state,
            state_in_store_bytes=sizes.state_bytes - resident_state,  # a generation: read and written each step
        )  # fmt: skip
        return model, opt, sizes
    raise RuntimeError(f"no number of {run.model}'s layers fits: {refused[-1]['why'] if refused else ''}")


def micro_batches(run: Run, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's micro-batches: one sequence each, ``(input_ids, labels)`` (the model shifts the labels)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (run.micro_batches, 1, run.seq_len), generator=g).to(run.device)
    return [(x, x) for x in ids]


# -- the steps ---------------------------------------------------------------------------


def timed_steps(run: Run, opt, batches, case: dict, results: Results, budget: Budget) -> None:
    """``run.warmup_steps`` then ``run.timed_steps`` steps by the vertical schedule, each in ``case["steps"]`` as it
    ends; the median timed step and its NVMe bytes in the case. Stops early, keeping what ran, when the budget would
    not hold another step."""
    session = opt.session
    steps = case["steps"] = []
    for i in range(run.warmup_steps + run.timed_steps):
        if steps and budget.left() < 1.5 * steps[-1]["step_s"] + 5:
            case["note"] = f"stopped after {len(steps)} steps: the budget"
            break
        session.reset_stats()
        sync(run)
        start = time.perf_counter()
        losses = nvoffload.vertical_step(opt, batches)
        sync(run)
        seconds = time.perf_counter() - start
        read, written = session.io_bytes()
        streamed = session.streamer.stats()
        steps.append({
            "step": i, "warmup": i < run.warmup_steps, "step_s": seconds, "loss": float(losses.mean()),
            "nvme_read_bytes": read, "nvme_written_bytes": written, "io_wait_s": streamed.io_wait_s,
            "grad_wait_s": streamed.grad_wait_s,
        })  # fmt: skip
        print(f"gpu_scale: step {i}{' (warm-up)' if i < run.warmup_steps else ''}: {seconds:.3f} s,"
              f" NVMe {read / 1e9:.2f} GB read, {written / 1e9:.2f} GB written", flush=True)  # fmt: skip
        results.write()
    timed = [s for s in steps if not s["warmup"]]
    if not timed:
        raise RuntimeError(f"no timed step within the budget ({len(steps)} warm-up steps ran)")
    for key in ("step_s", "nvme_read_bytes", "nvme_written_bytes"):
        case[key] = statistics.median(s[key] for s in timed)


def traced_step(run: Run, opt, batches, results_dir: Path) -> tuple[float, list]:
    """One more step under :mod:`nvoffload.trace`: its seconds and spans; the trace as ``gpu_scale_trace.json``."""
    with trace.tracing(results_dir / "gpu_scale_trace.json") as recorded:
        sync(run)
        start = time.perf_counter()
        nvoffload.vertical_step(opt, batches)
        sync(run)
        seconds = time.perf_counter() - start
    return seconds, recorded.spans()


def busy_s(spans: list) -> dict[str, float]:
    """Each lane's busy seconds in a trace (waits not counted): what the engines did in the traced step."""
    busy: dict[str, float] = {}
    for track, name, start, end, _ in spans:
        if not name.startswith("wait"):
            busy[track] = busy.get(track, 0.0) + end - start
    return busy


def compute_alone(run: Run, config, batches) -> dict:
    """The streamed step's compute alone: the same micro-batches, the model resident on the device, each decoder
    layer recomputed in backward (non-reentrant checkpointing, as the vertical schedule runs each block), its
    gradients kept, no optimizer. The median of the timed steps."""
    import transformers

    torch.manual_seed(0)
    with torch.device(run.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(run.device)
    blocks = find_blocks(model)
    for container in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for i, child in enumerate(container):
            if any(child is block for block in blocks):
                container[i] = Recomputed(child)
    model.train()
    seconds = []
    for _ in range(run.warmup_steps + run.timed_steps):
        model.zero_grad(set_to_none=True)
        sync(run)
        start = time.perf_counter()
        for x, y in batches:
            (model(input_ids=x, labels=y).loss / len(batches)).backward()
        sync(run)
        seconds.append(time.perf_counter() - start)
    del model
    if run.device == "cuda":
        torch.cuda.empty_cache()
    return {"compute_alone_s": statistics.median(seconds[run.warmup_steps :]), "compute_alone_steps_s": seconds}


class Recomputed(torch.nn.Module):
    """A block called under non-reentrant checkpointing (its activations recomputed in backward), as
    :func:`nvoffload.vertical_step` calls each streamed block."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def adam_bound(run: Run, params: int) -> dict:
    """The CPU Adam's seconds for ``params`` parameters: the fused kernel (:func:`nvoffload.optim.kernels.adam_step`,
    all cores) over chunks of the optimizer's size in a pool of ``run.adam_pool_bytes`` (fp32 master and moments,
    bf16 gradients and new weights: 16 bytes a parameter, beyond the caches as resident state is), two sweeps timed."""
    from nvoffload.optim.kernels import adam_step

    chunk = (256 << 10) if run.dry else (4 << 20)  # elements: the optimizer's largest chunk on the GPU machine
    pool = [
        (torch.full((chunk,), 0.5), torch.full((chunk,), 0.01, dtype=torch.bfloat16), torch.zeros(chunk), torch.zeros(chunk),
         torch.empty(chunk, dtype=torch.bfloat16))
        for _ in range(max(1, run.adam_pool_bytes // (16 * chunk)))
    ]  # fmt: skip

    def sweep(step: int) -> None:
        for p, g, m, v, out in pool:
            adam_step(p, g, m, v, step=step, lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, param_out=out)

    sweep(1)
    start = time.perf_counter()
    sweep(2)
    sweep(3)
    per_param = (time.perf_counter() - start) / (2 * len(pool) * chunk)
    return {"adam_s": per_param * params, "adam_params_per_s": 1 / per_param, "adam_pool_bytes": 16 * chunk * len(pool)}


def copies_bound(sizes: Sizes, profile) -> dict:
    """The step's host<->device copies at the copy rates calibrated in this run: each block's weights to the
    device twice (forward, backward), the parameters outside the blocks' new weights once; every gradient (bf16)
    to the host once (the vertical schedule). One after the other, as the planner counts them."""
    blocks = sum(sizes.block_bytes)
    h2d, d2h = 2 * blocks + (sizes.weight_bytes - blocks), sizes.weight_bytes
    return {"copies_h2d_bytes": h2d, "copies_d2h_bytes": d2h,
            "copies_s": h2d / (profile.h2d_gbps * 1e9) + d2h / (profile.d2h_gbps * 1e9)}  # fmt: skip


def planned(run: Run, config, case: dict, profile) -> dict:
    """The planner's step (:func:`nvoffload.planner.plan`) for the case's shape and budgets on ``profile``."""
    with tempfile.TemporaryDirectory() as d:
        config.to_json_file(os.path.join(d, "config.json"))
        shape = ModelShape.from_hf_config(d)
    request = PlanRequest(
        model=shape, batch_size=1, seq_len=run.seq_len, grad_accum_steps=run.micro_batches, dtype="bfloat16",
        cpu_memory_bytes=case["cpu_memory_bytes"], device_memory_bytes=run.device_memory_bytes, swap_dirs=1,
        stream=True, activations="keep", optimizer_memory_fraction=case["optimizer_memory_fraction"], vertical=True,
    )  # fmt: skip
    chosen = plan(request, profile)
    fields = ("step_s", "tokens_per_s", "tflops", "bottleneck", "engine_s", "phases_s", "fits", "reasons",
              "nvme_read_bytes", "nvme_written_bytes", "resident_state_bytes", "memory_bytes")  # fmt: skip
    return {"shape_params": shape.params, **{k: getattr(chosen, k) for k in fields}}


# -- the cases ---------------------------------------------------------------------------


@dataclass
class Context:
    """What the cases share: the run, its record and budget, the profile calibrated, and what the RAM case measured
    that the NVMe case reuses (``shared``: the model's sizes, compute alone, the CPU Adam)."""

    run: Run
    results: Results
    budget: Budget
    profile: object = None  # a MachineProfile once calibrated (or given by --profile)
    shared: dict | None = None


def calibrate_case(ctx: Context, case: dict) -> None:
    """The machine's profile, measured through nvoffload's own code beside the swap directory."""
    from nvoffload.planner.calibrate import calibrate

    with tempfile.TemporaryDirectory(dir=ctx.run.swap_dir, prefix="gpu_scale-") as swap:
        ctx.profile = calibrate([swap], device=ctx.run.device, quick=ctx.run.dry, log=lambda line: print(line, flush=True))
    ctx.results.record["profile"] = asdict(ctx.profile)
    p = ctx.profile
    case["summary"] = (
        f"copies h2d {p.h2d_gbps:.1f} GB/s, d2h {p.d2h_gbps:.1f} GB/s; swap directory write {p.drives[0].write_gbps:.2f}"
        f" GB/s, read {p.drives[0].read_gbps:.2f} GB/s; CPU Adam {p.adam_params_per_s['bfloat16'] / 1e6:.0f} M params/s"
        f" (bf16 gradients, 4 Mi-element arrays); matmul {p.matmul_tflops:.3g} TFLOP/s"
    )


def ram_case(ctx: Context, case: dict) -> None:
    """The whole optimizer state resident in host memory: the streamed step, its bound, the planner."""

    spans = []

    def trace_one(opt, batches) -> None:
        case["traced_step_s"], recorded = traced_step(ctx.run, opt, batches, ctx.results.directory)
        case["traced_busy_s"] = busy_s(recorded)
        spans.extend(recorded)

    sizes, config = streamed(ctx, case, Sizes.resident_for_ram, ctx.run.layers, trace_one)
    parts = alone(ctx, case, sizes, config)
    finish(ctx, case, sizes, config, parts)
    plot_timeline(ctx.results.directory / "gpu_scale.png", spans, case, "RAM case")


def nvme_case(ctx: Context, case: dict) -> None:
    """``run.nvme_state_bytes`` of the optimizer state in the store: the streamed step against max(compute alone,
    its NVMe bytes at the calibrated rates, the copies, the CPU Adam), and the planner."""
    measured = ctx.shared.get("sizes")

    def store_used(opt, batches) -> None:
        case["store_used_bytes"] = opt.session.memory_stats()["nvme"].used_bytes

    layers = ctx.run.layers or (measured.layers if measured is not None else None)
    sizes, config = streamed(ctx, case, Sizes.resident_for_nvme, layers, store_used)
    parts = alone(ctx, case, sizes, config)
    if ctx.profile is not None:
        drive = ctx.profile.drives[0]
        case["nvme_s"] = case["nvme_read_bytes"] / (drive.read_gbps * 1e9) + case["nvme_written_bytes"] / (drive.write_gbps * 1e9)
        parts["NVMe (reads then writes, one drive)"] = case["nvme_s"]
    finish(ctx, case, sizes, config, parts)


def streamed(ctx: Context, case: dict, resident, layers: int | None, then) -> tuple[Sizes, object]:
    """The model initialized (:func:`open_streamed`), its timed steps, then ``then(optimizer, micro_batches)`` with
    the session still open; closed. Returns the model's sizes and configuration."""
    run = ctx.run
    with tempfile.TemporaryDirectory(dir=run.swap_dir, prefix="gpu_scale-") as swap:
        model, opt, sizes = open_streamed(run, case, resident, swap, layers)
        ctx.results.write()
        batches = micro_batches(run, model.config.vocab_size)
        try:
            timed_steps(run, opt, batches, case, ctx.results, ctx.budget)
            then(opt, batches)
        finally:
            opt.close()
    return sizes, model.config


def alone(ctx: Context, case: dict, sizes: Sizes, config) -> dict[str, float]:
    """The step's parts measured alone: compute alone and the CPU Adam (measured once for a model, the first case
    that runs it), the copies (at the calibrated rates); the case gets them."""
    run = ctx.run
    if ctx.shared.get("sizes") != sizes:
        batches = micro_batches(run, config.vocab_size)
        ctx.shared.update(sizes=sizes, **compute_alone(run, config, batches), **adam_bound(run, sizes.params))
    case.update({k: ctx.shared[k] for k in ("compute_alone_s", "compute_alone_steps_s", "adam_s", "adam_params_per_s")})
    parts = {"compute alone": case["compute_alone_s"], "CPU Adam": case["adam_s"]}
    if ctx.profile is not None:
        case.update(copies_bound(sizes, ctx.profile))
        parts["copies"] = case["copies_s"]
    return parts


def finish(ctx: Context, case: dict, sizes: Sizes, config, parts: dict[str, float]) -> None:
    """The case's throughput, its step against the largest of ``parts`` (its bound), the planner's step; a summary."""
    run = ctx.run
    flops = sizes.flops_per_token(config, run.seq_len) * run.tokens_per_step
    ctx.results.record["flops_formula"] = sizes.flops_formula(config, run.seq_len)
    case.update(
        tokens_per_step=run.tokens_per_step, tokens_per_s=run.tokens_per_step / case["step_s"],
        model_tflops=flops / case["step_s"] / 1e12, compute_alone_model_tflops=flops / case["compute_alone_s"] / 1e12,
        bound_parts_s=parts, bound_by=max(parts, key=parts.get), bound_s=max(parts.values()),
    )  # fmt: skip
    case["step_vs_bound"] = case["step_s"] / case["bound_s"]
    if ctx.profile is not None:
        case["planned"] = planned(run, config, case, ctx.profile)
        case["planned_step_s"] = case["planned"]["step_s"]
        case["planned_vs_measured"] = case["planned_step_s"] / case["step_s"]
    store = case["state_in_store_bytes"]
    where = (f"{store / 1e9:.3g} GB of optimizer state in the store (a generation read and one written each step; twice"
             " that at the step's peak)" if store else "all optimizer state in host memory")  # fmt: skip
    case["summary"] = (
        f"{run.model} with {sizes.layers} of its {LLAMA[run.model]['num_hidden_layers']} layers ({sizes.params / 1e9:.3g}B"
        f" parameters), exact AdamW, {where}, {run.micro_batches} x {run.seq_len} tokens a step: {case['step_s']:.3f} s,"
        f" {case['tokens_per_s']:.0f} tokens/s, {case['model_tflops']:.1f} model TFLOP/s; {case['step_vs_bound']:.2f}x its bound"
        f" ({case['bound_by']}, {case['bound_s']:.3f} s; " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()) + ")"
        + (f"; the planner {case['planned_step_s']:.3f} s ({case['planned_vs_measured']:.2f}x the step)" if "planned" in case else "; no planner prediction: no profile")
        + (f"; {len(case['refused'])} larger layer counts refused (for host memory, or by initialize's free-space check:"
           f" the case's 'refused')" if case.get("refused") else "")
    )  # fmt: skip


def plot_timeline(path: Path, spans: list, case: dict, what: str) -> None:
    """The traced step's timeline (every block's compute, each copy, NVMe read and write, each Adam chunk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = (f"{what}, one traced step: {case['traced_step_s']:.3f} s (median of the timed: {case['step_s']:.3f} s);"
             f" bound {case['bound_s']:.3f} s ({case['bound_by']})")  # fmt: skip
    fig = plot_trace(plt, spans, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def overlap_case(ctx: Context, case: dict) -> None:
    """``bench/bench_overlap.py`` (its defaults are the H100 run's sizes), unprofiled: streamed against compute alone."""
    import bench_overlap

    with tempfile.TemporaryDirectory() as d:
        out = bench_overlap.main([*ctx.run.overlap_args, "--device", ctx.run.device, "--results-dir", d])
        case["settings"] = json.loads((Path(d) / "bench_overlap.json").read_text())["settings"]
        shutil.copy(Path(d) / "bench_overlap.png", ctx.results.directory / "gpu_scale_overlap.png")
    seconds = {row["case"]: row["seconds"] for row in out["rows"]}
    case.update(seconds=seconds, ratios=out["ratios"], step_s=seconds["streamed"], bound_s=seconds["compute"],
                bound_by="compute alone", step_vs_bound=seconds["streamed"] / seconds["compute"])  # fmt: skip
    s = case["settings"]
    case["summary"] = (
        f"bench_overlap, {s['layers']} blocks of d_model {s['d_model']}, batch {s['batch']} x {s['seq_len']}, median of"
        f" {s['repeats']}: streamed {seconds['streamed'] * 1e3:.2f} ms against compute alone {seconds['compute'] * 1e3:.2f} ms"
        f" ({case['step_vs_bound']:.2f}x), copies alone {seconds['copies'] * 1e3:.2f} ms"
    )


def gds_case(ctx: Context, case: dict) -> None:
    """GPUDirect Storage: kvikio and cuFile's mode, the ``gds``-marked tests, the store's two paths."""
    env = ctx.results.record["environment"]
    case.update(kvikio=env["kvikio"], kvikio_compat_mode=env["kvikio_compat_mode"])
    t = case["tests"] = gds_tests(ctx.results.directory, timeout_s=max(10.0, min(120.0, ctx.budget.left() - 30)))
    ctx.results.write()
    paths = case["paths"] = {}  # filled path by path: one that fails leaves those before it
    store_paths(ctx.run, paths)
    moved = "; ".join(
        f"{name}: " + (p["skipped"] if "skipped" in p else f"write {p['write_gbps']:.2f} GB/s, read {p['read_gbps']:.2f} GB/s")
        for name, p in paths.items()
    )  # fmt: skip
    case["summary"] = (
        f"kvikio {case['kvikio'] or 'not installed'}, compatibility mode {case['kvikio_compat_mode']}; gds tests:"
        f" {t['passed']} passed, {t['skipped']} skipped{' (' + '; '.join(t['skip_reasons']) + ')' if t['skip_reasons'] else ''},"
        f" {t['failed']} failed; {moved}"
    )
    if t["failed"] or t["timed_out"] or not all(p.get("equal", True) for p in paths.values()):
        raise RuntimeError(f"{t['failed']} gds test(s) failed{' (timed out)' if t['timed_out'] else ''}, or a path read"
                           " back other bytes than it wrote (see tests, paths)")  # fmt: skip


def gds_tests(results_dir: Path, timeout_s: float) -> dict:
    """``pytest -m gds`` over the test files that mark tests ``gds``, junit XML as ``gds_tests.xml``: the counts and
    the reasons of the skips."""
    files = [str(f) for f in sorted((REPO / "tests").glob("test_*.py")) if "mark.gds" in f.read_text()]
    xml = results_dir / "gds_tests.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gds", f"--junitxml={xml}", *files]
    try:
        ran = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        status, output = ran.returncode, ran.stdout + ran.stderr
    except subprocess.TimeoutExpired as exc:
        status, output = None, f"timed out after {timeout_s:.0f} s: {exc.stdout or ''}"
    cases = list(ET.parse(xml).getroot().iter("testcase")) if xml.exists() else []
    skips = [s.get("message", "") for c in cases for s in c.findall("skipped")]
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    return {
        "exit_status": status, "timed_out": status is None, "files": [Path(f).name for f in files],
        "collected": len(cases), "passed": len(cases) - failed - len(skips), "failed": failed, "skipped": len(skips),
        "skip_reasons": sorted(set(skips)), "output_tail": str(output)[-3000:],
    }  # fmt: skip


def store_paths(run: Run, paths: dict) -> None:
    """The same bytes saved from and loaded into device memory through a store without checksums, by the transfer
    engine: through its bounce buffer (``IOConfig(use_gds=False)``), and by GPUDirect Storage where the engine takes
    that path (kvikio installed, not in compatibility mode); beside them, kvikio's own file I/O in whatever mode it
    runs (with CUDA and kvikio). Into ``paths``, as each is measured: GB/s each way, and whether the bytes came back."""
    from nvoffload.io import IOConfig, TensorStore
    from nvoffload.transfer import TransferEngine

    nbytes = min(256 * MiB, run.gds_bytes)
    count = max(1, run.gds_bytes // nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).to(run.device)
    with TransferEngine(nbytes + PAGE, run.device, what="the GDS comparison's bounce buffer") as engine:
        staging = engine.slab.allocate(nbytes, "the bounce buffer")
        for name, use_gds in (("bounce buffer", False), ("GPUDirect Storage", True)):
            with tempfile.TemporaryDirectory(dir=run.swap_dir, prefix="gpu_scale-") as d:
                with TensorStore(d, config=IOConfig(use_gds=use_gds), checksum=False) as store:
                    if use_gds and not engine.direct(store, src):
                        paths[name] = {"skipped": f"not taken: {why_no_gds(run)}"}
                        continue
                    save = lambda i: engine.save(store, f"t{i}", src, staging).result()  # noqa: E731
                    load = lambda i, dst: engine.load(store, f"t{i}", dst, staging).result()  # noqa: E731
                    paths[name] = timed_round_trip(run, src, count, save, load)
        engine.slab.free(staging)
    if run.device == "cuda" and importlib.util.find_spec("kvikio") is not None:
        paths["kvikio file I/O"] = kvikio_round_trip(run, src, count)


def timed_round_trip(run: Run, src: torch.Tensor, count: int, save, load) -> dict:
    """``save(i)`` of ``count`` copies of ``src``, then ``load(i, dst)`` of each, one at a time (each returns once its
    transfer is done: one bounce buffer); GB/s each way and whether the last copy read equals ``src``."""
    dst = torch.empty_like(src)
    sync(run)
    start = time.perf_counter()
    for i in range(count):
        save(i)
    middle = time.perf_counter()
    for i in range(count):
        load(i, dst)
    sync(run)
    end = time.perf_counter()
    total = count * src.numel()
    return {"bytes": total, "write_gbps": total / (middle - start) / 1e9, "read_gbps": total / (end - middle) / 1e9,
            "equal": bool(torch.equal(dst, src))}  # fmt: skip


def kvikio_round_trip(run: Run, src: torch.Tensor, count: int) -> dict:
    """kvikio's ``CuFile`` (through :class:`nvoffload.transfer.gds.GDSFile`) writing and reading ``src`` directly,
    in the mode kvikio runs in: what the store would get from it."""
    import kvikio

    from nvoffload.transfer import gds

    with tempfile.TemporaryDirectory(dir=run.swap_dir, prefix="gpu_scale-") as d:
        path = os.path.join(d, "kvikio.bin")
        open(path, "wb").close()
        file = gds.GDSFile(path)
        try:

            def moved(i: int, buffer: torch.Tensor, write: bool) -> None:
                ticket = file.submit(buffer, i * buffer.numel(), write=write)
                ticket.wait()
                if ticket.error() is not None:
                    code, call, offset = ticket.error()
                    raise OSError(code, f"kvikio {call} at offset {offset} of {path} failed")

            result = timed_round_trip(run, src, count, lambda i: moved(i, src, True), lambda i, dst: moved(i, dst, False))
        finally:
            file.close()
    return {**result, "compat_mode": gds.compat_mode(kvikio)}


def why_no_gds(run: Run) -> str:
    """Why the transfer engine does not take the GPUDirect Storage path here."""
    if run.device != "cuda":
        return "needs CUDA and kvikio (the CPU stand-in moves device memory through the bounce buffer)"
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed (carry its wheels: bench/results/gpu_scale/README.md)"
    import kvikio

    from nvoffload.transfer import gds

    if gds.compat_mode(kvikio):
        return ("kvikio runs cuFile in compatibility mode (POSIX I/O through its own bounce buffer), where the engine"
                " keeps its own path (nvoffload/transfer/gds.py)")  # fmt: skip
    return "the engine refused it (TransferEngine.direct): see nvoffload/transfer/engine.py"


# -- the run -----------------------------------------------------------------------------


CASE_BODIES = {"ram": ram_case, "overlap": overlap_case, "gds": gds_case, "nvme": nvme_case}


def need_s(ctx: Context, name: str) -> float:
    """Seconds a case needs at least to be started: ``NEED_S`` (a tenth in the dry run); for the NVMe case on the
    GPU with a profile, the planner's steps and the state's first write at the calibrated rates."""
    run, sizes = ctx.run, ctx.shared.get("sizes")
    if run.dry:
        return NEED_S[name] / 10
    if name != "nvme" or ctx.profile is None or sizes is None:
        return NEED_S[name]
    case = dict(zip(("cpu_memory_bytes", "optimizer_memory_fraction"), sizes.host_budget(run, Sizes.resident_for_nvme(sizes, run))))
    step_s = planned(run, llama_config(run, sizes.layers), case, ctx.profile)["step_s"]
    first_write_s = (sizes.weight_bytes + run.nvme_state_bytes / 2) / (ctx.profile.drives[0].write_gbps * 1e9)
    return 20 + first_write_s + 1.2 * (run.warmup_steps + run.timed_steps) * step_s


def load_given_profile(path: str):
    """A profile JSON (``nvoffload calibrate``'s), or the ``profile`` of an earlier run's ``gpu_scale.json``."""
    from nvoffload.planner import MachineProfile

    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return MachineProfile(**raw["profile"]) if "profile" in raw and "benchmark" in raw else load_profile(path)


def main(argv=None) -> int:
    args, run = parse_args(argv)
    threads = torch.get_num_threads()
    if run.dry:  # the stand-in computes on the training thread; the suite's machine is small and shared
        torch.set_num_threads(1)
    try:
        return run_all(args, run)
    finally:
        torch.set_num_threads(threads)


def run_all(args: argparse.Namespace, run: Run) -> int:
    """Calibrate (unless ``--profile``), then each case asked for, in :data:`CASES` order; 1 if any case failed."""
    budget = Budget(args.budget_s)
    env = environment(run)
    record = {
        "benchmark": "gpu_scale", "dry": run.dry, "machine": machine_info(), "environment": env,
        "settings": {**asdict(run), "budget_s": args.budget_s, "cases": args.cases}, "cases": {},
    }  # fmt: skip
    results = Results(args.results_dir or BENCH / "results" / "gpu_scale" / slug(env["device_name"]), record)
    ctx = Context(run, results, budget, shared={})
    print(f"gpu_scale: on {env['device_name']}, results in {results.directory}, {args.budget_s:.0f} s", flush=True)
    if args.profile is not None:
        ctx.profile = load_given_profile(args.profile)
        record["profile"] = asdict(ctx.profile)
    else:
        results.run_case("calibrate", NEED_S["calibrate"] / (10 if run.dry else 1), budget, lambda case: calibrate_case(ctx, case))
    for name in (c for c in CASES if c in args.cases):
        results.run_case(name, need_s(ctx, name), budget, lambda case, name=name: CASE_BODIES[name](ctx, case))
    print(summary_markdown(record), flush=True)
    return 1 if any(case["status"] == "failed" for case in record["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
