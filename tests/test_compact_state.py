"""Compact optimizer state (issue 34): bf16 moments, bf16 weights without an fp32 master, and 8-bit moments.

The offloaded optimizer, its state cut into chunks and moved through the store,
must give exactly what the fused kernel gives on whole tensors in memory (the
kernel's compact forms are checked element by element in test_adam_compact.py),
while the store's counters show the bytes each form saves.
"""

import copy

import pytest
import torch
from test_streaming import config as streaming_config
from torch import nn

from nvoffload.optim.kernels import adam_step, decode_moment, fp8_blocks
from nvoffload.optim.offload import NVMeAdamW, OffloadOptimizer
from nvoffload.training_checkpoint import load_training_checkpoint, save_training_checkpoint

CHUNK = 4096 * 4  # fp32 bytes of master per chunk: several chunks per weight
LR, WD = 1e-2, 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.fc2 = nn.Linear(256, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batches(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return (model(x).float() - y).square().mean()


class Reference:
    """AdamW with compact state on whole tensors in memory: the fused kernel, one call per parameter."""

    def __init__(self, model, precision):
        self.params = list(model.parameters())
        self.precision = precision
        self.step_count = 0
        self.state = []
        self.exponents = []  # 8-bit moments: each parameter's blocks' scale exponents
        for p in self.params:
            masterless = precision in ("bf16", "8bit") and p.dtype == torch.bfloat16
            master = None if masterless or p.dtype == torch.float32 else p.detach().float().reshape(-1).clone()
            moments = {"fp32": torch.float32, "8bit": torch.uint8}.get(precision, torch.bfloat16)
            self.state.append((master, torch.zeros(p.numel(), dtype=moments), torch.zeros(p.numel(), dtype=moments)))
            self.exponents.append(torch.zeros(2, fp8_blocks(p.numel()), dtype=torch.int8) if precision == "8bit" else None)

    def step(self, grad_scale=1.0):
        self.step_count += 1
        for i, (p, (master, m, v), exponents) in enumerate(zip(self.params, self.state, self.exponents)):
            weights = p.data.view(-1) if master is None else master
            adam_step(weights, p.grad.reshape(-1).contiguous(), m, v, step=self.step_count, lr=LR, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=WD, grad_scale=grad_scale, sr_seed=i << 32 | self.step_count,
                      param_out=None if master is None else p.data.view(-1),
                      moment_exponents=None if exponents is None else exponents.view(-1))  # fmt: skip
            p.grad = None

    def moments(self, i):
        """Parameter ``i``'s moments as fp32 values (as a state dict holds them)."""
        _, m, v = self.state[i]
        if self.exponents[i] is None:
            return m.float(), v.float()
        return decode_moment(m, self.exponents[i][0]), decode_moment(v, self.exponents[i][1], root=True)


def run(model, opt, data):
    losses = []
    for x, y in data:
        loss = loss_of(model, x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        if not isinstance(opt, Reference):
            opt.zero_grad()
    return losses


def offloaded(model, tmp_path, precision, **kw):
    tmp_path.mkdir(exist_ok=True)
    return NVMeAdamW(model.parameters(), lr=LR, weight_decay=WD, swap_dir=tmp_path, chunk_bytes=CHUNK,
                     state_precision=precision, **kw)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["bf16-moments", "bf16", "8bit"])
def test_offloaded_compact_state_equals_the_kernel_on_whole_tensors(tmp_path, dtype, precision):
    torch.manual_seed(0)
    base = Net().to(dtype)
    ref_model, off_model = copy.deepcopy(base), copy.deepcopy(base)
    ref, opt = Reference(ref_model, precision), offloaded(off_model, tmp_path / "swap", precision)
    data = batches(4, dtype)
    assert run(off_model, opt, data) == run(ref_model, ref, data)
    for a, b in zip(off_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    sd = opt.state_dict()["state"]
    for i, (master, _, _) in enumerate(ref.state):
        assert sd[i]["state_precision"] == precision
        m, v = ref.moments(i)
        assert torch.equal(sd[i]["exp_avg"].view(-1), m) and torch.equal(sd[i]["exp_avg_sq"].view(-1), v)
        assert sd[i]["exp_avg"].dtype == torch.float32  # as torch's state dict has it
        if master is None:
            assert "master_param" not in sd[i]
        else:
            assert torch.equal(sd[i]["master_param"].view(-1), master)
    opt.close()


@pytest.mark.parametrize("precision", ["bf16-moments", "8bit"])
def test_compact_state_follows_exact_adamw_closely(tmp_path, precision):
    torch.manual_seed(0)
    base = Net()
    exact, compact = copy.deepcopy(base), copy.deepcopy(base)
    opt_exact = torch.optim.AdamW(exact.parameters(), lr=LR, weight_decay=WD, fused=True)
    opt_compact = offloaded(compact, tmp_path / "swap", precision)
    data = batches(10, torch.float32)
    losses_exact, losses_compact = run(exact, opt_exact, data), run(compact, opt_compact, data)
    assert losses_exact != losses_compact  # not exact ...
    torch.testing.assert_close(losses_compact, losses_exact, rtol=2e-2, atol=0)  # ... but close
    opt_compact.close()


@pytest.mark.parametrize(
    "dtype,precision,read,written",
    [
        # fp32 parameters keep their master as the model's weights: an update reads the moments only
        (torch.float32, "fp32", 8, 12),
        (torch.float32, "bf16-moments", 4, 8),
        (torch.float32, "bf16", 4, 8),
        # bf16 parameters: master and moments, or moments and a bf16 copy of the weights
        (torch.bfloat16, "fp32", 12, 12),
        (torch.bfloat16, "bf16-moments", 8, 8),
        (torch.bfloat16, "bf16", 4, 6),
    ],
)
def test_store_bytes_per_step_are_the_state_bytes_per_parameter(tmp_path, dtype, precision, read, written):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = offloaded(model, tmp_path / "swap", precision)
    data = batches(3, dtype)
    run(model, opt, data[:1])  # the first step initializes the state
    numel = sum(p.numel() for p in model.parameters())
    for x, y in data[1:]:
        opt.reset_io_stats()
        run(model, opt, [(x, y)])
        stats = opt.memory_stats()
        assert (stats.read_bytes, stats.written_bytes) == (read * numel, written * numel)
    opt.close()


@pytest.mark.parametrize("dtype, weight_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_8bit_moments_move_two_bytes_a_parameter_and_their_scales(tmp_path, dtype, weight_bytes):
    """The store reads each chunk's codes and its blocks' exponents (2 bytes an element, 2 a block of 256), and writes
    them with the new weights (fp32 parameters' master, or the bf16 weights themselves)."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = offloaded(model, tmp_path / "swap", "8bit")
    data = batches(3, dtype)
    run(model, opt, data[:1])
    chunk_numel = CHUNK // 4
    moments = sum(2 * n + 2 * fp8_blocks(n) for p in model.parameters()
                  for n in [min(chunk_numel, p.numel() - s) for s in range(0, p.numel(), chunk_numel)])  # fmt: skip
    numel = sum(p.numel() for p in model.parameters())
    assert moments < 2.01 * numel
    for x, y in data[1:]:
        opt.reset_io_stats()
        run(model, opt, [(x, y)])
        stats = opt.memory_stats()
        assert (stats.read_bytes, stats.written_bytes) == (moments, moments + weight_bytes * numel)
    opt.close()


@pytest.mark.parametrize("precision", ["bf16-moments", "bf16", "8bit"])
def test_clipped_redo_with_released_grads_equals_the_reference(tmp_path, precision):
    # release_grads applies each update during backward and redoes it in step() once the norm says clip:
    # the committed weights come back from the store (the bf16 copy without an fp32 master).
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16)
    ref_model, off_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = Reference(ref_model, precision)
    opt = offloaded(off_model, tmp_path / "swap", precision, release_grads=True, max_grad_norm=0.05)
    for x, y in batches(3, torch.bfloat16):
        losses = []
        for model in (off_model, ref_model):
            loss = loss_of(model, x, y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        norm = torch.tensor(opt.grad_norm(), dtype=torch.float32)  # the norm measured as the gradients passed
        coef = float(torch.clamp(0.05 / (norm + 1e-6), max=1.0))  # as clip_grad_norm_
        assert coef < 1.0
        ref.step(grad_scale=coef)
        assert losses[0] == losses[1]
    for a, b in zip(off_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    opt.close()


@pytest.mark.parametrize("precision", ["bf16-moments", "bf16", "8bit"])
def test_a_checkpoint_resumes_exactly_and_loads_only_into_its_precision(tmp_path, precision):
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16)
    data = batches(6, torch.bfloat16)
    straight = copy.deepcopy(base)
    opt = offloaded(straight, tmp_path / "a", precision)
    want = run(straight, opt, data)
    opt.close()

    first = copy.deepcopy(base)
    opt = offloaded(first, tmp_path / "b", precision)
    run(first, opt, data[:3])
    save_training_checkpoint(tmp_path / "ckpt", step=3, model=first, optimizer=opt)
    opt.close()
    resumed = copy.deepcopy(base)
    opt = offloaded(resumed, tmp_path / "c", precision)
    load_training_checkpoint(tmp_path / "ckpt", model=resumed, optimizer=opt)
    assert run(resumed, opt, data[3:]) == want[3:]
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)
    sd = opt.state_dict()
    opt.close()

    plain = copy.deepcopy(base)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    run(plain, plain_opt, data[:1])
    for saved, state_dict, into in ((precision, sd, "fp32"), ("fp32", plain_opt.state_dict(), precision)):
        target = offloaded(copy.deepcopy(base), tmp_path / f"into-{into}", into)
        with pytest.raises(ValueError, match=f"saved with state_precision='{saved}'"):
            target.load_state_dict(state_dict)
        target.close()


def test_what_the_compact_state_refuses(tmp_path):
    model = Net()
    with pytest.raises(ValueError, match="amsgrad needs the fp32 state"):
        NVMeAdamW(model.parameters(), amsgrad=True, swap_dir=tmp_path, state_precision="bf16-moments")
    with pytest.raises(ValueError, match="state_precision='bf16-moments'"):
        NVMeAdamW(Net().half().parameters(), swap_dir=tmp_path, state_precision="bf16")
    with pytest.raises(ValueError, match="is for Adam and AdamW, not SGD"):
        OffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swap_dir=tmp_path, state_precision="bf16")
    with pytest.raises(ValueError, match="state_precision must be one of fp32, bf16-moments, bf16"):
        NVMeAdamW(model.parameters(), swap_dir=tmp_path, state_precision="int8")


@pytest.mark.parametrize("precision", ["bf16-moments", "bf16", "8bit"])
def test_streamed_training_with_compact_state_equals_the_optimizer_on_the_whole_model(tmp_path, precision):
    """initialize() streams the parameters and hands the optimizer the weights in the streamer's host cache (its
    WeightHome): the compact updates land there as they do in a model held whole."""
    import nvoffload
    from nvoffload.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    whole = GPT(cfg).to(torch.bfloat16)
    streamed = copy.deepcopy(whole)
    opt_whole = offloaded(whole, tmp_path / "whole", precision)
    (tmp_path / "streamed").mkdir()
    streamed, opt = nvoffload.initialize(
        streamed, torch.optim.AdamW(streamed.parameters(), lr=LR, weight_decay=WD),
        streaming_config(tmp_path / "streamed", streamed, state_precision=precision),
    )  # fmt: skip
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
            losses = []
            for model, o in ((whole, opt_whole), (streamed, opt)):
                loss = model(x, x.roll(-1, dims=1))
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1]
            assert all(p.untyped_storage().nbytes() == 0 for p in streamed.blocks.parameters())  # streamed
        got = streamed.state_dict()
        for name, value in whole.state_dict().items():
            assert torch.equal(got[name], value), name
        assert opt.state_dict()["state"][0]["state_precision"] == precision
    finally:
        opt.session.close()
        opt_whole.close()


def test_finetune_says_the_state_is_not_exact_and_resumes_only_with_its_precision(tmp_path, capsys):
    from nvoffload.cli import main

    (tmp_path / "swap").mkdir()
    base = ["finetune", "--preset", "tiny", "--dtype", "bfloat16", "--batch-size", "2", "--seq-len", "16", "--no-progress",
            "--swap-dir", str(tmp_path / "swap"), "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    assert main([*base, "--steps", "2", "--optimizer-state", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state (bf16 moments, no fp32 master for bfloat16 weights (stochastic rounding): not exact AdamW)" in out
    assert main([*base, "--steps", "3", "--resume"]) == 2  # the default, exact AdamW
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was saved with --optimizer-state='bf16'; this optimizer keeps 'fp32'" in err[0], err
    assert main([*base, "--steps", "3", "--resume", "--optimizer-state", "bf16"]) == 0
    assert main(["finetune", "--preset", "tiny", "--dtype", "float16", "--optimizer-state", "bf16"]) == 2
    assert "float16 needs an fp32 master" in capsys.readouterr().err


@pytest.mark.parametrize("precision,state_bytes,home_bytes", [("bf16-moments", 8, 8), ("bf16", 6, 8), ("8bit", 4, 8)])
def test_resident_compact_state_moves_nothing_and_changes_nothing(tmp_path, precision, state_bytes, home_bytes):
    """Resident chunks keep both generations of their rows in host memory (an fp32 row's room per row, as the
    planner counts them: nvoffload.planner.cost.state_bytes_per_param, the 8-bit moments' scales aside) and never
    touch the store."""
    from nvoffload.optim.kernels import fp8_blocks
    from nvoffload.planner.cost import state_bytes_per_param

    assert state_bytes_per_param(precision, "bfloat16")[1:] == (state_bytes, home_bytes)
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16)
    in_store, resident = copy.deepcopy(base), copy.deepcopy(base)
    opt_store = offloaded(in_store, tmp_path / "store", precision)
    opt_res = offloaded(resident, tmp_path / "resident", precision, resident_state_bytes=64 << 20)
    data = batches(3, torch.bfloat16)
    run(in_store, opt_store, data[:1])
    run(resident, opt_res, data[:1])
    opt_res.reset_io_stats()
    assert run(resident, opt_res, data[1:]) == run(in_store, opt_store, data[1:])
    stats = opt_res.memory_stats()
    numel = sum(p.numel() for p in resident.parameters())
    assert (stats.read_bytes, stats.written_bytes) == (0, 0)
    chunks = [c for r in opt_res._records for c in r.chunks]
    scales = sum(2 * fp8_blocks(c.numel) for c in chunks) if precision == "8bit" else 0  # a byte a block a moment
    assert stats.resident_state_bytes == state_bytes * numel + scales
    assert stats.resident_bytes == sum(2 * -(-home_bytes * c.numel // 4096) * 4096 for c in chunks)
    for a, b in zip(resident.parameters(), in_store.parameters()):
        assert torch.equal(a, b)
    sd_res, sd_store = opt_res.state_dict()["state"], opt_store.state_dict()["state"]
    assert all(torch.equal(sd_res[i][k], sd_store[i][k]) for i in sd_store for k in ("exp_avg", "exp_avg_sq"))
    opt_res.close()
    opt_store.close()
