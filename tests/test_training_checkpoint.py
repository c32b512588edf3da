"""Training checkpoints: a run saved, stopped and resumed (new objects, other budgets) ends bit-identical to a run
never interrupted; the directory keeps complete checkpoints only; damage is refused, never loaded."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_streaming import config

import nvoffload
from nvoffload.checkpoint import CheckpointError
from nvoffload.memory import MemoryBudgetError
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim import NVMeAdamW
from nvoffload.training_checkpoint import MANIFEST

CFG = GPTConfig(seq_len=16, n_layer=4, n_head=2, d_model=32)
STEPS, SAVE_AT = 6, 3


def _batch():
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))  # the global RNG: restored by the checkpoint
    return x, x.roll(-1, dims=1)


class Run:
    """One training run in a mode: ``optimizer`` (the model on the CPU, its AdamW state on NVMe, clipped),
    ``stream`` (all three tiers, clipped, two micro-batches per step, bf16) or ``torch`` (plain AdamW)."""

    def __init__(self, mode: str, swap_dir, *, cpu_memory_bytes: int | None = None, seed: int = 0):
        torch.manual_seed(seed)
        os.makedirs(swap_dir, exist_ok=True)
        self.mode = mode
        self.accum = 2 if mode == "stream" else 1
        if mode == "stream":
            with torch.device("meta"):
                self.model = GPT(CFG).to(torch.bfloat16)
            kw = {"cpu_memory_bytes": cpu_memory_bytes} if cpu_memory_bytes else {}
            self.model, self.opt = nvoffload.initialize(
                self.model, torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1),
                config(swap_dir, GPT(CFG), max_grad_norm=0.5, gradient_accumulation_steps=2, **kw),
                param_init_fn=self.model.init_weights,
            )  # fmt: skip
        else:
            self.model = GPT(CFG)
            if mode == "optimizer":
                self.opt = NVMeAdamW(
                    self.model.parameters(), lr=3e-3, weight_decay=0.1, swap_dir=swap_dir, max_grad_norm=0.5,
                    cpu_memory_bytes=cpu_memory_bytes or 8 << 20,
                )  # fmt: skip
            else:
                self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.step = 0
        self.losses: list[float] = []

    def train(self, steps: int) -> None:
        for _ in range(steps):
            total = 0.0
            for _ in range(self.accum):
                loss = self.model(*_batch()) / self.accum
                total += loss.item()
                loss.backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.step += 1
            self.losses.append(total)

    def save(self, directory, **kw):
        return nvoffload.save_training_checkpoint(
            directory, step=self.step, model=self.model, optimizer=self.opt, scheduler=self.sched,
            extra={"losses": self.losses}, **kw,
        )  # fmt: skip

    def load(self, path):
        done = nvoffload.load_training_checkpoint(path, model=self.model, optimizer=self.opt, scheduler=self.sched)
        self.step, self.losses = done.step, list(done.extra["losses"])
        return done

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        if hasattr(self.opt, "close"):
            self.opt.close()


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            _assert_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def _goes_on_as_uninterrupted(resumed: Run, losses: list, weights: dict, state: dict) -> None:
    """Train ``resumed`` (loaded at SAVE_AT) to STEPS: its losses, weights and optimizer state are the
    uninterrupted run's, bit for bit; then close it."""
    resumed.train(STEPS - SAVE_AT)
    assert resumed.losses == losses
    _assert_equal(resumed.weights(), weights)
    _assert_equal(_state(resumed), state)
    resumed.close()


def _state(run: Run) -> dict:
    sd = run.opt.state_dict()
    return {"state": sd["state"], "lr": [g["lr"] for g in sd["param_groups"]], "sched": run.sched.state_dict()}


