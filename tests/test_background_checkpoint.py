"""Background checkpoints: the state of one step, written while the next steps run, equals a checkpoint taken
with training stopped (file by file), and a run resumed from it ends bit-identical; the store's pins keep what
they hold; the writer's host buffers are bounded; a kill at a named phase of the writer leaves the previous
checkpoint loadable and the resume bit-identical."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import SCRIPT_PRELOAD, fork_server
from test_training_checkpoint import CFG, SAVE_AT, STEPS, Run, _assert_equal, _batch, _goes_on_as_uninterrupted, _state

import nvoffload
from nvoffload.checkpoint import SafetensorsWriter, open_checkpoint
from nvoffload.checkpoint_writer import EngineWriter, hold_at
from nvoffload.core.future import WAIT_LIMIT_S
from nvoffload.io.checksum import crc32c
from nvoffload.io import TensorStore
from nvoffload.models import GPT
from nvoffload.optim import NVMeAdamW
from nvoffload.pretrained import save_pretrained
from nvoffload.training_checkpoint import MANIFEST, latest_training_checkpoint, verify_training_checkpoint


def _start(run: Run, directory, **kw):
    return nvoffload.start_training_checkpoint(
        directory, step=run.step, model=run.model, optimizer=run.opt, scheduler=run.sched,
        extra={"losses": list(run.losses)}, **kw,
    )  # fmt: skip


def _files(path) -> dict[str, bytes]:
    root = Path(path)
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_a_pin_keeps_a_tensor_deleted_or_replaced_until_released(tmp_path):
    with TensorStore(tmp_path) as store:
        store.put("a", torch.arange(4096, dtype=torch.float32)).result()
        store.put("b", torch.ones(10)).result()
        pin = store.pin(["a", "b"])
        store.put("a", torch.zeros(4096)).result()  # replaced
        store.delete("b")
        used = store.used_bytes
        store.put("c", torch.full((8192,), 7.0)).result()  # may not take the pinned extents
        assert store.used_bytes == used + 8192 * 4
        assert torch.equal(pin.get("a").result(), torch.arange(4096, dtype=torch.float32))
        assert torch.equal(pin.get("b").result(), torch.ones(10))
        assert torch.equal(store.get("a").result(), torch.zeros(4096)) and "b" not in store
        pin.release()
        assert store.used_bytes == used + 8192 * 4 - 4096 * 4 - 4096  # the old "a" and "b" freed (4 KiB-aligned)
        with pytest.raises(RuntimeError, match="released"):
            pin.get("a")
        with pytest.raises(KeyError, match="'b'"):
            store.pin(["a", "b"])


@pytest.mark.parametrize("mode", ["optimizer", "stream"])
def test_a_background_checkpoint_holds_its_step_while_training_goes_on(tmp_path, mode):
    stopped = Run(mode, tmp_path / "a")
    stopped.train(SAVE_AT)
    stopped.save(tmp_path / "stopped")  # training waits until it is written
    stopped.train(STEPS - SAVE_AT)
    expected_weights, expected_state, expected_losses = stopped.weights(), _state(stopped), stopped.losses
    stopped.close()

    run = Run(mode, tmp_path / "b")
    run.train(SAVE_AT)
    with hold_at("state") as go:  # the writer stops half-way through the optimizer state
        job = _start(run, tmp_path / "background")
        run.train(STEPS - SAVE_AT)  # the next steps commit their state beside it
        assert not job.done()
        with pytest.raises(TimeoutError, match=f"checkpoint of step {SAVE_AT} is still being written"):
            job.wait(timeout_s=0.01)
        go.set()
        saved = job.wait()
    assert saved.step == SAVE_AT and job.seconds is not None and job.nbytes > 0
    assert run.losses == expected_losses  # the steps beside it trained as without it
    _assert_equal(run.weights(), expected_weights)
    run.close()

    ckpt = f"checkpoint-{SAVE_AT}"
    assert _files(tmp_path / "background" / ckpt) == _files(tmp_path / "stopped" / ckpt)  # bit for bit
    resumed = Run(mode, tmp_path / "c", seed=7)
    assert resumed.load(tmp_path / "background").step == SAVE_AT
    _goes_on_as_uninterrupted(resumed, expected_losses, expected_weights, expected_state)


SMALL_CACHE_BYTES = 208 << 10  # Run("stream")'s host cache holds 3 of its 4 blocks: one is read from the store


@pytest.mark.parametrize(
    "mode, cpu_memory_bytes", [("optimizer", None), ("stream", None), ("stream", SMALL_CACHE_BYTES)],
    ids=["in-memory", "streamed", "streamed-small-cache"],
)  # fmt: skip
def test_the_weights_written_are_those_of_its_step_while_the_next_steps_change_them(tmp_path, mode, cpu_memory_bytes):
    """The writer is held before it writes anything while the next steps run: a model in memory has its weights
    copied at the start (all the next steps run while it is held); a streamed model's blocks stay held in the host
    cache (the next step's forward runs while the writer is held, its updates of them wait for the writer) or
    pinned in the store (the next steps' write-backs replace their entries; with the cache that small, the forward
    needs a held block's room, and waits for the writer: it is let go at once). The checkpoint is the one taken
    with training stopped, bit for bit, and the steps beside it train as without it."""
    stopped = Run(mode, tmp_path / "a", cpu_memory_bytes=cpu_memory_bytes)
    stopped.train(SAVE_AT)
    stopped.save(tmp_path / "stopped")
    stopped.train(STEPS - SAVE_AT)
    expected_weights, expected_losses = stopped.weights(), stopped.losses
    stopped.close()

    run = Run(mode, tmp_path / "b", cpu_memory_bytes=cpu_memory_bytes)
    run.train(SAVE_AT)
    forward_ran, failed = threading.Event(), []

    def beside() -> None:
        try:
            run.train(STEPS - SAVE_AT)
        except BaseException as exc:  # raised below
            failed.append(exc)
            forward_ran.set()

    with hold_at("copy") as go:
        job = _start(run, tmp_path / "background")
        hook = run.model.register_forward_hook(lambda *_: forward_ran.set())
        trainer = threading.Thread(target=beside)
        trainer.start()
        if mode == "optimizer":
            trainer.join(WAIT_LIMIT_S)
        if cpu_memory_bytes is None:
            assert forward_ran.wait(WAIT_LIMIT_S) and not failed, failed
        assert not job.done()
        go.set()
        trainer.join(WAIT_LIMIT_S)
    hook.remove()
    assert not trainer.is_alive() and not failed, failed
    job.wait()
    assert run.losses == expected_losses
    _assert_equal(run.weights(), expected_weights)
    run.close()
    ckpt = f"checkpoint-{SAVE_AT}"
    assert _files(tmp_path / "background" / ckpt) == _files(tmp_path / "stopped" / ckpt)


@pytest.mark.parametrize("mode", ["optimizer", "stream"])
def test_the_checkpoints_thread_writes_the_weights_not_the_training_thread(tmp_path, monkeypatch, mode):
    """Where the model's tensors are written: every one through the I/O engine from the checkpoint's own thread;
    the training thread writes only the files' headers and the small files beside them (buffered)."""
    run = Run(mode, tmp_path / "swap")
    run.train(1)
    engine_writes, buffered = [], []
    write, pwrite = EngineWriter.write, os.pwrite

    def recorded_write(self, writer, name, start, values):
        engine_writes.append((threading.current_thread().name, writer.path, name))
        return write(self, writer, name, start, values)

    def recorded_pwrite(fd, data, offset):
        buffered.append((threading.current_thread().name, len(data)))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(EngineWriter, "write", recorded_write)
    monkeypatch.setattr(os, "pwrite", recorded_pwrite)
    job = _start(run, tmp_path / "ckpt")
    training = threading.current_thread().name
    job.wait()
    monkeypatch.undo()
    model = {(os.path.basename(path), name) for _, path, name in engine_writes if f"{os.sep}model{os.sep}" in path}
    with open_checkpoint(os.path.join(job.wait().path, "model")) as reader:
        assert model == {(os.path.basename(reader.file_of(name)), name) for name in reader.keys()}
    assert {thread for thread, _, _ in engine_writes} == {f"nvoffload-checkpoint-{run.step}"}
    headers = []
    for path in Path(job.wait().path).rglob("*.safetensors"):
        with open(path, "rb") as f:
            headers.append(8 + int.from_bytes(f.read(8), "little"))
    assert sorted(nbytes for thread, nbytes in buffered if thread == training) == sorted(headers)  # no tensor
    run.close()


@pytest.mark.parametrize("mode", ["optimizer", "stream"])
def test_the_checkpoints_model_is_what_save_pretrained_writes(tmp_path, mode):
    """The model directory the I/O engine fills is the one save_pretrained writes, byte for byte."""
    run = Run(mode, tmp_path / "swap")
    run.train(1)
    saved = _start(run, tmp_path / "ckpt").wait()
    if mode == "stream":
        run.opt.session.save_pretrained(tmp_path / "pretrained")
    else:
        save_pretrained(run.model, tmp_path / "pretrained")
    run.close()
    assert _files(Path(saved.path) / "model") == _files(tmp_path / "pretrained")


def test_a_background_checkpoint_of_resident_state_holds_its_step(tmp_path):
    """A chunk kept resident in host memory writes the generation after next into the buffer of the one held:
    the checkpoint copies it when it starts."""

    def train(model, opt, steps: int) -> None:
        for _ in range(steps):
            model(*_batch()).backward()
            opt.step()
            opt.zero_grad()

    saved = {}
    for name in ("stopped", "background"):
        torch.manual_seed(0)
        model = GPT(CFG)
        with NVMeAdamW(model.parameters(), lr=3e-3, swap_dir=tmp_path, resident_state_bytes=1 << 20) as opt:
            train(model, opt, SAVE_AT)
            assert opt.memory_stats().resident_state_bytes > 0
            with hold_at("copy") as go:  # before the first chunk is read
                job = nvoffload.start_training_checkpoint(tmp_path / name, step=SAVE_AT, model=model, optimizer=opt)
                if name == "background":
                    train(model, opt, 3)  # the held generation's buffers written again
                go.set()
                saved[name] = _files(job.wait().path)
    assert saved["background"] == saved["stopped"]


def test_a_failed_background_checkpoint_raises_from_wait_and_leaves_nothing(tmp_path):
    run = Run("optimizer", tmp_path / "swap")
    run.train(1)
    _start(run, tmp_path / "ckpt").wait()
    run.train(1)
    with hold_at("copy") as go:
        job = _start(run, tmp_path / "ckpt")
        run.opt._store.inject_fault("eio", after_ops=0)  # the copy's first read of the held state fails
        go.set()
        with pytest.raises(OSError, match="Input/output error"):
            job.wait()
    assert os.listdir(tmp_path / "ckpt") == ["checkpoint-1"]  # nothing of it left, its lock released
    run.train(1)  # training goes on, and so do checkpoints
    assert _start(run, tmp_path / "ckpt").wait().step == 3
    run.close()


def test_a_full_disk_while_the_weights_are_written_raises_from_wait_and_lets_the_blocks_go(tmp_path, monkeypatch):
    """A streamed model's blocks held in the host cache: the writer fails on them (ENOSPC from the I/O threads);
    wait() raises it naming the file, nothing of the checkpoint is left, and the blocks are let go: the next steps
    update them and the next checkpoint is written."""
    run = Run("stream", tmp_path / "swap")
    run.train(1)
    _start(run, tmp_path / "ckpt").wait()
    run.train(1)
    init = EngineWriter.__init__

    def full_disk(self, config=None):
        init(self, config)
        self._engine.inject_fault("enospc", after_ops=1)  # the second block the I/O threads write

    monkeypatch.setattr(EngineWriter, "__init__", full_disk)
    with pytest.raises(OSError, match=r"No space left on device.*model\.safetensors"):
        _start(run, tmp_path / "ckpt").wait()
    monkeypatch.undo()
    assert os.listdir(tmp_path / "ckpt") == ["checkpoint-1"]
    run.train(1)  # its updates of the blocks the writer held
    assert _start(run, tmp_path / "ckpt").wait().step == 3
    run.close()


def test_the_writer_holds_a_bounded_number_of_chunks_and_a_new_checkpoint_waits_for_the_last(tmp_path):
    run = Run("optimizer", tmp_path / "swap", cpu_memory_bytes=8 << 20)
    run.train(2)
    layout = run.opt.state_layout()
    snapshot = run.opt.snapshot_state(layout)
    buffers, calls = set(), []

    def sink(placeholder, elements, values):
        buffers.add(values.untyped_storage().data_ptr())
        calls.append(elements)

    snapshot.stream(sink, max_bytes_in_flight=1)  # the least: two chunks' buffers
    snapshot.release()
    assert len(buffers) == 2 and len(calls) > 4

    with hold_at("manifest") as go:
        first = _start(run, tmp_path / "ckpt", keep_last=2)
        run.train(1)
        assert not first.done()
        go.set()
        second = _start(run, tmp_path / "ckpt", keep_last=2)  # waits for the first before it starts
        assert first.done()
    assert [first.wait().step, second.wait().step] == [2, 3]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-2", "checkpoint-3"]
    run.close()


_CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from test_background_checkpoint import _start
from test_training_checkpoint import Run
run = Run({mode!r}, {swap!r})
run.train(2)
run.save({ckpt!r})
run.train(1)
os.environ["NVOFFLOAD_CHECKPOINT_STOP_AT"] = {stop_at!r}  # this one only
job = _start(run, {ckpt!r})
run.train(1)
job.wait()
print("not killed")
"""


def test_the_writer_widens_compact_state_into_its_own_buffers(tmp_path):
    """bf16 moments are handed to the sink as fp32 in the writer's own buffers (no memory allocated, and faulted
    in, per chunk), their values those of the state dict."""
    torch.manual_seed(0)
    model = GPT(CFG)
    with NVMeAdamW(model.parameters(), lr=3e-3, swap_dir=tmp_path, cpu_memory_bytes=8 << 20,
                   state_precision="bf16-moments") as opt:  # fmt: skip
        for _ in range(2):
            model(*_batch()).backward()
            opt.step()
            opt.zero_grad()
        expected = opt.state_dict()["state"]
        layout = opt.state_layout()
        snapshot = opt.snapshot_state(layout)
        where = {id(t): (idx, key) for idx, st in layout["state"].items() for key, t in st.items()}
        buffers, got = set(), {}

        def sink(placeholder, elements, values):
            assert values.dtype == torch.float32
            buffers.add(values.untyped_storage().data_ptr())
            got.setdefault(where[id(placeholder)], []).append(values.clone())

        snapshot.stream(sink, max_bytes_in_flight=1)
        snapshot.release()
    assert len(buffers) == 2 and len(got) > 4
    for (idx, key), parts in got.items():
        assert torch.equal(torch.cat(parts), expected[idx][key].reshape(-1)), (idx, key)


def test_the_engine_writer_puts_unaligned_edges_together_and_writes_only_with_o_direct(tmp_path, monkeypatch):
    """Tensors whose sizes are not multiples of 4 KiB, written in parts in any order of tensors: every byte goes
    out through the I/O threads (no buffered write beside their O_DIRECT ones), the file is whole (its last page
    cut back to its size) and its checksums those of the tensors."""
    torch.manual_seed(0)
    tensors = {"a": torch.randn(1001), "b": torch.randn(3, 777).bfloat16(), "c": torch.randn(5003), "d": torch.randn(7)}
    path = tmp_path / "state.safetensors"
    writer = SafetensorsWriter(path, {n: (t.dtype, t.shape) for n, t in tensors.items()}, data_alignment_bytes=4096)
    assert writer.data_start % 4096 == 0
    buffered = []
    monkeypatch.setattr(os, "pwrite", lambda *args: buffered.append(args))
    engine = EngineWriter()
    futures = []
    for name, cut in (("c", 2000), ("a", 333), ("d", 7), ("b", 1500)):  # two parts each, d's second one empty
        flat = tensors[name].reshape(-1)
        futures += [engine.write(writer, name, 0, flat[:cut]), engine.write(writer, name, cut, flat[cut:])]
    for future in futures:
        future.result()
    engine.finish()
    monkeypatch.undo()
    writer.close()
    assert buffered == []
    assert os.path.getsize(path) == writer.data_start + sum(t.numel() * t.element_size() for t in tensors.values())
    with open_checkpoint(path) as reader:
        for name, t in tensors.items():
            assert torch.equal(reader.read(name), t), name
            assert writer.checksums[name] == crc32c(t.contiguous()), name


def test_the_engine_writer_refuses_a_file_whose_data_is_not_aligned(tmp_path):
    writer = SafetensorsWriter(tmp_path / "state.safetensors", {"a": (torch.float32, (8,))})
    engine = EngineWriter()
    with pytest.raises(ValueError, match="state.safetensors.tmp: its data starts at byte .*data_alignment_bytes=4096"):
        engine.write(writer, "a", 0, torch.ones(8))
    engine.close()
    writer.abort()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "mode, phase", [("optimizer", "weights"), ("stream", "weights"), ("optimizer", "state"), ("optimizer", "manifest")]
)  # fmt: skip
def test_a_kill_during_a_background_checkpoint_leaves_the_previous_one(tmp_path, mode, phase):
    whole = Run(mode, tmp_path / "whole")
    whole.train(STEPS)
    expected_weights, expected_losses = whole.weights(), whole.losses
    whole.close()

    marker = tmp_path / "stopped"
    script = _CHILD.format(
        tests=str(Path(__file__).parent), mode=mode, swap=str(tmp_path / "swap"), ckpt=str(tmp_path / "ckpt"),
        stop_at=f"{phase}:{marker}",
    )  # fmt: skip
    (tmp_path / "swap").mkdir()
    out = tmp_path / "child.out"  # python -c, forked from the session's server that imported torch once
    child = fork_server(SCRIPT_PRELOAD).start(f"-c {textwrap.dedent(script)}", [], out, os.devnull)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # the writer reached the phase and stopped the process there
            assert child.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.01)
        entries = os.listdir(tmp_path / "ckpt")
        assert any(e.startswith(".checkpoint-3.tmp-") for e in entries), (entries, marker.read_text())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    assert child.returncode == -signal.SIGKILL
    assert latest_training_checkpoint(tmp_path / "ckpt").step == 2
    assert verify_training_checkpoint(tmp_path / "ckpt").step == 2
    assert not os.path.exists(tmp_path / "ckpt" / "checkpoint-3" / MANIFEST)

    resumed = Run(mode, tmp_path / "resume", seed=7)
    with pytest.warns(UserWarning, match="removed 1 partial checkpoint"):
        release = nvoffload.training_checkpoint.claim_checkpoint_directory(tmp_path / "ckpt")
    release()
    assert resumed.load(tmp_path / "ckpt").step == 2
    resumed.train(STEPS - 2)
    assert resumed.losses == expected_losses
    _assert_equal(resumed.weights(), expected_weights)
    resumed.close()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft asks transformers
def test_a_streamed_lora_models_checkpoint_writes_its_adapters_of_its_step(tmp_path):
    """A PEFT model on a streamed base: the adapters (the blocks' trained parts, held in the host cache) are written
    as PEFT saves them, those of the checkpoint's step while the next step updates them."""
    pytest.importorskip("peft")
    from test_lora import streamed_lora, train_step

    model, opt = streamed_lora(tmp_path, "llama")
    with opt:
        train_step(model, opt, 0)
        opt.session.save_pretrained(tmp_path / "then")  # step 1's adapter
        job = nvoffload.start_training_checkpoint(tmp_path / "ckpt", step=1, model=model, optimizer=opt)
        train_step(model, opt, 1)  # its updates of the adapters wait for the writer
        saved = job.wait()
        opt.session.save_pretrained(tmp_path / "now")  # step 2's
    written = _files(Path(saved.path) / "model")
    assert written == _files(tmp_path / "then") and written.keys() == {"adapter_config.json", "adapter_model.safetensors"}
    assert written != _files(tmp_path / "now")  # the next step changed them
