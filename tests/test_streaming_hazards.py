"""Parameter streaming where training departs from one forward and one backward over every parameter, and
streamed parameters read outside the hooks: checked against plain torch, crashes caught in subprocesses."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import run_forked
from torch import nn

import nvoffload
from nvoffload.io import TensorStore
from nvoffload.memory import MemoryManager
from nvoffload.models import GPT, GPTConfig
from nvoffload.streaming import ParameterStreamer

MiB = 1 << 20


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


# ---------------------------------------------------------------------- training that skips or repeats
class RoutedBlock(nn.Module):
    """Two experts (one routed per step in ``expert`` mode) and a branch (skipped every third step in ``branch`` mode)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.branch = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mode: str, step: int) -> torch.Tensor:
        expert = self.experts[step % 2 if mode == "expert" else 0]
        h = x + torch.tanh(expert(self.norm(x)))
        if mode == "branch" and step % 3 == 2:
            return h
        return h + torch.tanh(self.branch(h))


class RoutedNet(nn.Module):
    def __init__(self, mode: str, d: int = 32, n_layer: int = 4):
        super().__init__()
        self.mode = mode
        self.step = 0
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(RoutedBlock(d) for _ in range(n_layer))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, self.mode, self.step)
            if self.mode == "twice":  # the same weights again, in the same forward
                h = block(h, self.mode, self.step)
        return self.out(h).square().mean()


@pytest.mark.parametrize("roomy", [False, True], ids=["tight", "roomy"])
@pytest.mark.parametrize("mode", ["expert", "branch", "twice"])
def test_parameters_without_gradients_and_blocks_run_twice_train_like_torch(tmp_path, mode, roomy):
    """An unrouted expert (no gradient every other step), a branch skipped every third step (and an expert never
    used), a block run twice per forward: same losses and weights as torch.optim.AdamW in RAM, and no block stays
    on the device after a step, with the device budget just above the smallest (tight) or ample (roomy)."""
    torch.manual_seed(0)
    ref = RoutedNet(mode)
    model = copy.deepcopy(ref)
    block = max(nbytes(b.parameters()) for b in model.blocks)
    resident = nbytes(model.inp.parameters()) + nbytes(model.out.parameters())
    config = nvoffload.OffloadConfig(
        swap_dirs=[tmp_path], cpu_memory_bytes=2 * (3 * block + MiB),
        device_memory_bytes=2 * resident + (30 if roomy else 3) * block + 4096,
    )  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)
    try:
        for step in range(7):
            ref.step = model.step = step
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            ref_loss = ref(x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            start = time.perf_counter()
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert time.perf_counter() - start < 30  # nothing waits on memory that cannot be freed
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=f"loss of step {step}")
            assert all(p.untyped_storage().nbytes() == 0 for p in model.blocks.parameters())
            assert opt.session.memory.stats()["device"].used_bytes == resident  # no block, no gradient left
        got = model.state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        opt.session.close()


def streamer_without_optimizer(tmp_path, model, device_bytes):
    store = TensorStore([tmp_path])
    memory = MemoryManager(device_memory_bytes=device_bytes, cpu_memory_bytes=64 * MiB)
    return store, memory, ParameterStreamer(model, store, memory)


def test_forward_and_backward_that_raise_leave_no_block_on_the_device(tmp_path):
    """A block whose forward raises, and a backward that raises half way, let go of their blocks: the next
    forward sees the stored weights, and the device holds only the resident parameters again."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    resident = nbytes(p for n, p in model.named_parameters() if not n.startswith("blocks."))
    store, memory, streamer = streamer_without_optimizer(tmp_path, model, 64 * MiB)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    try:

        def refuse(*_):
            raise ValueError("refused")

        handle = model.blocks[1].register_forward_pre_hook(refuse)  # after the streamer's: block 1 is on the device
        with pytest.raises(ValueError, match="refused"):
            model(x)
        handle.remove()
        handle = model.blocks[0].register_full_backward_pre_hook(refuse)
        with pytest.raises(ValueError, match="refused"):
            model(x, x).backward()  # block 1 is done, block 0 is on the device when its second pre-hook refuses
        handle.remove()
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        assert all(p.untyped_storage().nbytes() == 0 for p in model.blocks.parameters())
        model.zero_grad()  # the gradients of block 1, the head and the embeddings
        assert memory.stats()["device"].used_bytes == resident
    finally:
        streamer.close()
        store.close()


def test_backward_that_cannot_fit_raises_at_once_naming_what_holds_the_memory(tmp_path):
    """Without an optimizer that takes gradients during backward they pile up on the parameters; when the next
    block does not fit, nothing pending could free memory, so backward raises at once, naming the holders
    (it used to wait 600 s first). In a subprocess with a time limit: a wait fails the test, not the suite."""
    script = textwrap.dedent(
        """
        import sys, time, torch
        from nvoffload.io import TensorStore
        from nvoffload.memory import MemoryBudgetError, MemoryManager
        from nvoffload.models import GPT, GPTConfig
        from nvoffload.streaming import ParameterStreamer
        torch.manual_seed(0)
        cfg = GPTConfig(seq_len=64, n_layer=4, n_head=2, d_model=64)
        model = GPT(cfg)
        size = lambda ps: sum(p.numel() * p.element_size() for p in ps)
        block = max(size(b.parameters()) for b in model.blocks)
        resident = size(p for n, p in model.named_parameters() if not n.startswith("blocks."))
        memory = MemoryManager(device_memory_bytes=2 * resident + 3 * block, cpu_memory_bytes=64 << 20)
        store = TensorStore([sys.argv[1]])
        streamer = ParameterStreamer(model, store, memory)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        start = time.perf_counter()
        try:
            model(x, x).backward()
        except MemoryBudgetError as e:
            print(round(time.perf_counter() - start, 1), e)
        streamer.close()
        store.close()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )  # a wait of 600 s raises TimeoutExpired
    assert done.returncode == 0, done.stderr[-3000:]
    seconds, message = done.stdout.split(" ", 1)
    assert float(seconds) < 10
    assert "nothing that could free it is pending" in message
    assert message.startswith("parameter block 1 needs ")  # the third block of backward
    assert "bytes of gradients held by their parameters (ln_f.weight, ln_f.bias, blocks.3.fc_out.bias, " in message
    assert "0 queued for the optimizer" in message
    assert "parameter blocks on the device: " in message


