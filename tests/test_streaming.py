"""Parameter streaming through all three tiers, checked against the same model trained without offload."""

from __future__ import annotations

import copy
import errno
import json
import re
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from conftest import SCRIPT_PRELOAD, fork_server, mapping_size
from torch.utils._python_dispatch import TorchDispatchMode

import nvoffload
from nvoffload.checkpoint import load_file, open_checkpoint, save_file
from nvoffload.device import SimDevice
from nvoffload.io import TensorStore
from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim import OffloadIOError
from nvoffload.streaming import ParameterStreamer, StreamingStats
from nvoffload.transfer import TransferEngine

MiB = 1 << 20


def make_pair(preset="tiny", seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(preset)
    ref = GPT(cfg)
    return cfg, ref, copy.deepcopy(ref)


def batch(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
    return x, x.roll(-1, dims=1)


def config(tmp_path, model=None, **kw):
    """Budgets just above the smallest that stream ``model``: far below its parameters and gradients."""
    if model is not None:
        block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
        resident = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
        activations = 4 * MiB if kw.get("offload_activations") else 0  # their transfers' share of the host budget
        kw = {
            "device_memory_bytes": 2 * resident + 3 * block + MiB,
            "cpu_memory_bytes": 2 * (3 * block + MiB + activations),  # half is the optimizer's
            "activation_memory_bytes": activations or None,
            **kw,
        }
    return nvoffload.OffloadConfig(swap_dirs=[tmp_path], **kw)


@pytest.mark.parametrize("offload_activations", [False, True])
def test_twenty_steps_match_training_without_offload(tmp_path, offload_activations):
    cfg, ref, model = make_pair("small")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    model, opt = nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        config(tmp_path, model, offload_activations=offload_activations),
    )  # fmt: skip
    session = opt.session
    if offload_activations:  # the activation transfers draw on the host budget
        assert session._activations.config.max_pending_write_bytes == session._activations.config.prefetch_bytes == 2 * MiB
        assert session.memory.stats()["host"].used_bytes >= session.config.cpu_memory_bytes // 2 + 4 * MiB
    # One mapping of exactly the host budget, carved between the engines' transfer engines.
    assert mapping_size(session.slab.address) <= session.config.cpu_memory_bytes
    assert set(session.transfers) == {"optimizer", "streamer"} | ({"activations"} if offload_activations else set())
    carves = sorted((t.slab.address, t.slab.capacity_bytes) for t in session.transfers.values())
    assert session.slab.address <= carves[0][0] and sum(n for _, n in carves) <= session.slab.capacity_bytes
    assert all(a + n <= b for (a, n), (b, _) in zip(carves, carves[1:]))  # disjoint
    assert session.streamer.transfer is session.transfers["streamer"]
    assert len({id(t.device) for t in session.transfers.values()}) == 1  # one set of copy streams
    if offload_activations:
        assert session._activations._transfer is session.transfers["activations"]
    block_bytes = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    assert session.memory.limit_bytes("device") < sum(p.numel() * 4 for p in model.parameters()) * 2
    try:
        for step in range(20):
            x, y = batch(cfg, step)
            ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            session.reset_stats()
            loss = model(x, y)
            loss.backward()
            assert all(p.grad is None for p in model.parameters())  # consumed during backward
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            stats = session.memory_stats()
            assert stats["device"].peak_bytes <= stats["device"].limit_bytes
            assert stats["host"].peak_bytes <= stats["host"].limit_bytes
            # streamed blocks leave the device after each pass: only resident parameters stay
            assert stats["device"].used_bytes < block_bytes + sum(p.numel() * 4 for p in model.tok_emb.parameters())
            assert all(p.untyped_storage().nbytes() == 0 for p in model.blocks.parameters())
        got = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert session.store.used_bytes > 0
    finally:
        session.close()
    with pytest.raises(LookupError):  # the slab is unmapped
        mapping_size(session.slab.address)


def test_eval_and_no_grad_inference_and_load_state_dict(tmp_path):
    cfg, ref, model = make_pair()
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model))
    try:
        x, _ = batch(cfg, 0)
        model.eval()
        ref.eval()
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        new = {k: v + 0.5 for k, v in ref.state_dict().items()}
        model.load_state_dict(new)
        ref.load_state_dict(new)
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        assert torch.equal(model.state_dict()["blocks.0.fc.weight"], new["blocks.0.fc.weight"])
    finally:
        opt.session.close()


