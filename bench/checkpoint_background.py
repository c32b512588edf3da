"""The background checkpoint's measurement for bench/bench_checkpoint.py (``--background``): a streamed GPT with
its weights and AdamW state on NVMe, in one run:

- the steps' rate without a checkpoint, and beside a background one (:func:`nvoffload.start_training_checkpoint`);
- the checkpoint's write rate (its tensors' bytes, the weights' and the optimizer state's, over the time its
  thread took) against the disk's copy rate of the same bytes measured in the same run (the swap file's first
  bytes read and written to the checkpoint directory's drive by the native I/O threads, O_DIRECT, 4 x 64 MiB in
  flight);
- ``kills`` SIGKILLs of a child process at random moments of a background checkpoint: after each, the latest
  checkpoint verifies; then a child resumes from it and takes one step, whose weights must equal the
  uninterrupted run's at that step (a SHA-256 of the state dict);
- the drive's own counters (``/sys/dev/block/<dev>/stat``) over the steps alone, over the checkpoint and the
  steps beside it, and over the copy: the bytes it read and wrote and the time it was busy, so that what the
  steps and the checkpoint ask of the drive can be set against what it moved.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import nvoffload
from nvoffload.core.buffers import aligned_empty
from nvoffload.io import IOEngine
from nvoffload.models import GPT, GPTConfig
from nvoffload.training_checkpoint import latest_training_checkpoint, verify_training_checkpoint

GB = 1e9


def build(preset: str, swap: Path, cpu_memory_bytes: int, state_precision: str):
    """The streamed bf16 model (on the CPU standing in for the device) and its optimizer, seeded."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(preset)).to(torch.bfloat16)
    config = nvoffload.OffloadConfig(
        swap_dirs=[str(swap)], cpu_memory_bytes=cpu_memory_bytes, device_memory_bytes=cpu_memory_bytes, device="cpu",
        state_precision=state_precision,
    )  # fmt: skip
    return nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), config, param_init_fn=model.init_weights
    )  # fmt: skip