@pytest.mark.parametrize(
    ("mode", "resume_budget"),
    [("optimizer", None), ("optimizer", 3 << 20), ("stream", None), ("stream", "larger"), ("torch", None)],
    ids=["optimizer", "optimizer-other-budget", "stream", "stream-other-budget", "torch"],
)
def test_resume_is_bit_identical(tmp_path, mode, resume_budget):
    whole = Run(mode, tmp_path / "a")
    whole.train(STEPS)
    expected_weights, expected_state, expected_losses = whole.weights(), _state(whole), whole.losses
    whole.close()

    first = Run(mode, tmp_path / "b")
    first.train(SAVE_AT)
    saved = first.save(tmp_path / "ckpt")
    first.train(1)  # what the killed run did after its last checkpoint is lost
    first.close()
    assert saved.step == SAVE_AT and os.path.basename(saved.path) == f"checkpoint-{SAVE_AT}"

    if resume_budget == "larger":
        resume_budget = 2 * config(tmp_path, GPT(CFG)).cpu_memory_bytes
    torch.manual_seed(123)  # the checkpoint restores the RNG
    resumed = Run(mode, tmp_path / "c", cpu_memory_bytes=resume_budget, seed=7)  # other initial weights
    done = resumed.load(tmp_path / "ckpt")
    assert done.step == SAVE_AT and done.path == saved.path
    _goes_on_as_uninterrupted(resumed, expected_losses, expected_weights, expected_state)


def test_keeps_the_last_complete_checkpoints_and_removes_partial_ones(tmp_path):
    run = Run("optimizer", tmp_path / "swap")
    root = tmp_path / "ckpt"
    (root / ".checkpoint-9.tmp-dead").mkdir(parents=True)  # a save killed before its end
    (root / ".checkpoint-9.tmp-dead" / "optimizer.safetensors").write_bytes(b"partial")
    (root / ".checkpoint-1.old-dead").mkdir()  # one killed while it was being deleted
    run.train(1)
    with pytest.warns(UserWarning, match=r"removed 2 partial checkpoint\(s\) .*: \.checkpoint-1\.old-dead, \.checkpoint-9\.tmp-dead"):
        run.save(root, keep_last=2)
    for _ in range(3):
        run.train(1)
        run.save(root, keep_last=2)
    assert sorted(os.listdir(root)) == ["checkpoint-3", "checkpoint-4"]  # nothing hidden left either
    assert nvoffload.latest_training_checkpoint(root).step == 4
    os.remove(root / "checkpoint-4" / MANIFEST)  # as if the manifest had never been written
    assert nvoffload.latest_training_checkpoint(root).step == 3
    files = sorted(os.listdir(root / "checkpoint-3"))
    assert files == [MANIFEST, "model", "optimizer.safetensors", "trainer_state.pt"]
    manifest = json.loads((root / "checkpoint-3" / MANIFEST).read_text())
    assert manifest["step"] == 3 and set(manifest["tensors"]) == {"model/model.safetensors", "optimizer.safetensors"}
    run.close()
    assert nvoffload.latest_training_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(FileNotFoundError, match="no complete training checkpoint"):
        nvoffload.load_training_checkpoint(tmp_path / "nothing", model=run.model, optimizer=run.opt)


def test_optimizer_state_in_shards_streamed_chunk_by_chunk(tmp_path):
    run = Run("optimizer", tmp_path / "swap", cpu_memory_bytes=3 << 20)  # several chunks per large parameter
    run.train(2)
    saved = run.save(tmp_path / "ckpt", max_shard_bytes=200_000)
    shards = sorted(f for f in os.listdir(saved.path) if f.startswith("optimizer"))
    assert len(shards) > 2 and shards[0] == f"optimizer-00001-of-{len(shards):05d}.safetensors"
    expected = run.opt.state_dict()["state"]
    from nvoffload.checkpoint import CheckpointReader

    with CheckpointReader([os.path.join(saved.path, f) for f in shards]) as reader:
        for idx, st in expected.items():
            assert torch.equal(reader.read(f"{idx}.exp_avg"), st["exp_avg"])
            assert torch.equal(reader.read(f"{idx}.exp_avg_sq"), st["exp_avg_sq"])
    run.close()


