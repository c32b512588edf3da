"""CPUAdamW / CPUAdam against torch.optim.AdamW / Adam (foreach=False) as drop-in replacements."""

import copy

import pytest
import torch

from nvoffload.optim import CPUAdam, CPUAdamW


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 61), torch.nn.GELU(), torch.nn.Linear(61, 7))


def train(model, opt, steps, seed=1, scheduler=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_models_close(a, b, rtol=1e-5, atol=1e-6):
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol)


def param_groups(model, **extra):
    first, second = model[0], model[2]
    return [
        {"params": list(first.parameters()), **extra},
        {"params": list(second.parameters()), "lr": 3e-3, "weight_decay": 0.1},
    ]


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True)])
def test_cpu_adamw_tracks_torch_adamw_for_100_steps(amsgrad, maximize):
    ours, theirs = make_model(), make_model()
    opt = CPUAdamW(param_groups(ours), lr=1e-3, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize)
    ref = torch.optim.AdamW(param_groups(theirs), lr=1e-3, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize,
                            foreach=False)
    train(ours, opt, 100)
    train(theirs, ref, 100)
    assert_models_close(ours, theirs)
    for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters()):
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            torch.testing.assert_close(opt.state[p_ours][key], ref.state[p_theirs][key], rtol=1e-5, atol=1e-6)
        assert opt.state[p_ours]["step"].item() == 100


def test_cpu_adam_l2_tracks_torch_adam():
    ours, theirs = make_model(), make_model()
    opt = CPUAdam(ours.parameters(), lr=2e-3, weight_decay=0.05)
    ref = torch.optim.Adam(theirs.parameters(), lr=2e-3, weight_decay=0.05, foreach=False)
    train(ours, opt, 100)
    train(theirs, ref, 100)
    assert_models_close(ours, theirs)


def test_is_a_drop_in_adamw():
    opt = CPUAdamW(make_model().parameters())
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert group["decoupled_weight_decay"] is True


def test_state_dict_round_trips_with_torch_adamw():
    ours, theirs = make_model(), make_model()
    opt = CPUAdamW(param_groups(ours), lr=1e-3)
    train(ours, opt, 5)
    # Ours -> torch: torch continues exactly where we were.
    theirs.load_state_dict(ours.state_dict())
    ref = torch.optim.AdamW(param_groups(theirs), lr=1e-3, foreach=False)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert set(ref.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # torch -> ours: a fresh CPUAdamW loading torch's state_dict.
    ours2 = make_model()
    ours2.load_state_dict(ours.state_dict())
    opt2 = CPUAdamW(param_groups(ours2), lr=1e-3)
    opt2.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(ours, opt, 20, seed=2)
    train(theirs, ref, 20, seed=2)
    train(ours2, opt2, 20, seed=2)
    assert_models_close(ours, theirs)
    for a, b in zip(ours.parameters(), ours2.parameters()):
        assert torch.equal(a, b)


def test_lr_scheduler_and_tensor_lr():
    ours, theirs = make_model(), make_model()
    opt = CPUAdamW(ours.parameters(), lr=torch.tensor(1e-2))
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=1e-2, total_steps=40)
    train(ours, opt, 30, scheduler=sched)
    train(theirs, ref, 30, scheduler=ref_sched)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(ref.param_groups[0]["lr"], rel=1e-6)
    assert_models_close(ours, theirs)


def test_closure_and_parameters_without_grad():
    model = make_model()
    frozen = model[2].weight.detach().clone()
    model[2].weight.requires_grad_(False)
    opt = CPUAdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 32)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert torch.equal(model[2].weight, frozen) and model[2].weight not in opt.state


def test_non_contiguous_parameters_and_grads():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(40, 30, generator=gen)
    dense_t = torch.nn.Parameter(base.clone().t())  # dense, transposed layout
    gappy = torch.randn(20, 64, generator=gen)[:, ::2]  # not dense: a view with gaps
    ours = [dense_t, torch.nn.Parameter(gappy.clone())]
    ours[1].data = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))[:, ::2]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = CPUAdamW(ours, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad = g.t().contiguous().t() if step % 2 else g  # grad layout differs from the param's on odd steps
            q.grad = g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"lr": float("nan")}, "Invalid learning rate"),
        ({"lr": float("inf")}, "Invalid lr"),
        ({"eps": float("inf")}, "Invalid eps"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, float("nan"))}, "Invalid beta parameter at index 1"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"weight_decay": float("inf")}, "Invalid weight_decay"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdamW(make_model().parameters(), **kwargs)


def test_lr_set_to_nan_later_raises_at_step():
    model = make_model()
    opt = CPUAdamW(model.parameters())
    opt.param_groups[0]["lr"] = float("nan")
    model(torch.randn(2, 32)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_sparse_grad_and_wrong_dtype_raise():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = CPUAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradients"):
        opt.step()
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp32 CPU parameters"):
        CPUAdamW([p]).step()
