"""Training checkpoints: ``save_training_checkpoint`` / ``load_training_checkpoint`` beside ``torch.save`` /
``torch.load`` of the same state, and the drive's write bandwidth (fio), in one run.

The model's weights stay in memory and its AdamW state (fp32 moments) lies on NVMe, as ``NVMeAdamW`` keeps it.
Each case saves, then loads, the same training state to the same directory:

- ``nvoffload``: :func:`nvoffload.save_training_checkpoint` (the weights one tensor at a time, the
  optimizer state streamed from the store chunk by chunk into safetensors shards, every tensor
  CRC-32C'd, fsynced, atomic) and :func:`nvoffload.load_training_checkpoint` (checked as it loads);
- ``torch.save``: what a script written for ``torch.optim`` does: ``torch.save({"model": ...,
  "optimizer": optimizer.state_dict()})`` (the NVMe state gathered in memory first), fsynced, then
  ``torch.load`` and ``load_state_dict``;
- ``fio``: sequential writes and reads of the same bytes with O_DIRECT (the limit; skipped when fio is not
  installed).

It reports GB/s of checkpoint bytes and the process's resident memory above its level before the save
(sampled every 5 ms: the plot is that timeline). Runs are interleaved ``--repeats`` times; the median is shown.

With ``--background`` (and in ``--quick``) it also measures a background checkpoint of a streamed model with its
weights and state on NVMe (``bench/checkpoint_background.py``): the steps' rate beside it against without it,
its write rate against the disk's copy rate of the same bytes (same run), and ``--kills`` SIGKILLs at random
moments of background checkpoints, each leaving the previous one loadable, the resume bit-identical.

    python bench/bench_checkpoint.py                  # GPT-2 124M: ~1.5 GB per checkpoint
    python bench/bench_checkpoint.py --quick          # the tiny preset: a smoke run
    python bench/bench_checkpoint.py --repeats 1 --background --background-preset gpt2-1.3b --kills 10 \
        --cpu-memory 6G --dir /work/bench-tmp         # 1.3B parameters: 18 GB a checkpoint, ~72 GB of disk
    python bench/bench_checkpoint.py --repeats 1 --background --cpu-memory 6G --steps 2 \
        --bg-state-precision bf16-moments --kills 10  # bench/results/bench_checkpoint_background_1.3b_1024*: ~60 GB

A step of the background run takes one sequence of its preset's length (1024 tokens at 1.3B) unless ``--tokens``
says otherwise: with a few tokens a step the steps are bound by the drive the checkpoint writes to (see
docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import fio_bandwidth  # noqa: E402
from checkpoint_background import run as background_run  # noqa: E402
from report import RESULTS_DIR, save_report  # noqa: E402

import nvoffload  # noqa: E402
from nvoffload.models import GPT, GPTConfig  # noqa: E402
from nvoffload.optim import NVMeAdamW  # noqa: E402

GB = 1e9


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssTimeline:
    """The resident memory above its level at the start, every ``period_s``, in a thread."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()

    def __enter__(self) -> RssTimeline:
        self._base, self._start = _rss_bytes(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._start, _rss_bytes() - self._base))
            self._stop.wait(self.period_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.samples), default=0)


def _fsync_tree(path: Path) -> None:
    for parent, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _drop_cache(path: Path) -> None:
    for parent, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(p, n)) for p, _, names in os.walk(path) for n in names)


def nvoffload_case(model, opt, directory: Path):
    def save():
        nvoffload.save_training_checkpoint(directory, step=1, model=model, optimizer=opt, keep_last=1)

    def load():
        nvoffload.load_training_checkpoint(directory, model=model, optimizer=opt)

    return save, load