# ---------------------------------------------------------------------- streamed parameters read outside the hooks
PRELUDE = """
import copy, json, sys, torch
import nvoffload
from nvoffload.models import GPT, GPTConfig
from nvoffload.streaming import StreamedParameterError

torch.manual_seed(0)
cfg = GPTConfig.preset("tiny")
ref = GPT(cfg)
model = copy.deepcopy(ref)
config = nvoffload.OffloadConfig(swap_dirs=[sys.argv[1]], device_memory_bytes=64 << 20, cpu_memory_bytes=64 << 20)
model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
streamer = opt.session.streamer
x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
y = x.roll(-1, 1)

def train_step():
    for m, o in ((ref, ref_opt), (model, opt)):
        m(x, y).backward()
        o.step()
        o.zero_grad()

def refused(fn):
    try:
        fn()
    except StreamedParameterError as e:
        return str(e)
    return None

def close(a, b):
    return torch.allclose(a, b, rtol=1e-6, atol=1e-7)

def same_as_ref(state):
    want = ref.state_dict()
    return all(close(v, want[k]) for k, v in state.items())

out = {}
train_step()
p = model.blocks[1].fc.weight
"""

ACCESS = {
    "read_between_steps": """
ema = torch.zeros_like(p)
out["sum"] = refused(lambda: p.sum())
out["ema"] = refused(lambda: ema.lerp_(p, 0.1))
out["clone"] = refused(lambda: p.detach().clone())
out["data"] = refused(lambda: p.data.add_(1))
out["print"] = repr(p)
out["deepcopy"] = refused(lambda: copy.deepcopy(model))
out["metadata"] = [list(p.shape), str(p.dtype), str(p.device), p.requires_grad, p.grad is None, p.is_leaf]
out["gather"] = close(streamer.weights.gather(p), ref.blocks[1].fc.weight.detach())
train_step()  # nothing above disturbed training
out["trained"] = same_as_ref(model.state_dict())
""",
    "read_inside_a_step": """
loss = model(x, y)  # block 1 is off the device, waiting for backward
out["sum"] = refused(lambda: p.sum())
loss.backward()
opt.step()
opt.zero_grad()
ref_loss = ref(x, y)
ref_loss.backward()
ref_opt.step()
ref_opt.zero_grad()
out["loss"] = close(loss.detach(), ref_loss.detach())
out["trained"] = same_as_ref(model.state_dict())
""",
    "model_to": """
out["same_device"] = model.to(streamer.device) is model and model.float() is model  # changes nothing: allowed
out["trained"] = same_as_ref(model.state_dict())
out["to_dtype"] = refused(lambda: model.to(torch.float64))
out["to_meta"] = refused(lambda: model.blocks.to("meta"))
""",
    "sub_module_state_dict": """
whole = model.state_dict()
block = model.blocks[1].state_dict()
fc = model.blocks[1].fc.state_dict()
out["block"] = sorted(block) == sorted(ref.blocks[1].state_dict()) and all(torch.equal(v, whole["blocks.1." + k]) for k, v in block.items())
out["fc"] = all(torch.equal(v, whole["blocks.1.fc." + k]) for k, v in fc.items())
out["values"] = same_as_ref(whole)
out["keep_vars"] = model.blocks[1].fc.state_dict(keep_vars=True)["weight"] is p
new = {k: torch.full_like(v, 0.25) for k, v in ref.blocks[0].fc.state_dict().items()}
model.blocks[0].fc.load_state_dict(new)  # a sub-module's load writes the streamed weights
ref.blocks[0].fc.load_state_dict(new)
out["loaded"] = torch.equal(streamer.weights.gather(model.blocks[0].fc.weight), new["weight"])
out["assign"] = None
try:
    model.blocks[0].fc.load_state_dict(new, assign=True)
except ValueError as e:
    out["assign"] = str(e)
train_step()
out["trained"] = same_as_ref(model.state_dict())
""",
    "after_close": """
pending = model(x, y)  # a graph whose backward needs the blocks
opt.session.close()
out["sum"] = refused(lambda: p.sum())
out["state_dict"] = refused(lambda: model.state_dict())
out["block_state_dict"] = refused(lambda: model.blocks[1].state_dict())
out["load"] = refused(lambda: model.blocks[0].load_state_dict(ref.blocks[0].state_dict()))
out["forward"] = refused(lambda: model(x, y))
out["backward"] = refused(lambda: pending.backward())
""",
}