def test_meta_model_is_built_block_by_block(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig.preset("small")
    with torch.device("meta"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = nvoffload.initialize(model, opt, config(tmp_path, model), param_init_fn=model.init_weights)
    try:
        assert not any(p.is_meta for p in model.parameters())
        assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
        w = model.state_dict()["blocks.1.fc.weight"]
        assert 0.015 < float(w.std()) < 0.025  # the model's own init, not garbage
        x, y = batch(cfg, 0)
        losses = []
        for _ in range(5):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert losses[-1] < losses[0] - 0.5
    finally:
        opt.session.close()


def test_budget_smaller_than_a_block_names_the_smallest_that_works(tmp_path):
    _, _, model = make_pair()
    with pytest.raises(MemoryBudgetError, match=r"device_memory_bytes must be at least \d+"):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, device_memory_bytes=4096))
    for activations in (False, True):  # the host budget named is the smallest that works (to the MiB)
        _, _, model = make_pair()  # a model stays streamed by the session that took it, even once closed
        kw = {"offload_activations": True, "activation_memory_bytes": 4 * MiB} if activations else {}
        short = 8 * MiB + 65536 if activations else 65536  # a few pages for parameter streaming
        with pytest.raises(MemoryBudgetError, match=r"streaming needs at least \d+.*cpu_memory_bytes must be at least") as info:
            nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, cpu_memory_bytes=short, **kw))
        smallest = int(re.search(r"cpu_memory_bytes must be at least (\d+)", str(info.value)).group(1))
        with pytest.raises(MemoryBudgetError, match="streaming needs at least"):
            nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, cpu_memory_bytes=smallest - MiB, **kw))
        _, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, cpu_memory_bytes=smallest, **kw))
        opt.close()
    with pytest.raises(MemoryBudgetError, match=r"leaves nothing for parameter streaming's host memory"):
        nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters()),
            config(tmp_path, model, offload_activations=True, cpu_memory_bytes=8 * MiB, activation_memory_bytes=4 * MiB),
        )  # fmt: skip
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_more_backward_passes_than_gradient_accumulation_steps_are_refused(tmp_path):
    cfg, _, model = make_pair()
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model))
    try:
        x, y = batch(cfg, 0)
        model(x, y).backward()
        opt.step()
        model(x, y).backward()
        with pytest.raises(RuntimeError, match="backward ran 2 times .* gradient_accumulation_steps is 1"):
            model(x, y).backward()  # a second micro-batch: the update already ran
    finally:
        opt.session.close()


def test_bad_config():
    with pytest.raises(ValueError, match="at least one swap directory"):
        nvoffload.OffloadConfig(swap_dirs=[])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        nvoffload.OffloadConfig(swap_dirs=["/nonexistent/nvme"])
    with pytest.raises(ValueError, match="cpu_memory_bytes"):
        nvoffload.OffloadConfig(swap_dirs=["/tmp"], cpu_memory_bytes=0)
    with pytest.raises(ValueError, match="optimizer_memory_fraction"):
        nvoffload.OffloadConfig(swap_dirs=["/tmp"], optimizer_memory_fraction=1.5)
    with pytest.raises(ValueError, match="unknown memory tier"):
        MemoryManager(device_memory_bytes=1, cpu_memory_bytes=1).allocate("gpu", 1, "x")