def train_step(model, opt, step: int, tokens: int) -> None:
    """Step ``step`` (1-based) on its own batch (seeded by the step: the same in every process)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, model.config.vocab_size, (1, tokens), generator=g)
    model(x, x.roll(-1, dims=1)).backward()
    opt.step()
    opt.zero_grad()


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def copy_rate(source: str, directory: Path, nbytes: int, block_bytes: int = 64 << 20, depth: int = 4) -> float:
    """Bytes a second of copying ``nbytes`` of ``source`` (read again from its start where it is shorter) to a new
    file in ``directory`` by the native I/O threads (O_DIRECT reads and writes, ``depth`` blocks in flight),
    fsynced; the copy is removed."""
    size = os.path.getsize(source) // 4096 * 4096
    block_bytes = min(block_bytes, size)
    size = size // block_bytes * block_bytes
    nbytes = max(block_bytes, nbytes // block_bytes * block_bytes)
    target = directory / ".copy-rate"
    buffers = [aligned_empty(block_bytes) for _ in range(depth)]
    with IOEngine() as engine:
        src, dst = engine.open(source), engine.open(target, create=True)
        engine.allocate(dst, 0, nbytes)
        start = time.perf_counter()
        writes: list = [None] * depth
        for i, offset in enumerate(range(0, nbytes, block_bytes)):
            if writes[i % depth] is not None:
                writes[i % depth].result()
            engine.pread(src, buffers[i % depth], offset % size).result()
            writes[i % depth] = engine.pwrite(dst, buffers[i % depth], offset)
        for w in writes:
            if w is not None:
                w.result()
        os.fsync(dst.fd)
        seconds = time.perf_counter() - start
        engine.close_file(src)
        engine.close_file(dst)
    target.unlink()
    return nbytes / seconds


class DriveCounters:
    """The block device holding ``path``: what it did since a :meth:`mark` (``/sys/dev/block/<major>:<minor>/stat``;
    None where the system has no such file)."""

    def __init__(self, path: Path):
        dev = os.stat(path).st_dev
        self._stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")

    def _read(self) -> tuple[int, int, int] | None:
        try:
            fields = [int(f) for f in self._stat.read_text().split()]
        except (OSError, ValueError):
            return None
        return fields[2] * 512, fields[6] * 512, fields[9]  # sectors read, sectors written, io_ticks (ms)

    def mark(self) -> tuple:
        return self._read(), time.monotonic()

    def since(self, mark: tuple) -> dict | None:
        """The GB it read and wrote since ``mark``, over how many seconds, its GB a second of both, and the share
        of the time it had a request in flight."""
        before, after, seconds = mark[0], self._read(), time.monotonic() - mark[1]
        if before is None or after is None:
            return None
        read, written, busy_ms = (b - a for a, b in zip(before, after))
        return {"read_GB": read / GB, "written_GB": written / GB, "seconds": seconds,
                "GBps": (read + written) / seconds / GB, "busy": busy_ms / 1e3 / seconds}  # fmt: skip


def measure(args, root: Path) -> dict:
    """Steps with and without a background checkpoint, its rate against the disk's copy rate, in one run; the
    timeline of it all (``(what, start_s, end_s)``, seconds from the first step) and the load average around it."""
    swap, ckpt = root / "swap", root / "ckpt"
    swap.mkdir()
    load = [os.getloadavg()[0]]
    model, opt = build(args.preset, swap, args.cpu_memory_bytes, args.state_precision)
    digests, timeline, zero = {}, [], time.monotonic()
    drive, drive_use = DriveCounters(swap), {}

    def timed(what: str, run) -> float:
        start = time.monotonic()
        result = run()
        timeline.append((what, start - zero, time.monotonic() - zero))
        return result

    step = 0
    for _ in range(1 + args.steps):  # the first step is a warm-up
        step += 1
        if step == 2:
            counted = drive.mark()
        timed("step" if step > 1 else "warm-up step", lambda: train_step(model, opt, step, args.tokens))
        digests[step] = weights_digest(model)
    drive_use["steps alone"] = drive.since(counted)
    alone_s = sum(end - start for what, start, end in timeline if what == "step") / args.steps
    counted = drive.mark()
    start = functools.partial(nvoffload.start_training_checkpoint, ckpt, step=step, model=model, optimizer=opt, keep_last=1)
    job = timed("training waits", start)
    waited_s = timeline[-1][2] - timeline[-1][1]
    beside = []
    while not job.done() or not beside:
        step += 1
        timed("step beside", lambda: train_step(model, opt, step, args.tokens))
        beside.append(timeline[-1][2] - timeline[-1][1])
        digests[step] = weights_digest(model)
    job.wait()
    drive_use["checkpoint and steps beside"] = drive.since(counted)
    timeline.append(("checkpoint written", job.started_s - zero, job.ended_s - zero))
    shutil.rmtree(ckpt)  # room for the copy
    ckpt.mkdir()
    largest = str(max(swap.glob("*.swap"), key=lambda p: p.stat().st_size))
    counted = drive.mark()
    copy = timed("disk copy of the same bytes", lambda: copy_rate(largest, ckpt, job.nbytes))
    drive_use["copy"] = drive.since(counted)
    load.append(os.getloadavg()[0])
    beside_s = (sum(beside) + waited_s) / len(beside)
    for _ in range(args.kills + 2):  # the reference run's steps the kills' resumes may reach
        step += 1
        train_step(model, opt, step, args.tokens)
        digests[step] = weights_digest(model)
    opt.close()
    shutil.rmtree(swap)
    return {
        "params": sum(p.numel() for p in model.parameters()), "step_alone_s": alone_s, "step_beside_s": beside_s,
        "steps_rate_vs_alone": alone_s / beside_s, "steps_beside": len(beside), "training_waited_s": waited_s,
        "steps_rate_while_written": while_written(beside_s, alone_s, len(beside), job.seconds),
        "checkpoint_s": job.seconds, "checkpoint_GB": job.nbytes / GB, "checkpoint_GBps": job.nbytes / job.seconds / GB,
        "copy_GBps": copy / GB, "checkpoint_vs_copy": job.nbytes / job.seconds / copy, "digests": digests,
        "timeline": timeline, "load_average": load, "drive": drive_use,
        "drive_demand": drive_demand(drive_use, args.steps, alone_s, len(beside), job.nbytes, copy),
    }  # fmt: skip


def while_written(beside_s: float, alone_s: float, steps_beside: int, checkpoint_s: float) -> float:
    """The steps' rate while the checkpoint was written, at the least: all the time the ``steps_beside`` steps took
    above their time alone (``beside_s`` a step against ``alone_s``) counted inside its ``checkpoint_s`` seconds
    (the steps beside it may outlast it: their rate over all of them is higher)."""
    lost_s = max(0.0, (beside_s - alone_s) * steps_beside)
    return max(0.0, 1 - lost_s / checkpoint_s)


def drive_demand(
    use: dict, steps_alone: int, step_s: float, steps_beside: int, checkpoint_bytes: int, copy_Bps: float
) -> dict | None:
    """What the targets ask of the drive, from its counters: the bytes a second of a step (``step_s`` long) at 0.7x
    of its rate alone, plus the checkpoint's reads and writes spread over the time it takes at 0.8x of the copy's
    rate (``copy_Bps``), against what the drive moves kept busy by the copy alone: its reads and its writes, twice
    the copy's rate. Above 1: the drive cannot give both at once, whatever the order of the requests. The same with the checkpoint's writes only (``demand_vs_drive_writes_only``): were its reads
    those the steps make anyway."""
    if any(v is None for v in use.values()):
        return None
    alone, both = use["steps alone"], use["checkpoint and steps beside"]
    step_GB = (alone["read_GB"] + alone["written_GB"]) / steps_alone
    checkpoint_GB = both["read_GB"] + both["written_GB"] - step_GB * steps_beside  # its share of what both moved
    written_GB = both["written_GB"] - alone["written_GB"] / steps_alone * steps_beside  # the checkpoint's writes
    steps_GBps = 0.7 * step_GB / step_s
    checkpoint_s, drive_GBps = checkpoint_bytes / (0.8 * copy_Bps), 2 * copy_Bps / GB
    checkpoint_GBps = checkpoint_GB / checkpoint_s
    return {"step_GB": step_GB, "step_GBps": step_GB / step_s, "checkpoint_GB": checkpoint_GB,
            "checkpoint_written_GB": written_GB, "steps_at_0.7x_GBps": steps_GBps,
            "checkpoint_at_0.8x_GBps": checkpoint_GBps, "drive_GBps": drive_GBps,
            "demand_vs_drive": (steps_GBps + checkpoint_GBps) / drive_GBps,
            "demand_vs_drive_writes_only": (steps_GBps + written_GB / checkpoint_s) / drive_GBps}  # fmt: skip


_CHILD = """
import sys, time
sys.path.insert(0, {bench!r})
import nvoffload
from checkpoint_background import build, train_step, weights_digest
model, opt = build({preset!r}, {swap!r}, {cpu!r}, {precision!r})
done = nvoffload.load_training_checkpoint({ckpt!r}, model=model, optimizer=opt) if {resume!r} else None
step = done.step if done else 0
step += 1
train_step(model, opt, step, {tokens!r})
if {final!r}:
    print("digest", step, weights_digest(model), flush=True)
