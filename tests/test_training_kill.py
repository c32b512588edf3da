"""`nvoffload finetune --checkpoint-dir --resume` killed with SIGKILL at chosen moments of a step and of a
checkpoint's write (mid-step, twice; while a checkpoint's files are written; once they are all written but the
directory is not yet renamed; while an old checkpoint is removed): each time the latest complete checkpoint
verifies and the next run resumes from it; the run finally ends bit-identical to one never interrupted (run
beside the killed ones), and leaves no swap file. Each moment is caught exactly: the process is stopped
(SIGSTOP) when it looks reached, its checkpoint directory read, and it is killed only if the moment holds,
else let go on to the next step."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
from conftest import ForkedRun, ForkServer, cli_server

from nvoffload.checkpoint import load_file
from nvoffload.training_checkpoint import (
    STATE_FILE,
    latest_training_checkpoint,
    verify_training_checkpoint,
)

STEPS = 16
# the moment of each kill, one process each, in this order ("mid-step" with how long after a checkpoint)
MOMENTS = ("writing", ("mid-step", 0.01), "written, not renamed", "removing an old one", ("mid-step", 0.06))


def _command(tmp_path, name: str) -> list[str]:
    return [
        "finetune", "--preset", "tiny", "--steps", str(STEPS), "--stream",
        "--max-grad-norm", "1.0", "--grad-accum", "2", "--batch-size", "4", "--dtype", "bfloat16",
        "--swap-dir", str(tmp_path / f"{name}-swap"), "--checkpoint-dir", str(tmp_path / f"{name}-ckpt"),
        "--save-every", "1", "--keep-last", "2", "--resume", "--no-progress",
        "--save-to", str(tmp_path / f"{name}.safetensors"),
    ]  # fmt: skip


def _start(cli: ForkServer, tmp_path, name: str, lines: list[str]) -> tuple[ForkedRun, threading.Thread]:
    """``nvoffload`` with ``name``'s arguments, and the thread appending its output lines (stdout and stderr) to
    ``lines`` as they are written."""
    output = tmp_path / f"{name}-{len(os.listdir(tmp_path))}.fifo"
    os.mkfifo(output)
    process = cli.start("-m nvoffload", _command(tmp_path, name), output, output)

    def read() -> None:
        with open(output) as f:
            lines.extend(f)  # line by line, as they come

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return process, reader


def _phase(ckpt_dir) -> str | None:
    """What the checkpoint directory shows: a checkpoint's files being written (its hidden temporary directory
    without the trainer state), all of them written (with it: only the manifest is left to write), an old
    checkpoint being removed, or nothing."""
    try:
        entries = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return None
    for entry in entries:
        if entry.startswith(".checkpoint-") and ".old-" in entry:
            return "removing an old one"
        if entry.startswith(".checkpoint-") and ".tmp-" in entry:
            try:
                written = STATE_FILE in os.listdir(os.path.join(ckpt_dir, entry))  # the last file but the manifest
            except FileNotFoundError:  # renamed meanwhile
                continue
            return "written, not renamed" if written else "writing"
    return None


def _kill_at(process: ForkedRun, lines: list[str], ckpt_dir, moment) -> None:
    """SIGKILL ``process`` at ``moment`` of one of its steps (after its first step, so that it made progress)."""
    deadline = time.monotonic() + 120
    while not any(line.startswith("step ") for line in lines):
        assert process.poll() is None and time.monotonic() < deadline, "no step within 120 s:\n" + "".join(lines)
        time.sleep(0.005)
    while True:
        assert process.poll() is None and time.monotonic() < deadline, f"{moment} not caught:\n" + "".join(lines)
        if isinstance(moment, tuple):  # a while after a checkpoint is written: within the next step
            seen = len(lines)
            while len(lines) == seen or not lines[-1].startswith("checkpoint of step"):
                assert process.poll() is None and time.monotonic() < deadline, f"{moment} not caught:\n" + "".join(lines)
                time.sleep(0.0005)
            time.sleep(moment[1])
        elif _phase(ckpt_dir) != moment:
            time.sleep(0.0005)
            continue
        process.send_signal(signal.SIGSTOP)  # stops every thread at once: what it shows now holds at the kill
        try:
            phase = _phase(ckpt_dir)
            # a checkpoint is written in the background beside the steps: mid-step, one may be in flight
            mid_step = isinstance(moment, tuple) and lines[-1].startswith("checkpoint of step")
            if mid_step or phase == moment:
                process.send_signal(signal.SIGKILL)
                return
        finally:
            process.send_signal(signal.SIGCONT)


def test_sigkill_at_chosen_moments_then_resume_is_bit_identical(tmp_path):
    for name in ("ref", "run"):
        (tmp_path / f"{name}-swap").mkdir()
    # each run a process of its own, forked from one that imported torch and nvoffload once
    cli = cli_server()
    ref_lines: list[str] = []
    ref, ref_reader = _start(cli, tmp_path, "ref", ref_lines)

    try:
        ckpt_dir = tmp_path / "run-ckpt"
        previous = None
        for moment in MOMENTS:
            lines: list[str] = []
            process, reader = _start(cli, tmp_path, "run", lines)
            try:
                _kill_at(process, lines, ckpt_dir, moment)
            finally:
                process.kill()
                returncode = process.wait(60)
                reader.join(60)
            assert returncode == -signal.SIGKILL, "".join(lines)[-3000:]  # killed before it could finish
            latest = latest_training_checkpoint(ckpt_dir)
            if latest is not None:
                verified = verify_training_checkpoint(ckpt_dir)  # the latest complete one verifies
                assert verified.step == latest.step and (previous is None or verified.step >= previous)
                previous = verified.step
        assert previous is not None and previous < STEPS

        done = cli.run("-m nvoffload", _command(tmp_path, "run"), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "\nresumed from " in done.stdout and "\nstep 1:" not in done.stdout  # it resumed
        assert ref.wait(300) == 0, "".join(ref_lines)[-3000:]
    finally:
        ref.kill()  # when something above failed
        ref.wait(60)
        ref_reader.join(60)
    expected, actual = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "run.safetensors")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    final_ref = load_file(tmp_path / "ref-ckpt" / f"checkpoint-{STEPS}" / "optimizer.safetensors")
    final_run = load_file(ckpt_dir / f"checkpoint-{STEPS}" / "optimizer.safetensors")
    assert final_ref.keys() == final_run.keys() and all(torch.equal(final_ref[k], final_run[k]) for k in final_ref)
    checkpoints = sorted(e for e in os.listdir(ckpt_dir) if not e.startswith(("metrics.", "loss.", "tensorboard")))
    assert checkpoints == [f"checkpoint-{STEPS - 1}", f"checkpoint-{STEPS}"]  # no partial one
    assert os.listdir(tmp_path / "run-swap") == []  # the killed runs' swap files and locks are gone