def test_memory_manager_refuses_past_the_budget():
    mm = MemoryManager(device_memory_bytes=100, cpu_memory_bytes=100)
    mm.allocate("device", 60, "a")
    with pytest.raises(MemoryBudgetError, match="b needs 50 bytes of device memory"):
        mm.allocate("device", 50, "b")
    mm.track("device", 50)  # gradients are counted, never refused
    assert mm.stats()["device"].peak_bytes == 110
    mm.free("device", 110)
    mm.reset_peaks()
    assert mm.stats()["device"].peak_bytes == 0


def test_scale_benchmark_smoke(tmp_path):
    """The scale benchmark, on the small preset with budgets smaller than its state: loss falls, budgets hold."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "bench_streaming.py"
    args = ["--quick", "--trace", "--bound", "--results-dir", tmp_path, "--swap-dir", tmp_path]
    done = fork_server(SCRIPT_PRELOAD).run(bench, args, timeout=300)  # as python BENCH: forked, torch imported once
    assert done.returncode == 0, done.stderr[-3000:]
    from test_trace import check_trace_events

    tracks = check_trace_events(tmp_path / "bench_streaming_trace.json")  # the last step's trace, and its timeline
    assert {"compute", "nvme read", "nvme write", "adam"} <= set(tracks)
    assert (tmp_path / "bench_streaming_trace.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "bench_streaming.json").read_text())
    alone = [r for r in report["rows"] if r["case"].startswith("compute alone")]
    rows = [r for r in report["rows"] if r not in alone]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["case"].endswith("(traced)")
    # --bound: compute alone (no optimizer: its loss stays), and each step after the first against the bound
    assert len(alone) == 3 and alone[0]["loss"] == alone[-1]["loss"] and all(r["step_s"] > 0 for r in alone)
    compute_s = statistics.median(r["step_s"] for r in alone[1:])
    for r in rows[1:]:
        assert r["nvme_bound_s"] > 0 and r["vs_bound"] == pytest.approx(r["step_s"] / max(compute_s, r["nvme_bound_s"]))
    assert "Bounds, measured in this run" in report["notes"]
    settings = report["settings"]
    assert all(r["device_peak_gib"] * (1 << 30) <= settings["device_memory_bytes"] for r in rows)
    assert all(r["host_peak_gib"] * (1 << 30) <= settings["cpu_memory_bytes"] for r in rows)
    assert settings["state_vs_host_budget"] > 1


def meta_gpt(cfg):
    with torch.device("meta"):
        return GPT(cfg)


def test_meta_model_loaded_from_a_safetensors_checkpoint(tmp_path):
    cfg, ref, _ = make_pair("small")
    path = tmp_path / "model.safetensors"
    save_file(ref.state_dict(), path)
    model = meta_gpt(cfg)
    with open_checkpoint(path) as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), config(tmp_path, model), checkpoint=ckpt
        )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    try:
        got = model.state_dict()
        assert got.keys() == ref.state_dict().keys()
        for name, value in ref.state_dict().items():
            assert torch.equal(got[name], value), name
        for step in range(3):  # and it trains like the original
            x, y = batch(cfg, step)
            ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        # the trained weights written one tensor at a time, read back by an ordinary model
        out = tmp_path / "trained.safetensors"
        opt.session.save_checkpoint(out, metadata={"step": "3"})
        saved = load_file(out)
        assert saved.keys() == ref.state_dict().keys()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6, msg=name)
        with open_checkpoint(out) as ckpt:
            assert ckpt.metadata == {"step": "3"}
    finally:
        opt.session.close()


def test_checkpoint_of_another_dtype_is_converted(tmp_path):
    cfg, ref, _ = make_pair()
    path = tmp_path / "bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}, path)
    model = meta_gpt(cfg)
    with open_checkpoint(path) as ckpt:
        model, opt = nvoffload.initialize(
            model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), checkpoint=ckpt
        )
    try:
        for name, value in model.state_dict().items():
            assert value.dtype == torch.float32
            assert torch.equal(value, ref.state_dict()[name].to(torch.bfloat16).float()), name
    finally:
        opt.session.close()


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda sd: sd.pop("blocks.1.fc.weight"), KeyError, r"missing blocks\.1\.fc\.weight"),
        (lambda sd: sd.update(extra=torch.zeros(2)), KeyError, r"unexpected extra"),
        (lambda sd: sd.update({"ln_f.weight": torch.zeros(3)}), ValueError, r"'ln_f.weight' has shape \(3,\)"),
    ],
)
def test_checkpoint_that_does_not_match_the_model(tmp_path, edit, error, match):
    cfg, ref, _ = make_pair()
    sd = dict(ref.state_dict())
    edit(sd)
    path = tmp_path / "bad.safetensors"
    save_file(sd, path)
    model = meta_gpt(cfg)
    with open_checkpoint(path) as ckpt, pytest.raises(error, match=match):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), checkpoint=ckpt)


def test_checkpoint_needs_a_meta_model(tmp_path):
    cfg, ref, model = make_pair()
    path = tmp_path / "model.safetensors"
    save_file(ref.state_dict(), path)
    with open_checkpoint(path) as ckpt, pytest.raises(ValueError, match="built on the meta device"):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model), checkpoint=ckpt)


# glibc's heap statistics, for the scripts below (each in a fresh interpreter: the settings are process-wide)
_MALLINFO = """
import ctypes, torch

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_retain_freed_host_memory_serves_large_blocks_from_the_heap():
    script = _MALLINFO + """
from nvoffload.memory import retain_freed_host_memory
def mapped_bytes_of(nbytes):
    t = torch.empty(nbytes, dtype=torch.uint8)
    return libc.mallinfo2().hblkhd
before = mapped_bytes_of(100 << 20)
assert retain_freed_host_memory() and retain_freed_host_memory()
after = mapped_bytes_of(100 << 20)
print(before >= 100 << 20, after < 100 << 20)
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["True", "True"]  # its own mapping by default; from the heap after the call


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_release_freed_host_memory_maps_large_blocks_and_stops_the_threshold_rising():
    script = _MALLINFO + """