@pytest.mark.parametrize("where", ["model", "optimizer", "trainer_state"])
def test_a_flipped_byte_is_refused(tmp_path, where):
    run = Run("optimizer", tmp_path / "swap")
    run.train(2)
    saved = run.save(tmp_path / "ckpt")
    path = {
        "model": os.path.join(saved.path, "model", "model.safetensors"),
        "optimizer": os.path.join(saved.path, "optimizer.safetensors"),
        "trainer_state": os.path.join(saved.path, "trainer_state.pt"),
    }[where]
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        run.load(tmp_path / "ckpt")
    run.close()


def test_a_truncated_file_is_refused(tmp_path):
    run = Run("optimizer", tmp_path / "swap")
    run.train(1)
    saved = run.save(tmp_path / "ckpt")
    path = os.path.join(saved.path, "optimizer.safetensors")
    os.truncate(path, os.path.getsize(path) - 8)
    with pytest.raises(CheckpointError, match="the manifest says"):
        run.load(saved.path)
    run.close()


def test_refuses_between_backward_and_step_and_bad_arguments(tmp_path):
    run = Run("stream", tmp_path / "swap")
    run.model(*_batch()).backward()
    with pytest.raises(RuntimeError, match="after optimizer.step"):
        run.save(tmp_path / "ckpt")
    run.opt.step()
    run.opt.zero_grad()
    for bad in ({"step": -1}, {"step": True}, {"keep_last": 0}):
        with pytest.raises(ValueError):
            nvoffload.save_training_checkpoint(tmp_path / "ckpt", model=run.model, optimizer=run.opt, **{"step": 1, **bad})
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="cannot write training checkpoints"):
        nvoffload.save_training_checkpoint(tmp_path / "file" / "ckpt", step=1, model=run.model, optimizer=run.opt)
    assert not os.path.exists(tmp_path / "ckpt")
    run.close()


# -- resume after faults: a killed save, a second run, a full disk, a damaged checkpoint -------------------------


def test_a_resume_with_nothing_to_do_prunes_to_keep_last_and_removes_what_a_killed_save_left(tmp_path):
    """A run killed while its last save removed the oldest checkpoint leaves that one under a hidden name (being
    deleted) and keep_last + 1 checkpoints; the next resume, with no step left to do, cleans both up."""
    from nvoffload.finetune import FinetuneConfig, finetune

    root = tmp_path / "ckpt"
    kw = {"preset": "tiny", "steps": 3, "batch_size": 2, "swap_dir": str(tmp_path), "checkpoint_dir": str(root)}
    finetune(FinetuneConfig(**kw, save_every=1, keep_last=3), progress=False)
    os.rename(root / "checkpoint-1", root / ".checkpoint-1.old-0123abcd")  # killed between rename and rmtree
    os.remove(root / ".checkpoint-1.old-0123abcd" / MANIFEST)
    (root / ".checkpoint-4.tmp-4567cdef").mkdir()  # and one killed while writing
    with pytest.warns(UserWarning, match=r"removed 2 partial checkpoint\(s\) left by a run killed while saving"):
        result = finetune(FinetuneConfig(**kw, keep_last=1, resume=True), progress=False)
    assert result.steps == []  # nothing to do
    assert sorted(n for n in os.listdir(root) if "checkpoint" in n) == ["checkpoint-3"]  # beside the run's metrics


_HOLD = """
import sys, time
from nvoffload.training_checkpoint import claim_checkpoint_directory
claim_checkpoint_directory(sys.argv[1])
print("held", flush=True)
time.sleep(600)  # until killed
"""


