"""`nvoffload finetune --checkpoint-dir --resume` killed with SIGKILL at random moments, ten times, some of
them while a checkpoint is being written: each time the latest complete checkpoint verifies and the next run
resumes from it; the run finally ends bit-identical to one never interrupted, and leaves no swap file."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import torch

from nvoffload.checkpoint import load_file
from nvoffload.training_checkpoint import (
    latest_training_checkpoint,
    verify_training_checkpoint,
)

STEPS = 30
KILLS = 10


def _command(tmp_path, name: str) -> list[str]:
    return [
        sys.executable, "-m", "nvoffload", "finetune", "--preset", "tiny", "--steps", str(STEPS), "--stream",
        "--max-grad-norm", "1.0", "--grad-accum", "2", "--batch-size", "4", "--dtype", "bfloat16",
        "--swap-dir", str(tmp_path / f"{name}-swap"), "--checkpoint-dir", str(tmp_path / f"{name}-ckpt"),
        "--save-every", "1", "--keep-last", "2", "--resume", "--no-progress",
        "--save-to", str(tmp_path / f"{name}.safetensors"),
    ]  # fmt: skip


def _started(process: subprocess.Popen, lines: list[str]) -> tuple[threading.Event, threading.Thread]:
    """An event set once the process has printed its first step, and the thread reading its output."""
    event = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step "):
                event.set()
        event.set()  # it ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return event, reader


def _saving(ckpt_dir) -> bool:
    """A checkpoint is being written: its hidden temporary directory exists."""
    try:
        return any(e.startswith(".checkpoint-") for e in os.listdir(ckpt_dir))
    except FileNotFoundError:
        return False


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path):
    for name in ("ref", "run"):
        (tmp_path / f"{name}-swap").mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(_command(tmp_path, "ref"), capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    rng = random.Random(17)
    ckpt_dir = tmp_path / "run-ckpt"
    killed_while_saving = 0
    previous = None
    for kill in range(KILLS):
        lines: list[str] = []
        process = subprocess.Popen(
            _command(tmp_path, "run"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )  # fmt: skip
        started, reader = _started(process, lines)
        assert started.wait(120), "no step within 120 s"
        if kill % 2:  # the moment a checkpoint is being written
            deadline = time.monotonic() + 30
            while not _saving(ckpt_dir) and time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.0005)
            time.sleep(rng.uniform(0, 0.01))
        else:
            time.sleep(rng.uniform(0, 0.4))
        saving = _saving(ckpt_dir)
        process.send_signal(signal.SIGKILL)
        returncode = process.wait(60)
        reader.join(60)
        process.stdout.close()
        assert returncode == -signal.SIGKILL, "".join(lines)[-3000:]  # killed before it could finish
        killed_while_saving += saving
        latest = latest_training_checkpoint(ckpt_dir)
        if latest is not None:
            verified = verify_training_checkpoint(ckpt_dir)  # the latest complete one verifies
            assert verified.step == latest.step and (previous is None or verified.step >= previous)
            previous = verified.step
        assert any(line.startswith("step ") for line in lines)
    assert previous is not None and previous < STEPS
    assert killed_while_saving >= 3, killed_while_saving

    done = subprocess.run(_command(tmp_path, "run"), capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\nresumed from " in done.stdout and "\nstep 1:" not in done.stdout  # it resumed
    expected, actual = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "run.safetensors")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    final_ref = load_file(tmp_path / "ref-ckpt" / f"checkpoint-{STEPS}" / "optimizer.safetensors")
    final_run = load_file(ckpt_dir / f"checkpoint-{STEPS}" / "optimizer.safetensors")
    assert final_ref.keys() == final_run.keys() and all(torch.equal(final_ref[k], final_run[k]) for k in final_ref)
    checkpoints = sorted(e for e in os.listdir(ckpt_dir) if not e.startswith(("metrics.", "loss.", "tensorboard")))
    assert checkpoints == [f"checkpoint-{STEPS - 1}", f"checkpoint-{STEPS}"]  # no partial one
    assert os.listdir(tmp_path / "run-swap") == []  # the killed runs' swap files and locks are gone