from nvoffload.memory import release_freed_host_memory
def mapped(nbytes):
    base = libc.mallinfo2().hblkhd
    t = torch.empty(nbytes, dtype=torch.uint8)
    return libc.mallinfo2().hblkhd - base >= nbytes
mapped(16 << 20)  # freed: glibc raises its threshold to 16 MiB
before = mapped(8 << 20)
assert release_freed_host_memory()
print(before, mapped(32 << 20), mapped(24 << 20), mapped(512 << 10))
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    # From the heap by default (the threshold rose). After the call: mapped (sizes no free heap chunk can hold),
    # and the threshold no longer rises when the 32 MiB mapping is freed; small blocks from the heap.
    assert out.split() == ["False", "True", "True", "False"]


def test_the_streamers_counters_are_one_snapshot_zeroed_together(tmp_path):
    """``stats()`` gathers the store bytes from the host cache and the waits from the residency as one frozen
    snapshot: each block written once when it is stored, each read once by a forward whose host cache holds three
    of its six blocks; ``reset_stats()`` zeroes all four and leaves a snapshot taken before as it was."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, d_model=64, seq_len=16))
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    memory = MemoryManager(device_memory_bytes=64 * MiB, cpu_memory_bytes=3 * block + (64 << 10))
    with TensorStore([tmp_path]) as store:
        streamer = ParameterStreamer(model, store, memory)
        try:
            built = streamer.stats()
            assert (built.bytes_read, built.bytes_written) == (0, 6 * block)  # each block stored once
            streamer.reset_stats()
            assert streamer.stats() == StreamingStats(bytes_read=0, bytes_written=0, io_wait_s=0.0, grad_wait_s=0.0)
            assert built.bytes_written == 6 * block  # a snapshot: reset_stats() does not reach it
            with torch.no_grad():
                model(torch.zeros(1, 16, dtype=torch.long))
            assert (streamer.stats().bytes_read, streamer.stats().bytes_written) == (6 * block, 0)  # each read once
        finally:
            streamer.close()


# ---------------------------------------------------------------------- double buffering on the transfer engine
@pytest.fixture
def slow_streamer(tmp_path):
    """``make(model, device_bytes)``: a streamer without optimizer on a stand-in whose copies land 100 ms after
    they are issued, with a device budget of ``device_bytes`` and room for every block in host memory."""
    device = SimDevice(copy_delay_us=100_000)
    engine = TransferEngine(32 * MiB, device)
    store = TensorStore([tmp_path])
    made = []

    def make(model, device_bytes=64 * MiB):
        memory = MemoryManager(device_memory_bytes=device_bytes, cpu_memory_bytes=64 * MiB)
        made.append(ParameterStreamer(model, store, memory, transfer=engine))
        return made[-1]

    yield make
    for streamer in made:
        streamer.close()
    assert not engine._closed  # the streamer does not close an engine it was given
    store.close()
    engine.close()
    device.close()


@pytest.mark.parametrize("wait", [False, True], ids=["wait-removed", "waits"])
def test_compute_waits_for_each_blocks_copy(slow_streamer, monkeypatch, wait):
    """With copies that land late, the streamed forward equals torch bitwise; with the engine's wait made a
    no-op it reads blocks before their copies landed and gives another result."""
    # weights no other test has, so that no freed memory the blocks' device storage reuses holds them already
    cfg, ref, model = make_pair(seed=7)
    if not wait:
        monkeypatch.setattr(TransferEngine, "wait", lambda self, future: None)
    slow_streamer(model)
    x, _ = batch(cfg, 0)
    with torch.no_grad():
        got, want = model(x), ref(x)
    assert torch.equal(got, want) == wait


def train_step_in_order(streamer, model, ref, cfg, monkeypatch) -> tuple[list, list]:
    """One forward and backward of ``model``, checked against ``ref``; the order in which the forward and the
    backward issued each block's copy to the device ("copy", i) and ran each block ("forward", i: its forward
    begins; "backward", i: its backward ended: the streamer's per-call backward hooks run inside a module's own,
    so a module backward pre-hook would come before the streamer's)."""
    log = []
    to_device = streamer.transfer.to_device

    def logged(dst, src, **kw):
        log.append(("copy", int(kw["what"].rsplit(" ", 1)[1])))
        return to_device(dst, src, **kw)

    monkeypatch.setattr(streamer.transfer, "to_device", logged)  # blocks are all cached: the hooks issue the copies
    handles = []
    for i, block in enumerate(model.blocks):  # after the streamer's forward hooks; backward: when the block is done
        handles.append(block.register_forward_pre_hook(lambda *_, i=i: log.append(("forward", i))))
        handles.append(block.register_full_backward_hook(lambda *_, i=i: log.append(("backward", i))))
    x, y = batch(cfg, 0)
    loss = model(x, y)
    end_of_forward = len(log)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    for handle in handles:
        handle.remove()
    return log[:end_of_forward], log[end_of_forward:]