else:
    job = nvoffload.start_training_checkpoint({ckpt!r}, step=step, model=model, optimizer=opt, keep_last=1)
    print("started", time.monotonic(), flush=True)
    train_step(model, opt, step + 1, {tokens!r})  # one step beside it (two would hold a third generation on disk)
    job.wait()
    print("written", flush=True)
opt.close()
"""


def _child(args, root: Path, *, final: bool) -> subprocess.Popen:
    swap = root / "child-swap"
    shutil.rmtree(swap, ignore_errors=True)
    swap.mkdir()
    script = _CHILD.format(
        bench=str(Path(__file__).parent), preset=args.preset, swap=str(swap), cpu=args.cpu_memory_bytes,
        precision=args.state_precision,
        ckpt=str(root / "kills"), resume=latest_training_checkpoint(root / "kills") is not None, tokens=args.tokens,
        final=final,
    )  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def kills(args, root: Path, digests: dict, expected_s: float) -> dict:
    """``args.kills`` SIGKILLs at random moments of background checkpoints, each followed by a verification of
    the latest checkpoint; then a resume whose step must equal the reference run's."""
    rng = random.Random(args.seed)
    verified = []
    for _ in range(args.kills):
        child = _child(args, root, final=False)
        line = child.stdout.readline()
        if not line.startswith("started"):
            raise RuntimeError(f"the child did not start a checkpoint: {line!r}")
        time.sleep(rng.uniform(0, expected_s))  # a random moment of the checkpoint (or just after it)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        child.stdout.close()
        verified.append(verify_training_checkpoint(root / "kills").step)
    child = _child(args, root, final=True)
    out, _ = child.communicate(timeout=3600)
    _, step, digest = out.split()
    return {"kills": args.kills, "latest_steps_after_kills": verified, "resumed_step": int(step),
            "resume_bit_identical": digests[int(step)] == digest}  # fmt: skip


def first_checkpoint(args, root: Path) -> None:
    """The checkpoint the kills start from (step 1 of a child that is not killed)."""
    child = _child(args, root, final=False)
    out, _ = child.communicate(timeout=3600)
    if "written" not in out:
        raise RuntimeError(f"the first checkpoint was not written: {out!r}")


_STORED = {"fp32": 12, "bf16-moments": 8}  # bytes a parameter of one generation of state in the store (bf16 weights)


def disk_bytes(preset: str, state_precision: str) -> int:
    """The most disk the measurement holds at once: the store's weights, and three generations of state (one
    pinned) beside a checkpoint while the steps run; or in the kills, two generations beside two checkpoints."""
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig.preset(preset)).parameters())
    generation, checkpoint = params * _STORED[state_precision], params * (2 + 12)  # the files: bf16, fp32 state
    return 2 * params + max(3 * generation + checkpoint, 2 * generation + 2 * checkpoint)


def run(args, root: Path) -> dict:
    needed, free = disk_bytes(args.preset, args.state_precision), shutil.disk_usage(root).free
    if needed * 1.05 > free:
        raise SystemExit(
            f"bench_checkpoint --background: {args.preset} with {args.state_precision} state needs about"
            f" {needed / GB:.0f} GB of disk in {root} at once and {free / GB:.0f} GB are free: give --dir on a"
            " larger disk, or --bg-state-precision bf16-moments, or a smaller --background-preset"
        )
    result = measure(args, root)
    shutil.rmtree(root / "ckpt")
    first_checkpoint(args, root)
    result.update(kills(args, root, result.pop("digests"), result["checkpoint_s"]))
    return result
