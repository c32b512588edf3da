"""OffloadOptimizer / NVMeAdamW against torch's optimizers, with the state in a real TensorStore."""

import concurrent.futures
import copy
import errno
import io
import re
import threading
import time

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from nvoffload.io import TensorStore
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim import CPUAdamW
from nvoffload.optim.offload import NVMeAdamW, OffloadIOError, OffloadOptimizer

CHUNK = 4096 * 4  # 4096 fp32 elements: several chunks per weight


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 8)
        self.unused = nn.Linear(8, 8)  # never gets a gradient
        self.frozen = nn.Parameter(torch.randn(64), requires_grad=False)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x))) + self.frozen))


def groups(model, lr=1e-2):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr * 0.5}]


def batches(n, shape=(16, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randn(shape[0], 8, generator=g)) for _ in range(n)]


def train(model, opt, data, *, accum=1, clip=None, sched=None, loss_fn=None):
    loss_fn = loss_fn or (lambda m, x, y: (m(x) - y).square().mean())
    for i in range(0, len(data), accum):
        for x, y in data[i : i + accum]:
            (loss_fn(model, x, y) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(a, b, **tol):
    for x, y in zip(params(a), params(b)):
        if tol:
            torch.testing.assert_close(x, y, **tol)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("accum,clip", [(1, None), (2, None), (1, 0.5)])
def test_mlp_matches_adamw(tmp_path, accum, clip):
    torch.manual_seed(0)
    ref, fused, off = MLP(), None, None
    fused, off = copy.deepcopy(ref), copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2)
    opt_fused = CPUAdamW(groups(fused), lr=1e-2)
    opt = OffloadOptimizer(torch.optim.AdamW(groups(off), lr=1e-2), swap_dir=tmp_path, chunk_bytes=CHUNK)
    sched = [torch.optim.lr_scheduler.StepLR(o, 10, 0.5) for o in (opt_ref, opt_fused, opt)]
    data = batches(50 * accum)
    with opt:
        for m, o, s in zip((ref, fused, off), (opt_ref, opt_fused, opt), sched):
            train(m, o, data, accum=accum, clip=clip, sched=s)
        assert opt.param_groups[1]["lr"] == opt_ref.param_groups[1]["lr"]
        assert opt.overlap_active == (clip is None)  # the user's clipping is noticed
        stats = opt.memory_stats()
        assert 0 < stats.host_peak_bytes <= stats.host_limit_bytes
    assert_params_equal(off, fused)  # same kernel: bit for bit
    assert_params_equal(off, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(off.unused.weight, ref.unused.weight)


def test_odd_sizes_match_fused_adamw_bit_for_bit(tmp_path):
    # Every parameter ends in a partial vector of torch's fused kernel (numel % 8 = 5, 1, 3, 3), the first
    # across two chunks: the kernel rounds those last elements as torch does, whatever chunk holds them.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(13, 401), nn.Tanh(), nn.Linear(401, 3))
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    data = batches(6, shape=(16, 13))
    loss_fn = lambda m, x, y: (m(x) - y[:, :3]).square().mean()  # noqa: E731
    with OffloadOptimizer(torch.optim.AdamW(groups(model), lr=1e-2), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        assert len(opt._records[0].chunks) == 2
        train(model, opt, data, loss_fn=loss_fn)
    train(ref, opt_ref, data, loss_fn=loss_fn)
    assert_params_equal(model, ref)


def gpt_data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (2, 33), generator=g),) * 2 for _ in range(n)]


def gpt_loss(m, x, y):
    return m(x[:, :-1], y[:, 1:])