def double_buffered(order: list[int], kind: str) -> list:
    """The events when each block's copy is issued before the block before it in ``order`` computes."""
    events = [("copy", order[0])]
    for i, block in enumerate(order):
        events += [("copy", order[i + 1])] if i + 1 < len(order) else []
        events.append((kind, block))
    return events


def test_next_blocks_copy_is_issued_before_this_block_computes(slow_streamer, monkeypatch):
    """Double buffering, shown by the order of events: block i+1's copy to the device is issued before block i
    computes its forward, block i-1's before block i computes its backward; the last block, which backward
    needs first, stays on the device after its forward."""
    cfg, ref, model = make_pair("small")
    forward, backward = train_step_in_order(slow_streamer(model), model, ref, cfg, monkeypatch)
    order = list(range(len(model.blocks)))
    assert forward == double_buffered(order, "forward")
    assert backward == double_buffered(order[::-1], "backward")[1:]


def test_next_block_is_copied_ahead_only_when_the_device_budget_has_room(slow_streamer, monkeypatch):
    """With room for two blocks beside the resident parameters but not for their gradients too, the forward
    copies each next block ahead and the backward copies each block when it needs it (but the last, which
    stayed from forward), within the budget."""
    cfg, ref, model = make_pair()
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    resident = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    streamer = slow_streamer(model, device_bytes=2 * resident + 4 * block)
    forward, backward = train_step_in_order(streamer, model, ref, cfg, monkeypatch)
    order = list(range(len(model.blocks)))
    assert forward == double_buffered(order, "forward")
    assert backward == [e for i in order[::-1] for e in [("copy", i), ("backward", i)]][1:]  # each when needed
    assert streamer.memory.stats()["device"].peak_bytes <= streamer.memory.limit_bytes("device")