@pytest.fixture(scope="module")
def accessed(tmp_path_factory) -> dict:
    """Each access after the prelude, in a process of its own (a crash is its exit status)."""
    root = tmp_path_factory.mktemp("access")
    runs = {}
    for name, body in ACCESS.items():
        (root / name).mkdir()
        runs[name] = (PRELUDE + body + "\nprint(json.dumps(out))\n", [root / name], root)
    return run_forked(runs)


def run_access(accessed, name: str) -> dict:
    done = accessed[name]
    assert done.returncode == 0, f"exit status {done.returncode} (negative: killed by a signal)\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


OFF_DEVICE = "parameter blocks.1.fc.weight (parameter block 1) while its block is off the device"
CLOSED = "the ParameterStreamer that held its weights is closed and they went with it"


def test_streamed_parameter_read_between_steps_is_refused_and_gather_gives_its_weights(accessed):
    out = run_access(accessed, "read_between_steps")
    for key, op in (("sum", "sum()"), ("ema", "lerp_()"), ("clone", "clone()"), ("data", "add_()")):
        assert out[key].startswith(f"{op} read {OFF_DEVICE}"), (key, out[key])
    assert out["deepcopy"].startswith("clone() read parameter blocks.0.ln_1.weight (parameter block 0) while its")
    assert "streamer.weights.gather(param)" in out["sum"]
    assert out["print"] == "Parameter containing:\n<parameter blocks.1.fc.weight (parameter block 1): off the device, shape (256, 64), torch.float32>"
    assert out["metadata"] == [[256, 64], "torch.float32", "cpu", True, True, True]
    assert out["gather"] and out["trained"]


def test_streamed_parameter_read_between_forward_and_backward_is_refused(accessed):
    out = run_access(accessed, "read_inside_a_step")
    assert out["sum"].startswith(f"sum() read {OFF_DEVICE}")
    assert out["loss"] and out["trained"]


def test_model_to_that_would_read_streamed_weights_is_refused(accessed):
    out = run_access(accessed, "model_to")
    assert out["same_device"] and out["trained"]
    assert "to() (moving or converting, as model.to() does) of parameter blocks.0." in out["to_dtype"]
    assert "to() (moving or converting, as model.to() does) of parameter blocks.0." in out["to_meta"]


def test_state_dict_of_any_sub_module_gives_the_current_weights_and_load_writes_them(accessed):
    out = run_access(accessed, "sub_module_state_dict")
    assert out["block"] and out["fc"] and out["values"] and out["keep_vars"] and out["loaded"] and out["trained"]
    assert "load_state_dict(assign=True) would replace streamed parameters" in out["assign"]


def test_after_close_every_access_is_refused(accessed):
    out = run_access(accessed, "after_close")
    assert out["sum"].startswith("sum() read parameter blocks.1.fc.weight") and CLOSED in out["sum"]
    assert out["state_dict"].startswith("a module of this GPT needs streamed weights, but " + CLOSED)
    assert out["block_state_dict"].startswith("a module of this GPT needs streamed weights, but " + CLOSED)
    assert out["load"].startswith("a module of this GPT needs streamed weights, but " + CLOSED)
    assert out["forward"].startswith("parameter block 0 of this GPT needs streamed weights, but " + CLOSED)
    assert out["backward"].startswith("parameter block 1 of this GPT needs streamed weights, but " + CLOSED)


def test_a_read_dispatched_to_the_guard_as_its_block_came_back_on_another_thread_reads_plainly():
    """The optimizer's worker reads a parameter's dtype while the training thread brings its block back: the
    read is dispatched to the guard's class, which the parameter has left by the time the guard looks."""
    from nvoffload.streaming import _guard

    p = nn.Parameter(torch.ones(3))
    _guard.attach(p, "w", 0)
    _guard.guard(p)
    with pytest.raises(_guard.StreamedParameterError, match="sum"):
        p.sum()
    dispatch = _guard.OffDeviceParameter.__torch_function__  # chosen while p was guarded
    _guard.unguard(p)  # meanwhile, on the other thread
    assert dispatch(torch.Tensor.dtype.__get__, (_guard.OffDeviceParameter,), (p,)) is torch.float32
    assert float(dispatch(torch.Tensor.sum, (_guard.OffDeviceParameter,), (p,)).detach()) == 3.0
    with pytest.raises(_guard.StreamedParameterError, match="read a streamed parameter that is off the device"):
        dispatch(torch.Tensor.sum, (_guard.OffDeviceParameter,), ([torch.ones(1)],))  # no parameter to be found