def test_a_checkpoint_directory_another_live_run_holds_is_refused_and_a_killed_runs_is_taken_over(tmp_path):
    import errno
    import signal

    from conftest import SCRIPT_PRELOAD, fork_server

    from nvoffload.finetune import FinetuneConfig, finetune
    from nvoffload.training_checkpoint import claim_checkpoint_directory

    root = tmp_path / "ckpt"  # held by python -c, forked from the session's server that imported torch once
    other = fork_server(SCRIPT_PRELOAD).start_saying(f"-c {_HOLD}", [root], "held")
    try:
        (root / ".checkpoint-7.tmp-89abcdef").mkdir()  # the other run's save in progress
        run = Run("torch", tmp_path / "swap")
        run.train(1)
        refused = rf"checkpoint directory {root} is in use by process {other.pid} on .*: give each run its own"
        with pytest.raises(OSError, match=refused) as info:
            run.save(root)
        assert info.value.errno == errno.EBUSY
        with pytest.raises(OSError, match=refused):
            finetune(FinetuneConfig(preset="tiny", steps=1, batch_size=2, swap_dir=str(tmp_path), checkpoint_dir=str(root)), progress=False)
        assert sorted(os.listdir(root)) == [".checkpoint-7.tmp-89abcdef", "nvoffload.lock"]  # untouched
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    with pytest.warns(UserWarning, match=rf"removed 1 partial checkpoint\(s\) left by a run killed while saving.*\.checkpoint-7\.tmp-89abcdef"):
        release = claim_checkpoint_directory(root)
    assert sorted(os.listdir(root)) == ["nvoffload.lock"]
    assert run.save(root).step == 1  # this process holds it: the save goes on
    release()
    assert sorted(os.listdir(root)) == ["checkpoint-1"]
    run.close()


def test_check_checkpoint_directory_creates_nothing_and_a_run_refused_after_its_claim_leaves_nothing(tmp_path):
    from nvoffload.finetune import FinetuneConfig, finetune
    from nvoffload.training_checkpoint import check_checkpoint_directory, claim_checkpoint_directory

    assert check_checkpoint_directory(tmp_path / "a" / "b") == str(tmp_path / "a" / "b")
    assert os.listdir(tmp_path) == []
    release = claim_checkpoint_directory(tmp_path / "a" / "b")
    assert os.listdir(tmp_path / "a" / "b") == ["nvoffload.lock"]
    release()  # nothing was saved: the directories it made go
    assert os.listdir(tmp_path) == []
    (tmp_path / "mine").mkdir()
    claim_checkpoint_directory(tmp_path / "mine")()
    assert os.listdir(tmp_path) == ["mine"]  # not made by the claim: kept
    os.rmdir(tmp_path / "mine")
    swap = tmp_path / "swap"
    swap.mkdir()
    ckpt = tmp_path / "new" / "ckpt"
    with pytest.raises(MemoryBudgetError):  # refused while the model is built, once the directory is claimed
        finetune(FinetuneConfig(preset="tiny", steps=1, swap_dir=str(swap), checkpoint_dir=str(ckpt), stream=True,
                                device_memory_bytes=64 << 10), progress=False)  # fmt: skip
    assert os.listdir(tmp_path) == ["swap"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=rf"cannot write training checkpoints in {tmp_path}/file/c: {tmp_path}/file is not a directory"):
        check_checkpoint_directory(tmp_path / "file" / "c")
    assert sorted(os.listdir(tmp_path)) == ["file", "swap"]


_FILL_AND_SAVE = """
import json, os, sys
from test_training_checkpoint import Run
from nvoffload.training_checkpoint import claim_checkpoint_directory

root, where = sys.argv[1], sys.argv[2]
ckpt = os.path.join(root, "ckpt")
run = Run("torch", os.path.join(root, "swap"))
run.train(1)
first = run.save(ckpt, keep_last=None)
if where != "lock":
    claim_checkpoint_directory(ckpt)  # its lock written before the disk fills
pages = lambda rel: -(-os.path.getsize(os.path.join(first.path, rel)) // 4096)
before = {"lock": [], "model": [], "trainer_state": ["model/model.safetensors", "optimizer.safetensors"]}[where]
free = os.statvfs(root)
with open(os.path.join(root, "filler"), "wb") as f:  # leaves the pages of the files written before the target
    f.write(bytes((free.f_bavail - sum(map(pages, before))) * free.f_frsize))
run.train(1)
try:
    run.save(ckpt, keep_last=None)
except OSError as exc:
    print(json.dumps({"errno": exc.errno, "filename": exc.filename, "message": str(exc), "left": sorted(os.listdir(ckpt))}))
"""