# ---------------------------------------------------------------------- on a GPU
class H2DCopies(TorchDispatchMode):
    """Records the CUDA stream current at every copy from host memory to the GPU (in backward too: autograd
    carries the mode to its threads)."""

    def __init__(self):
        super().__init__()
        self.streams = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].is_cuda and args[1].device.type == "cpu":
            self.streams.append(torch.cuda.current_stream(args[0].device))
        return func(*args, **(kwargs or {}))


@pytest.mark.cuda
@pytest.mark.parametrize("device", [None, "cuda"], ids=["model's-device", "named-cuda"])
@pytest.mark.parametrize("roomy", [True, False], ids=["roomy", "tight"])
def test_cuda_streamed_forward_and_backward_match_torch_with_copies_on_the_copy_stream(tmp_path, roomy, device):
    """On a GPU: the streamed forward and backward give torch's loss and gradients, and every copy of a block to
    the GPU runs on the transfer engine's host-to-device stream, never on the compute stream; with the device
    budget roomy (copies ahead in forward and backward) or tight (ahead in forward only), and the device taken
    from the model (``cuda:0``) or named without its index (``"cuda"``, the same device)."""
    cfg, ref, model = make_pair("small" if roomy else "tiny")
    ref, model = ref.cuda(), model.cuda()
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    resident = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    device_bytes = 64 * MiB if roomy else 2 * resident + 4 * block
    memory = MemoryManager(device_memory_bytes=device_bytes, cpu_memory_bytes=64 * MiB)
    with TensorStore([tmp_path]) as store:
        streamer = ParameterStreamer(model, store, memory, device=device)
        try:
            copy_stream = streamer.transfer.device.copy_stream("h2d")._stream
            x, y = (t.cuda() for t in batch(cfg, 0))
            with H2DCopies() as copies:
                loss = model(x, y)
                loss.backward()
            ref_loss = ref(x, y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            # each block in forward and in backward, but the last: it stays on the device from its forward
            assert len(copies.streams) == 2 * len(model.blocks) - 1
            assert all(s == copy_stream for s in copies.streams)
        finally:
            streamer.close()


@pytest.mark.cuda
@pytest.mark.parametrize("defer", [False, True], ids=["speculative", "deferred"])
def test_cuda_initialize_trains_like_torch_from_one_page_locked_slab(tmp_path, defer):
    """On a GPU, all three tiers through initialize(): five steps give torch's fused AdamW losses and weights,
    and the host budget is one page-locked slab whose carves the three transfer engines copy through; deferred,
    each block's copy to the device follows its update, queued by the step before."""
    cfg, ref, model = make_pair("small")
    ref, model = ref.cuda(), model.cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    model, opt = nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        config(tmp_path, model, offload_activations=True, defer_updates=defer),
    )  # fmt: skip
    session = opt.session
    try:
        assert session.slab.page_locked and mapping_size(session.slab.address) <= session.config.cpu_memory_bytes
        assert {t.device.device.type for t in session.transfers.values()} == {"cuda"}
        for step in range(5):
            x, y = (t.cuda() for t in batch(cfg, step))
            ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        assert session._activations.stats().bytes_written > 0
        assert opt.defers_updates == defer
        got = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got[name].cuda(), value, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        session.close()