def gpt_groups(model, extra):
    """Matrices, embeddings (own betas) and vectors (own lr) plus ``extra``, a parameter that never gets a gradient."""
    named = dict(model.named_parameters())
    return [
        {"params": [p for n, p in named.items() if p.dim() >= 2 and "emb" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if "emb" in n], "weight_decay": 0.05, "betas": (0.8, 0.95)},
        {"params": [p for n, p in named.items() if p.dim() < 2] + [extra], "weight_decay": 0.0, "lr": 1e-3},
    ]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_gpt_matches_adamw(tmp_path, clip):
    """Three groups, an LR schedule, two micro-batches per step, a frozen parameter, one without gradient and,
    with ``clip``, the user's clip_grad_norm_ between backward and step(): bit for bit with torch's AdamW."""
    torch.manual_seed(0)
    off = GPT(GPTConfig.preset("tiny"))
    off.pos_emb.weight.requires_grad_(False)
    ref = copy.deepcopy(off)
    extra_off = nn.Parameter(torch.randn(300))
    extra_ref = copy.deepcopy(extra_off)
    # torch's fused CPU AdamW rounds exactly like the native kernel; its
    # single-tensor path can be an ulp off (MKL's sqrt), which many steps amplify.
    opt_ref = torch.optim.AdamW(gpt_groups(ref, extra_ref), lr=3e-3, fused=True)
    frozen_before = off.pos_emb.weight.detach().clone()
    data = gpt_data(30)
    with OffloadOptimizer(torch.optim.AdamW(gpt_groups(off, extra_off), lr=3e-3), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        for m, o in ((off, opt), (ref, opt_ref)):
            sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s)
            train(m, o, data, accum=2, clip=clip, sched=sched, loss_fn=gpt_loss)
        assert opt.overlap_active == (clip is None)
        assert opt.param_groups[2]["lr"] == opt_ref.param_groups[2]["lr"] < 1e-3
        state = opt.state_dict()["state"]
        assert set(state) == set(opt_ref.state_dict()["state"])  # nothing for the frozen and the unused one
    assert_params_equal(off, ref)
    assert torch.equal(off.pos_emb.weight, frozen_before) and torch.equal(extra_off, extra_ref)


def test_gpt_max_grad_norm(tmp_path):
    """max_grad_norm clips as torch.nn.utils.clip_grad_norm_ before torch's AdamW."""
    torch.manual_seed(0)
    clipped = GPT(GPTConfig.preset("tiny"))
    ref = copy.deepcopy(clipped)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    data = gpt_data(20)
    with NVMeAdamW(clipped.parameters(), lr=3e-3, weight_decay=0.1, swap_dir=tmp_path, chunk_bytes=CHUNK, max_grad_norm=0.1) as opt:
        train(clipped, opt, data, loss_fn=gpt_loss)
        assert not opt.overlap_active
    train(ref, opt_ref, data, loss_fn=gpt_loss, clip=0.1)
    assert_params_equal(clipped, ref)


def train_fp32_master(model, master, opt, data, loss_fn):
    """The reference mixed-precision loop: fp32 master weights, a low-precision model, one micro-batch per step."""
    for x, y in data:
        loss_fn(model, x, y).float().backward()
        for m, p in zip(master, model.parameters()):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_equals_fp32_master_loop(tmp_path, dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    ref = copy.deepcopy(model)
    master = [p.detach().float() for p in ref.parameters()]
    opt_ref = torch.optim.AdamW([{"params": master[:4]}, {"params": master[4:], "weight_decay": 0.0}], lr=1e-2, fused=True)
    opt = OffloadOptimizer(
        CPUAdamW([{"params": list(model.parameters())[:4]}, {"params": list(model.parameters())[4:], "weight_decay": 0.0}], lr=1e-2),
        swap_dir=tmp_path, chunk_bytes=CHUNK,
    )  # fmt: skip
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(30)]
    with opt:
        train(model, opt, data)
        train_fp32_master(ref, master, opt_ref, data, mse)
        state = opt.state_dict()["state"]
    assert_params_equal(model, ref)
    assert 0 not in state  # the frozen parameter (first in parameters()) has no state
    assert torch.equal(state[1]["master_param"], master[1])