@pytest.mark.parametrize("where", ["lock", "model", "trainer_state"])
def test_a_full_disk_while_saving_names_the_file_and_leaves_the_last_checkpoint(tmp_path, where):
    """A real full file system: a small tmpfs mounted in a private mount namespace (skipped where unshare or the
    mount is not allowed); the save fails on the file named, nothing of it is left, checkpoint-1 is intact."""
    import errno
    import shutil
    import subprocess
    import sys

    unshare = ["unshare", "--user", "--map-root-user", "--mount"]
    root = tmp_path / "small"
    root.mkdir()
    mount = f"mount -t tmpfs -o size=4m tmpfs {root}"
    if shutil.which("unshare") is None or subprocess.run([*unshare, "sh", "-c", mount], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs in a private mount namespace here (unshare --user --mount)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    script = f"{mount} && exec {sys.executable} -c '{_FILL_AND_SAVE}' {root} {where}"
    done = subprocess.run([*unshare, "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    held = [] if where == "lock" else ["nvoffload.lock"]  # the script's own claim (a lock is not left behind)
    assert got["errno"] == errno.ENOSPC and got["left"] == ["checkpoint-1", *held]  # nothing of checkpoint-2 left
    name = {"lock": "nvoffload.lock", "model": ".model.safetensors.tmp", "trainer_state": "trainer_state.pt"}[where]
    assert os.path.basename(got["filename"]) == name
    assert got["filename"].startswith(f"{root}/ckpt/" if where == "lock" else f"{root}/ckpt/.checkpoint-2.tmp-")
    assert got["message"] == f"[Errno 28] No space left on device: {got['filename']!r}"


def _flip_a_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("mode", ["optimizer", "stream"])
def test_a_damaged_latest_checkpoint_is_skipped_for_the_newest_one_that_loads(tmp_path, mode):
    """The latest checkpoint's optimizer state fails its checksum after the model was loaded from it: the resume
    warns, names it and why, loads the one before into the same objects and trains bit-identical from there."""
    whole = Run(mode, tmp_path / "a")
    whole.train(STEPS)
    expected_weights, expected_losses = whole.weights(), whole.losses
    whole.close()

    first = Run(mode, tmp_path / "b")
    first.train(SAVE_AT - 1)
    first.save(tmp_path / "ckpt")
    first.train(1)
    damaged = first.save(tmp_path / "ckpt")
    first.close()
    _flip_a_byte(os.path.join(damaged.path, "optimizer.safetensors"))

    resumed = Run(mode, tmp_path / "c", seed=7)
    skipped = rf"skipped {damaged.path}: {damaged.path}/optimizer.safetensors, tensor .*: checksum mismatch"
    with pytest.warns(UserWarning, match=skipped):
        done = resumed.load(tmp_path / "ckpt")
    assert done.step == SAVE_AT - 1 and done.path == str(tmp_path / "ckpt" / f"checkpoint-{SAVE_AT - 1}")
    resumed.train(STEPS - done.step)
    assert resumed.losses == expected_losses
    _assert_equal(resumed.weights(), expected_weights)
    resumed.close()


def test_when_no_checkpoint_loads_the_error_names_each_and_why(tmp_path):
    run = Run("torch", tmp_path / "swap")
    paths = []
    for _ in range(2):
        run.train(1)
        paths.append(run.save(tmp_path / "ckpt").path)
    _flip_a_byte(os.path.join(paths[1], "model", "model.safetensors"))
    os.truncate(os.path.join(paths[0], "optimizer.safetensors"), 100)
    with pytest.raises(CheckpointError, match="no checkpoint in it loads") as info:
        run.load(tmp_path / "ckpt")
    message = str(info.value)
    assert f"{paths[1]}: {paths[1]}/model/model.safetensors, tensor" in message and "checksum mismatch" in message
    assert f"{paths[0]}: {paths[0]}/optimizer.safetensors: 100 bytes: the manifest says" in message
    assert message.index(paths[1]) < message.index(paths[0])  # newest first
    run.close()