def torch_case(model, opt, directory: Path):
    path = directory / "checkpoint.pt"

    def save():
        directory.mkdir(exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        _fsync_tree(directory)

    def load():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    return save, load


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-124m", help="the GPT preset (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the swap file and checkpoints go (default: under /tmp)")
    p.add_argument("--quick", action="store_true", help="the tiny preset, one repeat: the smoke run")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="bench_checkpoint", help="of the results files (default %(default)s)")
    p.add_argument("--background", action="store_true", help="also measure a background checkpoint (see above)")
    p.add_argument("--background-preset", dest="bg_preset", default="gpt2-1.3b", help="its model (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="steps timed without a checkpoint (default %(default)s)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens a step of the background run (default: one sequence of its preset's length)")
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs during background checkpoints (default %(default)s)")
    p.add_argument("--cpu-memory", dest="cpu_memory", default="2G", help="the streamed run's host budget (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="of the kills' moments")
    p.add_argument("--bg-state-precision", dest="state_precision", default="fp32", choices=("fp32", "bf16-moments"),
                   help="its optimizer state (default %(default)s: exact AdamW)")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.repeats, args.background, args.bg_preset, args.kills = "tiny", 1, True, "small", 2
        args.cpu_memory = "64M"
    try:
        seq_len = GPTConfig.preset(args.bg_preset).seq_len
    except ValueError as exc:
        p.error(f"--background-preset: {exc}")
    args.tokens = seq_len if args.tokens is None else args.tokens
    if not 0 < args.tokens <= seq_len:
        p.error(f"--tokens: {args.bg_preset} takes 1 to {seq_len} tokens a step, got {args.tokens}")
    args.cpu_memory_bytes = _size(args.cpu_memory)
    return args


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main(argv=None) -> Path:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir or "/tmp"))
    try:
        (root / "swap").mkdir()
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset(args.preset))
        opt = NVMeAdamW(model.parameters(), lr=1e-4, swap_dir=str(root / "swap"), cpu_memory_bytes=256 << 20)
        x = torch.randint(0, model.config.vocab_size, (1, 32))
        model(x, x).backward()  # one step: the optimizer has state to save
        opt.step()
        opt.zero_grad()
        cases = {"nvoffload": nvoffload_case, "torch.save": torch_case}
        runs: dict[str, list[dict]] = {name: [] for name in cases}
        timelines: dict[str, list[tuple[float, int]]] = {}
        nbytes = 0
        for _ in range(args.repeats):
            for name, case in cases.items():
                directory = root / name
                save, load = case(model, opt, directory)
                with RssTimeline() as saving:
                    start = time.perf_counter()
                    save()
                    save_s = time.perf_counter() - start
                nbytes = _tree_bytes(directory)
                _drop_cache(directory)
                with RssTimeline() as loading:
                    start = time.perf_counter()
                    load()
                    load_s = time.perf_counter() - start
                runs[name].append(
                    {"bytes": nbytes, "save_s": save_s, "load_s": load_s, "save_rss": saving.peak_bytes,
                     "load_rss": loading.peak_bytes}
                )  # fmt: skip
                timelines[name] = saving.samples + [(t + save_s, b) for t, b in loading.samples]
                shutil.rmtree(directory)
        opt.close()
        fio = None
        if shutil.which("fio"):
            fio = (fio_bandwidth([root], nbytes, "write"), fio_bandwidth([root], nbytes, "read"))
        background = None
        if args.background:
            (root / "background").mkdir()
            background = background_run(argparse.Namespace(**{**vars(args), "preset": args.bg_preset}), root / "background")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for name, results in runs.items():
        size = statistics.median(r["bytes"] for r in results)
        save_s = statistics.median(r["save_s"] for r in results)
        load_s = statistics.median(r["load_s"] for r in results)
        rows.append(
            {"case": name, "GB": size / GB, "save_s": save_s, "save_GBps": size / save_s / GB,
             "load_s": load_s, "load_GBps": size / load_s / GB,
             "save_peak_rss_GB": max(r["save_rss"] for r in results) / GB,
             "load_peak_rss_GB": max(r["load_rss"] for r in results) / GB}
        )  # fmt: skip
    if fio is not None:
        rows.append({"case": "fio (limit)", "GB": nbytes / GB, "save_s": nbytes / fio[0], "save_GBps": fio[0] / GB,
                     "load_s": nbytes / fio[1], "load_GBps": fio[1] / GB, "save_peak_rss_GB": 0.0,
                     "load_peak_rss_GB": 0.0})  # fmt: skip
    for row in rows:
        row["save_vs_fio"] = row["save_GBps"] / rows[-1]["save_GBps"] if fio is not None else float("nan")

    def plot(plt):
        fig, axes = plt.subplots(2 if background else 1, 1, figsize=(9, 7 if background else 4), squeeze=False)
        ax = axes[0][0]
        for name, samples in timelines.items():
            ax.plot([t for t, _ in samples], [b / GB for _, b in samples], label=name)
        ax.set_xlabel("seconds (save, then load)")
        ax.set_ylabel("resident memory above start (GB)")
        ax.set_title(f"training checkpoint of {args.preset}: memory while saving and loading (last repeat)")
        ax.legend()
        if background:
            _plot_timeline(axes[1][0], background, args)
        fig.tight_layout()
        return fig

    notes = (
        f"{args.preset}: weights in memory, AdamW state on NVMe (NVMeAdamW). Median of {args.repeats} interleaved"
        " runs; page cache of the checkpoint dropped (fadvise) before each load. nvoffload's includes the CRC-32C"
        " of every tensor (written and checked) and the fsyncs; torch.save's includes an fsync."
    )
    if background is not None:
        notes += (
            f" Background checkpoint of a streamed {args.bg_preset} ({background['params'] / 1e6:.0f}M parameters,"
            f" weights and {args.state_precision} AdamW state on NVMe, {args.tokens} tokens a step): steps at"
            f" {background['steps_rate_vs_alone']:.2f}x their rate beside it ({background['steps_beside']} step(s);"
            f" at least {background['steps_rate_while_written']:.2f}x while it was written);"
            f" {background['checkpoint_GB']:.2f} GB of weights and state at {background['checkpoint_GBps']:.2f} GB/s,"
            f" {background['checkpoint_vs_copy']:.2f}x the disk's copy rate ({background['copy_GBps']:.2f} GB/s);"
            f" {background['kills']} kills, resume bit-identical: {background['resume_bit_identical']}. Training waited"
            f" {background['training_waited_s']:.1f} s at its start (the weights and the state held;"
            " counted in the steps beside it)."
            f" Load average (2 cores, shared) {background['load_average'][0]:.1f} before,"
            f" {background['load_average'][1]:.1f} after the measurement."
        )
        demand = background["drive_demand"]
        if demand is not None:
            notes += (
                f" The drive (its own counters): a step alone moves {demand['step_GB']:.1f} GB"
                f" ({demand['step_GBps']:.2f} GB/s), the checkpoint {demand['checkpoint_GB']:.1f} GB of reads and"
                f" writes; the steps at 0.7x of their rate would ask {demand['steps_at_0.7x_GBps']:.2f} GB/s of it and"
                f" the checkpoint at 0.8x of the copy rate {demand['checkpoint_at_0.8x_GBps']:.2f} GB/s:"
                f" {demand['demand_vs_drive']:.2f}x the {demand['drive_GBps']:.2f} GB/s it moves kept busy by the copy"
                f" ({demand['demand_vs_drive_writes_only']:.2f}x with the checkpoint's writes only)."
            )
    return save_report(
        args.name, rows, settings={"preset": args.preset, "repeats": args.repeats}, plot_column="save_GBps",
        notes=notes, results_dir=args.results_dir, extra={"timelines": timelines, "background": background}, plot=plot,
    )  # fmt: skip


_COLORS = {"warm-up step": "0.8", "step": "tab:blue", "training waits": "tab:red", "step beside": "tab:orange",
           "checkpoint written": "tab:green", "disk copy of the same bytes": "tab:purple"}  # fmt: skip


def _plot_timeline(ax, background: dict, args) -> None:
    """The background checkpoint's measurement as bars in time: the steps alone, the training's wait at its
    start, the steps beside it, its write, and the disk's copy of the same bytes."""
    rows = list(_COLORS)
    for what, start, end in background["timeline"]:
        ax.barh(rows.index(what), end - start, left=start, color=_COLORS[what], edgecolor="black", linewidth=0.5)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(
        f"background checkpoint, {args.bg_preset}, {background['checkpoint_GB']:.1f} GB: "
        f"{background['checkpoint_vs_copy']:.2f}x the copy rate, steps {background['steps_rate_vs_alone']:.2f}x"
    )


if __name__ == "__main__":
    main()