def test_initialize_twice_on_one_model_is_refused(tmp_path):
    cfg, _, model = make_pair()
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model))
    try:
        with pytest.raises(ValueError, match="already streamed by an nvoffload session: close that one first"):
            nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model))
        x, y = batch(cfg, 0)
        model(x, y).backward()  # the first session is untouched
        opt.step()
    finally:
        opt.close()


def test_a_cuda_device_not_usable_here_is_refused_before_writing_anything(tmp_path):
    """No GPU, or an index past the last GPU: ``initialize`` and ``ParameterStreamer`` refuse with the reason
    (not torch's assertion from deep inside), and leave the swap directory empty."""
    bad = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    reason = r"this machine has \d+ CUDA GPU" if torch.cuda.is_available() else "no CUDA GPU is usable here"
    cfg, _, model = make_pair()
    with pytest.raises(ValueError, match=rf"device {bad}: {reason}"):
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, device=bad))
    assert not any(tmp_path.iterdir())
    memory = MemoryManager(device_memory_bytes=64 * MiB, cpu_memory_bytes=64 * MiB)
    with TensorStore([tmp_path]) as store, pytest.raises(ValueError, match=rf"device {bad}: {reason}"):
        ParameterStreamer(model, store, memory, device=bad)
    assert not any(tmp_path.iterdir())


def test_initialize_checks_free_space_before_writing_anything(tmp_path, monkeypatch):
    import shutil

    cfg, _, model = make_pair()
    real = shutil.disk_usage
    monkeypatch.setattr("nvoffload.io.store.shutil.disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(OSError, match=r"needs \d+ bytes for the weights \(\d+ bytes\) and the optimizer state") as info:
        nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model))
    assert info.value.errno == errno.ENOSPC
    assert not list(tmp_path.iterdir())  # it started, then failed in step 0, before


def _train_around_step_2(tmp_path, name, cfg, ref, model, steps, fail=None, check_forward=False):
    """Train ``model`` streamed for ``steps`` steps; step 2 runs ``fail(model, opt, x, y)`` (skipped when None).
    Returns the other steps' losses and the final state; ``check_forward``: the forward equals the state_dict's."""
    (tmp_path / name).mkdir()
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config(tmp_path / name, model))
    losses = []
    try:
        for step in range(steps):
            x, y = batch(cfg, step)
            if step == 2:
                if fail is not None:
                    fail(model, opt, x, y)
                continue  # no zero_grad(), no step(): the loop just goes on
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if check_forward:
            check = copy.deepcopy(ref)
            check.load_state_dict(state)
            x, y = batch(cfg, 99)
            with torch.no_grad():
                assert float(model(x, y)) == float(check(x, y))  # the forward is the state_dict's
        return losses, state
    finally:
        opt.close()


def _assert_same_training(got, want):
    assert got[0] == want[0]
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k


@pytest.mark.parametrize(
    "fault, after_ops",
    [("eio", 0), ("eio", 3), ("eio", 10), ("eio", 30), ("enospc", 0), ("enospc", 5), ("short_read", 0)],
    ids=lambda v: str(v),
)
def test_an_io_error_mid_step_leaves_the_step_undone_and_training_exact(tmp_path, fault, after_ops):
    """One EIO in step 2 (an optimizer read, a block written back in forward, the update's writes, by when it
    comes): that step raises, the model's forward agrees with its state_dict(), and the next steps train exactly
    as a run that never took step 2 (a fault in forward used to leave the model silently diverged)."""
    cfg, ref, model = make_pair("small")

    def fail(m, opt, x, y):
        opt.session.store.inject_fault(fault, after_ops=after_ops)
        with pytest.raises((OSError, OffloadIOError), match=r"Errno|short"):  # the store's, or step()'s
            m(x, y).backward()
            opt.step()

    faulty = _train_around_step_2(tmp_path, "faulty", cfg, ref, model, 6, fail, check_forward=True)
    skipped = _train_around_step_2(tmp_path, "skipped", cfg, ref, copy.deepcopy(ref), 6, check_forward=True)
    _assert_same_training(faulty, skipped)


