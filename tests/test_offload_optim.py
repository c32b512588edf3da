"""OffloadOptimizer / NVMeAdamW against torch's optimizers, with the state in a real TensorStore."""

import copy
import io

import pytest
import torch
from torch import nn

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


def test_gpt_matches_adamw_and_max_grad_norm(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    ref = GPT(cfg)
    off, clipped_ref, clipped = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    opt_ref = CPUAdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt_cref = CPUAdamW(clipped_ref.parameters(), lr=3e-3, weight_decay=0.1)
    torch_ref = copy.deepcopy(ref)
    # torch's fused CPU AdamW rounds exactly like the native kernel; its
    # single-tensor path can be an ulp off (MKL's sqrt), which 50 steps amplify.
    opt_torch = torch.optim.AdamW(torch_ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 256, (2, 33), generator=g),) * 2 for _ in range(50)]
    loss_fn = lambda m, x, y: m(x[:, :-1], y[:, 1:])  # noqa: E731
    with NVMeAdamW(off.parameters(), lr=3e-3, weight_decay=0.1, swap_dir=tmp_path, chunk_bytes=CHUNK) as opt, \
         NVMeAdamW(clipped.parameters(), lr=3e-3, weight_decay=0.1, swap_dir=tmp_path, chunk_bytes=CHUNK, max_grad_norm=0.1) as opt_c:  # fmt: skip
        train(off, opt, data, loss_fn=loss_fn)
        train(ref, opt_ref, data, loss_fn=loss_fn)
        train(torch_ref, opt_torch, data, loss_fn=loss_fn)
        train(clipped, opt_c, data, loss_fn=loss_fn)
        train(clipped_ref, opt_cref, data, loss_fn=loss_fn, clip=0.1)
        assert opt.overlap_active
    assert_params_equal(off, ref)
    assert_params_equal(clipped, clipped_ref)
    assert_params_equal(off, torch_ref)  # bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_equals_fp32_master_loop(tmp_path, dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    ref = copy.deepcopy(model)
    master = [p.detach().float() for p in ref.parameters()]
    opt_ref = CPUAdamW([{"params": master[:4]}, {"params": master[4:], "weight_decay": 0.0}], lr=1e-2)
    opt = OffloadOptimizer(
        CPUAdamW([{"params": list(model.parameters())[:4]}, {"params": list(model.parameters())[4:], "weight_decay": 0.0}], lr=1e-2),
        swap_dir=tmp_path, chunk_bytes=CHUNK,
    )  # fmt: skip
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(30)]
    with opt:
        train(model, opt, data)
        for x, y in data:  # the reference mixed-precision loop: fp32 master, low-precision model
            (ref(x) - y).float().square().mean().backward()
            for m, p in zip(master, ref.parameters()):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            opt_ref.step()
            with torch.no_grad():
                for m, p in zip(master, ref.parameters()):
                    p.copy_(m)
        state = opt.state_dict()["state"]
    assert_params_equal(model, ref)
    assert 0 not in state  # the frozen parameter (first in parameters()) has no state
    assert torch.equal(state[1]["master_param"], master[1])


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
    torch.manual_seed(0)
    model = MLP()
    data = batches(20)
    plain = copy.deepcopy(model)
    opt_plain = CPUAdamW(groups(plain))
    train(plain, opt_plain, data[:10])
    ours = copy.deepcopy(plain)
    with OffloadOptimizer(CPUAdamW(groups(ours)), swap_dir=tmp_path, chunk_bytes=CHUNK) as opt:
        opt.load_state_dict(opt_plain.state_dict())
        sd = opt.state_dict()
        for k, st in opt_plain.state_dict()["state"].items():
            assert torch.equal(sd["state"][k]["exp_avg_sq"], st["exp_avg_sq"]) and float(sd["state"][k]["step"]) == 10
        train(ours, opt, data[10:])
        back = CPUAdamW(groups(copy.deepcopy(ours)))
        back.load_state_dict(opt.state_dict())  # and back into a plain optimizer
    train(plain, opt_plain, data[10:])
    assert_params_equal(ours, plain)
    assert set(sd["state"]) == set(opt_plain.state_dict()["state"])  # no state for params without grads


class WideShallow(nn.Module):
    """Long transfers, short compute: big parameters, a trivial forward."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(1 << 18) * 0.01) for _ in range(6))

    def forward(self, x):
        return sum((t[: x.numel()] * x).sum() * (i + 1) for i, t in enumerate(self.tables))


def test_long_transfers_short_compute(tmp_path):
    """Updates overlap a near-instant backward; any missing wait on a read or write shows as wrong values."""
    torch.manual_seed(0)
    model = WideShallow()
    ref = copy.deepcopy(model)
    opt_ref = CPUAdamW(ref.parameters(), lr=1e-2)
    data = [(torch.randn(4096), None) for _ in range(8)]
    loss_fn = lambda m, x, y: m(x)  # noqa: E731
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path, chunk_bytes=1 << 16, prefetch_chunks=3) as opt:
        train(model, opt, data, loss_fn=loss_fn)
        assert opt.overlap_active
        train(ref, opt_ref, data, loss_fn=loss_fn)
        assert opt.memory_stats().read_bytes > 8 * 6 * (1 << 18) * 12 * 0.5
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
    import shutil as _shutil

    real = _shutil.disk_usage
    monkeypatch.setattr("nvoffload.optim.offload.shutil.disk_usage", lambda p: real(p)._replace(free=100))
    with pytest.raises(ValueError, match=r"needs \d+ bytes"):
        NVMeAdamW(lin.parameters(), swap_dir=tmp_path)
    monkeypatch.undo()

    emb = nn.Embedding(10, 4, sparse=True)
    with NVMeAdamW(emb.parameters(), swap_dir=tmp_path) as opt:
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(ValueError, match="sparse gradient"):
            opt.step()
    ada = nn.Linear(8, 8, bias=False)
    with OffloadOptimizer(torch.optim.Adafactor(ada.parameters()), swap_dir=tmp_path) as opt:
        ada(torch.randn(2, 8)).sum().backward()
        with pytest.raises(Exception, match="cannot be offloaded"):
            opt.step()


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