def test_bf16_gpt_equals_fp32_master_loop(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    master = [p.detach().float() for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(master, lr=3e-3, weight_decay=0.1, fused=True)
    data = gpt_data(15)
    with NVMeAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data, loss_fn=gpt_loss)
        assert opt.overlap_active
        train_fp32_master(ref, master, opt_ref, data, gpt_loss)
        assert torch.equal(opt.state_dict()["state"][0]["master_param"], master[0])
    assert_params_equal(model, ref)


def test_state_dict_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    data = batches(40)
    whole = copy.deepcopy(model)
    with OffloadOptimizer(torch.optim.AdamW(groups(whole)), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(whole, opt, data)
    with OffloadOptimizer(torch.optim.AdamW(groups(model)), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data[:20])
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = MLP()
    resumed.load_state_dict(ckpt["model"])
    with OffloadOptimizer(torch.optim.AdamW(groups(resumed)), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        opt.load_state_dict(ckpt["opt"])
        train(resumed, opt, data[20:])
    assert_params_equal(resumed, whole)


def test_state_dict_interchangeable_with_adamw(tmp_path):
    """torch's AdamW state dict loads into the offloaded optimizer, and its state dict back into torch's AdamW."""
    torch.manual_seed(0)
    model = MLP()
    data = batches(30)
    plain = copy.deepcopy(model)
    opt_plain = torch.optim.AdamW(groups(plain), fused=True)
    train(plain, opt_plain, data[:10])
    ours = copy.deepcopy(plain)
    with OffloadOptimizer(torch.optim.AdamW(groups(ours)), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        opt.load_state_dict(opt_plain.state_dict())
        sd = opt.state_dict()
        for k, st in opt_plain.state_dict()["state"].items():
            assert torch.equal(sd["state"][k]["exp_avg_sq"], st["exp_avg_sq"]) and float(sd["state"][k]["step"]) == 10
        assert set(sd["state"]) == set(opt_plain.state_dict()["state"])  # no state for params without grads
        train(ours, opt, data[10:20])
        back = copy.deepcopy(ours)
        opt_back = torch.optim.AdamW(groups(back), fused=True)
        opt_back.load_state_dict(opt.state_dict())
    train(plain, opt_plain, data[10:20])
    assert_params_equal(ours, plain)
    train(back, opt_back, data[20:])
    train(plain, opt_plain, data[20:])
    assert_params_equal(back, plain)


def test_add_param_group_after_some_steps(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    model.head.requires_grad_(False)
    ref = copy.deepcopy(model)
    data = batches(10)
    opt_ref = torch.optim.AdamW([*ref.fc1.parameters(), *ref.fc2.parameters()], lr=1e-2, fused=True)
    with NVMeAdamW([*model.fc1.parameters(), *model.fc2.parameters()], lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        for m, o in ((model, opt), (ref, opt_ref)):
            train(m, o, data[:4])
            m.head.requires_grad_(True)
            o.add_param_group({"params": list(m.head.parameters()), "lr": 3e-3, "weight_decay": 0.0})
            train(m, o, data[4:])
        assert set(opt.state_dict()["state"]) == {0, 1, 2, 3, 4, 5}
    assert_params_equal(model, ref)


def test_striped_swap_directories(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in dirs:
        d.mkdir()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    data = batches(10)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=dirs, chunk_bytes=CHUNK) as opt:
        train(model, opt, data)
        for d in dirs:
            (swap,) = d.glob("*.swap")
            assert swap.stat().st_size > 0
    train(ref, opt_ref, data)
    assert_params_equal(model, ref)
    assert not any(list(d.iterdir()) for d in dirs)  # swap files removed


class RecordingStore(TensorStore):
    """A real store that notes the names it is asked to read, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = []

    def get(self, name, out=None):
        self.reads.append(name)
        return super().get(name, out)


def test_read_ahead_follows_gradient_arrival(tmp_path):
    """After the first step the chunks are read ahead in the order the gradients arrived (reverse layer order)."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    index = {p: i for i, p in enumerate(model.parameters())}
    arrival = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: arrival.append(index[p])) for p in index if p.requires_grad]
    data = batches(3)
    with RecordingStore(tmp_path) as store, \
         NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=store, chunk_bytes=CHUNK, prefetch_chunks=4) as opt:  # fmt: skip
        train(model, opt, data[:1])
        for h in hooks:
            h.remove()
        deadline = time.monotonic() + 5
        while len(store.reads) < 4 and time.monotonic() < deadline:  # the read-ahead runs while training waits
            time.sleep(0.01)
        read_order = list(dict.fromkeys(int(re.search(r"\.p(\d+)\.c", name).group(1)) for name in store.reads[:4]))
        assert read_order == arrival[:4]  # one chunk each: head (two parameters), fc2.bias, fc2.weight's first
        assert set(arrival[:2]) == {index[model.head.weight], index[model.head.bias]}  # reverse layer order
        assert set(arrival[2:4]) == {index[model.fc2.weight], index[model.fc2.bias]}
        train(model, opt, data[1:])
    train(ref, opt_ref, data)
    assert_params_equal(model, ref)


class RefusingStore(TensorStore):
    """A real store whose reads are refused at submission while ``refusing`` is set; counts the refusals."""

    refusing = False
    refused = 0

    def get(self, name, *args, **kwargs):
        if self.refusing:
            self.refused += 1
            raise OSError(errno.EIO, f"read of {name} refused")
        return super().get(name, *args, **kwargs)

    def wait_refused(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while self.refused < count:
            assert time.monotonic() < deadline, f"{self.refused} reads refused, waited for {count}"
            time.sleep(0.001)


def test_read_ahead_refused_at_submission_keeps_its_slot(tmp_path):
    """A read ahead that the store refuses fails the next step and gives its slot back: five steps in a row
    (more than the four slots) fail, then the optimizer still runs, exactly as AdamW over the steps that ran
    (the slot used to be lost with each refusal, and the fifth step then found none)."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    data = batches(8)
    with RefusingStore(tmp_path) as store, \
         NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=store, chunk_bytes=CHUNK, prefetch_chunks=2) as opt:  # fmt: skip
        store.refusing = True  # the first step reads nothing: its updates initialize the state
        train(model, opt, data[:1])  # the read ahead of the next step starts at its end
        for i, (x, y) in enumerate(data[1:6]):
            store.wait_refused(i + 1)  # the read ahead started after the last step() was refused: this one fails
            store.refusing = i < 4
            (model(x) - y).square().mean().backward()
            with pytest.raises(OffloadIOError, match="refused"):
                opt.step()
            opt.zero_grad()
        train(model, opt, data[6:])
    train(ref, opt_ref, data[:1] + data[6:])
    assert_params_equal(model, ref)


class HostReads(TorchFunctionMode):
    """Notes the calls that read a tensor's values on the host: on a GPU, each waits for the device."""

    READS = frozenset({"cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__"})

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_grad_norm_reduces_on_the_device_and_reads_the_host_once(tmp_path):
    """grad_norm() of held gradients is clip_grad_norm_'s norm, read from the device once (it read each
    parameter's norm: a wait for the device per parameter)."""
    torch.manual_seed(0)
    model = MLP()
    x, y = batches(1)[0]
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        (model(x) - y).square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        expected = float(torch.nn.utils.get_total_norm(grads))
        with HostReads() as reads:
            norm = opt.grad_norm()
        assert norm == expected and reads.calls == ["__float__"]
        opt.step()


def mse(m, x, y):
    return (m(x) - y).square().mean()


def accumulate(model, micro_batches):
    for x, y in micro_batches:
        (mse(model, x, y) / len(micro_batches)).backward()


def changed(before, model):
    return any(not torch.equal(a, b) for a, b in zip(before, params(model)))


def test_micro_batches_per_step_change(tmp_path):
    """2 -> 3 micro-batches: the third forward ran on weights updated during the second backward, so step()
    restores them, skips the step with a clear error and re-learns the count. 3 -> 2: the update runs in
    step() once, then during backward again. Against torch.optim.AdamW at every step."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    data = batches(19)
    with OffloadOptimizer(torch.optim.AdamW(groups(model), lr=1e-2), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data[:6], accum=2)
        train(ref, opt_ref, data[:6], accum=2)
        before = params(model)
        accumulate(model, data[6:9])
        with pytest.raises(RuntimeError, match=r"backward ran 3 times for .* learned 2 per step .* restored"):
            opt.step()
        assert not changed(before, model)
        opt.zero_grad()
        for i, micro_batches in enumerate((data[6:9], data[9:12], data[12:15], data[15:17], data[17:19])):
            before = params(model)
            accumulate(model, micro_batches)
            opt.synchronize()
            # updated during backward once the count is known: 3 (re-learned above), 2 after one step of 2
            assert changed(before, model) == (i != 3)
            opt.step()
            opt.zero_grad()
            train(ref, opt_ref, micro_batches, accum=len(micro_batches))
            assert_params_equal(model, ref)
        assert opt.overlap_active


def test_updates_landing_after_an_extra_forward_leave_its_backward_to_step(tmp_path):
    """The updates the last learned micro-batch queued may land after an extra micro-batch's forward saved the
    weights (on a busy machine, or here forced with synchronize()): that backward still runs (the updates do not
    bump autograd's version counters), and step() restores the weights and refuses the step as for any extra
    micro-batch."""
    torch.manual_seed(0)
    model = MLP()
    data = batches(9)
    with OffloadOptimizer(torch.optim.AdamW(groups(model), lr=1e-2), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data[:6], accum=2)
        before = params(model)
        accumulate(model, data[6:8])
        x, y = data[8]
        loss = mse(model, x, y)
        opt.synchronize()  # the second micro-batch's updates land while the third's graph holds the weights
        loss.backward()
        with pytest.raises(RuntimeError, match=r"backward ran 3 times for .* learned 2 per step .* restored"):
            opt.step()
        assert not changed(before, model)


def test_lr_changed_between_backward_and_step(tmp_path):
    """An lr set after backward is the one step() uses (the early updates are redone); overlap is off for the
    next step, which shows the hyperparameters stay put, and back on after it."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    data = batches(8)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        for i, (x, y) in enumerate(data):
            before = params(model)
            for m, o in ((model, opt), (ref, opt_ref)):
                mse(m, x, y).backward()
                if i == 3:
                    o.param_groups[0]["lr"] = 3e-3
                o.step()
                o.zero_grad()
            assert changed(before, model)
            assert_params_equal(model, ref)
            assert opt.overlap_active == (i != 3)


class WideShallow(nn.Module):
    """Long transfers, short compute: big parameters, a trivial forward."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(1 << 18) * 0.01) for _ in range(6))

    def forward(self, x):
        return sum((t[: x.numel()] * x).sum() * (i + 1) for i, t in enumerate(self.tables))


class SlowWriteStore(TensorStore):
    """A real store whose writes start 20 ms after ``put`` returns and read the caller's buffer only then,
    as a slow drive would: a buffer reused before its write's future is done is written with the wrong bytes."""

    def put(self, name, tensor):
        future = concurrent.futures.Future()

        def write():
            time.sleep(0.02)
            try:
                future.set_result(TensorStore.put(self, name, tensor).result())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)

        threading.Thread(target=write, daemon=True).start()
        return future


def test_long_transfers_short_compute(tmp_path):
    """Updates overlap a near-instant backward while writes are slow; a slot reused before its write is done
    (or any other missing wait) shows as wrong values."""
    torch.manual_seed(0)
    model = WideShallow()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    data = [(torch.randn(4096), None) for _ in range(4)]
    loss_fn = lambda m, x, y: m(x)  # noqa: E731
    with SlowWriteStore(tmp_path) as store, \
         NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=store, chunk_bytes=1 << 16, prefetch_chunks=3) as opt:  # fmt: skip
        train(model, opt, data, loss_fn=loss_fn)
        assert opt.overlap_active
        train(ref, opt_ref, data, loss_fn=loss_fn)
        # steps 2 to 4 read the moments (8 bytes per element; the first step starts them); read-ahead of a
        # fifth step counts only once used
        assert opt.memory_stats().read_bytes == 3 * 6 * (1 << 18) * 8
    assert_params_equal(model, ref)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
])  # fmt: skip
def test_other_optimizers_run_their_own_step(tmp_path, make):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = make(ref.parameters())
    data = batches(15)
    with OffloadOptimizer(make(model.parameters()), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data[:10])
        train(ref, opt_ref, data[:10])
        sd = opt.state_dict()
        again = make(copy.deepcopy(ref).parameters())
        again.load_state_dict(sd)
        train(model, opt, data[10:])
        train(ref, opt_ref, data[10:])
    assert_params_equal(model, ref)


def test_grad_scaler_overflow_skips_step(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = CPUAdamW(ref.parameters(), lr=1e-2)
    data = batches(12)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        for m, o in ((model, opt), (ref, opt_ref)):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            for i, (x, y) in enumerate(data):
                scaler.scale((m(x) - y).square().mean()).backward()
                if i == 6:
                    m.fc1.weight.grad[0, 0] = float("inf")
                before = params(m)
                scaler.step(o)
                scaler.update()
                o.zero_grad()
                if i == 6:
                    assert all(torch.equal(a, b) for a, b in zip(before, params(m)))
    assert_params_equal(model, ref)


def test_grad_scaler_with_max_grad_norm_clips_the_unscaled_gradients(tmp_path):
    """As unscale_ then clip_grad_norm_: a max_grad_norm above the true norm never clips, one below it does."""
    torch.manual_seed(0)
    model = MLP()
    data = batches(6)
    for max_norm in (100.0, 0.05):
        ref, m = copy.deepcopy(model), copy.deepcopy(model)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        with NVMeAdamW(m.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK, max_grad_norm=max_norm) as opt:
            s_ref, s = torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
            for x, y in data:
                s_ref.scale((ref(x) - y).square().mean()).backward()
                s_ref.unscale_(opt_ref)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
                s_ref.step(opt_ref)
                s_ref.update()
                opt_ref.zero_grad()
                s.scale((m(x) - y).square().mean()).backward()
                s.step(opt)
                s.update()
                opt.zero_grad()
            assert_params_equal(m, ref)


def test_io_error_in_step_leaves_params_unchanged(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    data = batches(4)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data[:2])
        opt._store.inject_fault("eio", after_ops=4)  # a real EIO from the native engine
        before = params(model)
        (model(data[2][0]) - data[2][1]).square().mean().backward()  # updates start here
        with pytest.raises(OffloadIOError, match="Input/output error"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, params(model)))
        opt.step()  # the optimizer still works, from the old state
        assert any(not torch.equal(a, b) for a, b in zip(before, params(model)))


def test_restores_and_state_dicts_stay_within_cpu_memory(tmp_path):
    """An exact-fit budget holds through an I/O error, a GradScaler overflow and a state dict round trip."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    budget = 4 * 4096 * 18  # prefetch_chunks=2: four slots of one chunk's three fp32 rows, its gradient and 16-bit weights
    data = batches(8)
    mse = lambda m, x, y: (m(x) - y).square().mean()  # noqa: E731
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=CHUNK, cpu_memory_bytes=budget) as opt:
        train(model, opt, data[:3])
        train(ref, opt_ref, data[:3])
        opt._store.inject_fault("eio", after_ops=4)
        mse(model, *data[3]).backward()  # updates start here
        with pytest.raises(OffloadIOError, match="Input/output error"):
            opt.step()  # restores the weights the early updates changed
        opt.step()  # the same gradients again
        opt.zero_grad()
        train(ref, opt_ref, data[3:4])
        assert_params_equal(model, ref)
        for m, o in ((model, opt), (ref, opt_ref)):  # an overflow: the early updates are undone
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            scaler.scale(mse(m, *data[4])).backward()
            m.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(o)
            o.zero_grad()
        assert_params_equal(model, ref)
        opt.load_state_dict(opt.state_dict())
        train(model, opt, data[5:])
        train(ref, opt_ref, data[5:])
        stats = opt.memory_stats()
        assert stats.host_peak_bytes <= stats.host_limit_bytes == budget
    assert_params_equal(model, ref)


def test_bad_input(tmp_path, monkeypatch):
    lin = nn.Linear(4, 4)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NVMeAdamW(lin.parameters(), swap_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="too small"):
        NVMeAdamW(lin.parameters(), swap_dir=tmp_path, cpu_memory_bytes=1000)
    with pytest.raises(ValueError, match="one device"):
        NVMeAdamW([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))], swap_dir=tmp_path)
    with pytest.raises(ValueError, match="cannot be offloaded"):
        OffloadOptimizer(torch.optim.LBFGS(lin.parameters()), swap_dir=tmp_path)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OffloadOptimizer(lin, swap_dir=tmp_path)
    for field in ("cpu_memory_bytes", "chunk_bytes", "prefetch_chunks", "max_grad_norm", "gradient_accumulation_steps"):
        with pytest.raises(ValueError, match=rf"{field} must be .* got True"):  # a bool is no number
            NVMeAdamW(lin.parameters(), swap_dir=tmp_path, **{field: True})
    for dtype in (torch.float64, torch.float8_e4m3fn, torch.int32):  # refused when built, not at every step()
        with pytest.raises(ValueError, match=rf"dtype {dtype} cannot be offloaded \(float32, bfloat16 or float16"):
            NVMeAdamW([nn.Parameter(torch.zeros(4).to(dtype), requires_grad=False)], swap_dir=tmp_path)
    import shutil as _shutil

    real = _shutil.disk_usage
    monkeypatch.setattr("nvoffload.io.store.shutil.disk_usage", lambda p: real(p)._replace(free=100))
    state = 2 * 1024 * 3 * 4  # weight and bias: a 1024-element aligned chunk each, of master, m and v in fp32
    with pytest.raises(OSError, match=rf"needs \d+ bytes for the optimizer state \(two generations of {state} bytes\)") as info:
        NVMeAdamW(lin.parameters(), swap_dir=tmp_path)
    assert info.value.errno == errno.ENOSPC
    (tmp_path / "b").mkdir()  # two directories on one file system do not count its free space twice
    monkeypatch.setattr("nvoffload.io.store.shutil.disk_usage", lambda p: real(p)._replace(free=state + 4096))
    with pytest.raises(OSError, match=r"swap directories .*, .*/b need"):
        NVMeAdamW(lin.parameters(), swap_dir=[tmp_path, tmp_path / "b"])
    monkeypatch.undo()

    emb = nn.Embedding(10, 4, sparse=True)
    with NVMeAdamW(emb.parameters(), swap_dir=tmp_path) as opt:
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(ValueError, match="sparse gradient"):
            opt.step()
    with pytest.raises(ValueError, match="Adafactor state 'row_var' of shape .* cannot be offloaded"):
        OffloadOptimizer(torch.optim.Adafactor(nn.Linear(8, 8).parameters()), swap_dir=tmp_path)
    vector = nn.Parameter(torch.zeros(8))
    with OffloadOptimizer(torch.optim.Adafactor([vector]), swap_dir=tmp_path) as opt:  # unfactored: elementwise
        with pytest.raises(ValueError, match="'row_var'"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))]})


class FiniteSGD(torch.optim.SGD):
    """SGD that refuses non-finite gradients: a failure of the wrapped optimizer's step that is not I/O."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    raise FloatingPointError("non-finite gradient")
        return super().step(closure)


def test_failure_of_a_wrapped_step_keeps_its_type_and_restores(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    data = batches(6)
    with OffloadOptimizer(FiniteSGD(model.parameters(), lr=0.05, momentum=0.9), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        train(model, opt, data[:3])
        train(ref, opt_ref, data[:3])
        before = params(model)
        (model(data[3][0]) - data[3][1]).square().mean().backward()  # updates run here
        model.head.bias.grad[0] = float("nan")  # after its hook: noticed in step()
        with pytest.raises(FloatingPointError, match="non-finite gradient") as info:
            opt.step()
        assert "parameters were restored" in "".join(info.value.__notes__)
        assert all(torch.equal(a, b) for a, b in zip(before, params(model)))
        opt.zero_grad()
        train(model, opt, data[3:])
        train(ref, opt_ref, data[3:])
    assert_params_equal(model, ref)


@pytest.mark.parametrize("dtype, read_per_elem", [(torch.float32, 8), (torch.bfloat16, 12)])
def test_io_bytes_per_step(tmp_path, dtype, read_per_elem):
    """fp32 weights are their own master: a step reads only the moments (8 B/element), writes all 12."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256).to(dtype)
    numel = sum(p.numel() for p in model.parameters())
    with NVMeAdamW(model.parameters(), lr=1e-3, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        for step in range(3):
            opt.reset_io_stats()
            model(torch.randn(8, 256, dtype=dtype)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        stats = opt.memory_stats()
        assert stats.read_bytes == read_per_elem * numel and stats.written_bytes == 12 * numel