def _watch_gradients(model) -> list:
    """Weak references to the gradients autograd makes in ``model`` from now on, taken before any hook of the
    optimizer's (those take each gradient from its parameter)."""
    made = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: made.append(weakref.ref(p.grad)))
    return made


def _alive_after(made: list, timeout_s: float) -> int:
    """How many of ``made``'s gradients are still alive once they all died, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(ref() is not None for ref in made) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sum(ref() is not None for ref in made)


@pytest.mark.parametrize("fault", [None, "eio"])
def test_no_gradient_outlives_its_update_while_the_optimizer_waits(tmp_path, fault):
    """After backward, with nothing more asked of the optimizer, every gradient it took is freed, also the one
    of an update that failed: the worker held the last request it ran (and a failed one's frames held its
    gradient) until the next came, while a backward short of device memory waited for exactly that memory,
    a minute, then raised MemoryBudgetError."""
    cfg, ref, model = make_pair("small")
    made = _watch_gradients(model)
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config(tmp_path, model))
    try:
        for step in range(2):
            made.clear()
            x, y = batch(cfg, step)
            loss = model(x, y)
            if fault is not None and step == 1:
                opt.session.store.inject_fault(fault)  # the first read of an update in this backward fails
            loss.backward()
            assert len(made) == len(list(model.parameters()))
            assert _alive_after(made, timeout_s=60) == 0
            if fault is not None and step == 1:
                with pytest.raises(OffloadIOError, match="Errno"):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
    finally:
        opt.close()


def test_a_backward_that_raises_midway_is_undone_by_the_next_forward(tmp_path):
    """Blocks 3 and 2 had their updates applied when backward raised in block 1: the next iteration (no step(),
    no zero_grad()) starts from the last step's weights and trains exactly as a run without that iteration
    (every later iteration failed with "backward ran again" before)."""
    cfg, ref, model = make_pair("small")

    def boom(module, grad_input, grad_output):
        raise RuntimeError("a failure in backward")

    def fail(m, opt, x, y):
        handle = m.blocks[1].register_full_backward_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="a failure in backward"):
                m(x, y).backward()
        finally:
            handle.remove()

    failed = _train_around_step_2(tmp_path, "failed", cfg, ref, model, 5, fail)
    skipped = _train_around_step_2(tmp_path, "skipped", cfg, ref, copy.deepcopy(ref), 5)
    _assert_same_training(failed, skipped)


def test_initialize_asks_no_disk_for_state_resident_in_host_memory(tmp_path, monkeypatch):
    """With a host budget that keeps the optimizer state resident, the free-space check asks for the weights and
    the spare room only: the state never reaches the store (it asked for two generations of all of it)."""
    import shutil

    from nvoffload.io.store import spare_bytes

    cfg, ref, model = make_pair()
    weights = sum(p.numel() * 4 for p in model.parameters())
    state = 12 * sum(p.numel() for p in model.parameters())  # one generation of exact AdamW's fp32 rows
    free = weights + spare_bytes(weights) + state  # room for one generation, not the two the store would hold
    real = shutil.disk_usage
    monkeypatch.setattr("nvoffload.io.store.shutil.disk_usage", lambda p: real(p)._replace(free=free))
    roomy = config(tmp_path, model, cpu_memory_bytes=64 * MiB)
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), roomy)
    try:
        x, y = batch(cfg, 0)
        model(x, y).backward()
        opt.step()
        assert opt.memory_stats().resident_state_bytes == state  # every chunk's state stayed in host memory
        swap = sum(f.stat().st_size for f in tmp_path.glob("*.swap"))
        assert swap < weights + state  # the store holds the weights, not the state
    finally:
        opt.close()
