"""The fused CPU Adam kernel (nvoffload.optim.kernels.adam_step) against torch.optim.Adam(W).

The kernel's arithmetic is torch's fused CPU kernel's (``fused=True``), so it is
compared with ``torch.optim.AdamW(fused=True)`` / ``Adam(fused=True)`` bit for
bit, every tensor size included: torch updates the last ``numel % 8`` elements
of each tensor outside its vector loop, rounding ``exp_avg_sq`` differently
there, and the kernel does the same. torch's default CPU path (``foreach=False``)
rounds that tail like the rest and its ``sqrt`` on large tensors goes through
MKL (not always correctly rounded), so it is compared to within fp32 rounding.
"""

import os
import warnings

import pytest
import torch

from nvoffload.optim import kernels
from nvoffload.optim.kernels import adam_step

ISAS = kernels.supported_isas()
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = [1, 7, 4097, 65537, 3 * 65536 + 5]  # 65537 is prime; the last spans several thread tasks


@pytest.fixture(params=ISAS)
def isa(request):
    previous = kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(previous)


def reference_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay=0.0, decoupled_weight_decay=True,
                   maximize=False, vmax=None):
    """One step of torch's fused CPU AdamW (Adam without decoupled weight decay) from this state, in place."""
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    opt = (torch.optim.AdamW if decoupled_weight_decay else torch.optim.Adam)(
        [ref], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=vmax is not None,
        maximize=maximize, fused=True,
    )  # fmt: skip
    state = {"step": torch.tensor(float(step - 1)), "exp_avg": m, "exp_avg_sq": v}  # updated in place
    if vmax is not None:
        state["max_exp_avg_sq"] = vmax
    opt.state[ref] = state
    opt.step()
    p.copy_(ref.detach())


def make_state(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    return p, m, v, gen


def clones(*ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    "weight_decay,decoupled,maximize,amsgrad",
    [(0.0, True, False, False), (0.01, True, False, False), (0.1, False, False, False), (0.05, True, True, True)],
)
def test_steps_bitwise_equal_torch_fused(isa, n, weight_decay, decoupled, maximize, amsgrad):
    p, m, v, gen = make_state(n)
    vmax = v.clone() if amsgrad else None
    rp, rm, rv = clones(p, m, v)
    rvmax = vmax.clone() if amsgrad else None
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        adam_step(p, g, m, v, step=step, weight_decay=weight_decay, decoupled_weight_decay=decoupled,
                  maximize=maximize, max_exp_avg_sq=vmax, **HYPER)
        reference_step(rp, g, rm, rv, step=step, weight_decay=weight_decay, decoupled_weight_decay=decoupled,
                       maximize=maximize, vmax=rvmax, **HYPER)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    if amsgrad:
        assert torch.equal(vmax, rvmax)


SWEEP = [*range(1, 301), 511, 1021, 4099, 65537, 3 * 65536 + 13]  # every tail length, and across thread tasks
SWEEP_CASES = [  # (torch optimizer, its options): AdamW with and without decay, amsgrad, Adam's L2, maximize
    (torch.optim.AdamW, dict(weight_decay=0.0)),
    (torch.optim.AdamW, dict(weight_decay=0.01, amsgrad=True)),
    (torch.optim.Adam, dict(weight_decay=0.1, maximize=True)),
]
FUSED_CPU = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")  # torch runs its AVX2 kernel on both


@pytest.mark.skipif(not FUSED_CPU, reason="the tail's arithmetic is that of torch's AVX2 fused kernel")
@pytest.mark.parametrize("make,options", SWEEP_CASES, ids=["adamw", "adamw-decay-amsgrad", "adam-l2-maximize"])
def test_every_size_bit_equal_to_torch_fused(isa, make, options):
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(n, generator=gen) for n in SWEEP]
    refs = [p.clone().requires_grad_() for p in params]
    opt = make(refs, lr=1e-2, fused=True, **options)  # one tensor per size
    moments = [(torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p) if options.get("amsgrad") else None)
               for p in params]  # fmt: skip
    for step in range(1, 5):
        grads = [torch.randn(p.numel(), generator=gen) for p in params]
        for ref, g in zip(refs, grads):
            ref.grad = g.clone()
        opt.step()
        for p, g, (m, v, vmax) in zip(params, grads, moments):
            adam_step(p, g, m, v, step=step, max_exp_avg_sq=vmax, decoupled_weight_decay=make is torch.optim.AdamW,
                      maximize=options.get("maximize", False), weight_decay=options["weight_decay"], **HYPER)
        for p, ref, (m, v, vmax) in zip(params, refs, moments):
            state = opt.state[ref]
            assert torch.equal(p, ref.detach()), (p.numel(), step, (p != ref.detach()).nonzero().flatten().tolist())
            assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"]), (p.numel(), step)
            if vmax is not None:
                assert torch.equal(vmax, state["max_exp_avg_sq"]), (p.numel(), step)


@pytest.mark.skipif(not FUSED_CPU, reason="the tail's arithmetic is that of torch's AVX2 fused kernel")
def test_a_tensor_updated_in_slices_equals_torch_fused_on_the_whole():
    # offset and tensor_numel place each slice in its tensor: the slices that hold the tensor's last
    # numel % 8 elements (here 5, split between two slices) round them as torch's kernel does.
    n = 1029
    gen = torch.Generator().manual_seed(12)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, fused=True)
    bounds = [0, 512, 1026, 1027, n]
    for step in range(1, 5):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        for lo, hi in zip(bounds, bounds[1:]):
            adam_step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=step, weight_decay=0.01, offset=lo, tensor_numel=n,
                      **HYPER)  # fmt: skip
        assert torch.equal(p, ref.detach()) and torch.equal(v, opt.state[ref]["exp_avg_sq"]), step
    with pytest.raises(ValueError, match=r"offset 1000 \+ 30 elements exceeds tensor_numel 1029"):
        adam_step(p[:30], g[:30], m[:30], v[:30], step=5, offset=1000, tensor_numel=n, **HYPER)


@pytest.mark.parametrize("foreach", [False, True])
def test_what_holds_against_torch_default_adamw(foreach):
    # What the README says of torch's non-fused AdamW (foreach=False is its CPU default; foreach=True rounds
    # the same on the CPU) after 100 steps: exp_avg equal; exp_avg_sq within 8 ulps (torch's fused tail, which
    # the kernel follows, rounds it differently); the weights within 2.4e-7 (MKL's sqrt, some tails).
    n = 65537
    gen = torch.Generator().manual_seed(13)
    p = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=foreach)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 101):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        adam_step(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    assert torch.equal(m, opt.state[ref]["exp_avg"])
    ulps = (v.view(torch.int32) - opt.state[ref]["exp_avg_sq"].view(torch.int32)).abs().max()  # v >= 0
    assert 0 < ulps <= 8
    assert 0 < (p - ref.detach()).abs().max() <= 2.4e-7


@pytest.mark.parametrize("n", [7, 4097, 65537])
@pytest.mark.parametrize("decoupled", [True, False])
def test_one_step_matches_torch_optimizer(n, decoupled):
    p, _, _, gen = make_state(n)
    g = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = opt_cls([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    opt.step()
    m, v = torch.zeros(n), torch.zeros(n)
    adam_step(p, g, m, v, step=1, weight_decay=0.1, decoupled_weight_decay=decoupled, **HYPER)
    state = opt.state[ref]
    assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
    # A rounding of the square root apart at most: an ulp of the weight or of the update (~lr).
    torch.testing.assert_close(p, ref.detach(), rtol=2.4e-7, atol=HYPER["lr"] * 2.4e-7)


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_100_steps_match_torch_adamw(amsgrad, maximize):
    n = 4097
    p, _, _, gen = make_state(n, seed=1)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize, foreach=False)
    m, v = torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    for step in range(1, 101):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        adam_step(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  maximize=maximize, max_exp_avg_sq=vmax)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("n", [1, 7, 4097, 65537])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_grad_and_out_dtypes(isa, n, grad_dtype, out_dtype):
    p, m, v, gen = make_state(n, seed=2)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    rp, rm, rv = clones(p, m, v)
    adam_step(p, g, m, v, step=7, weight_decay=0.01, param_out=out, **HYPER)
    reference_step(rp, g.float(), rm, rv, step=7, weight_decay=0.01, **HYPER)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    if out is not None:
        assert torch.equal(out.view(torch.int16), rp.to(out_dtype).view(torch.int16))


def special_floats(gen):
    """Random fp32 bit patterns plus rounding ties, fp16 subnormals/overflow, infinities and NaNs."""
    bits = torch.randint(-(2**31), 2**31 - 1, (60000,), generator=gen, dtype=torch.int64).to(torch.int32)
    finite = bits.view(torch.float32)
    finite = finite[torch.isfinite(finite)]
    ties_bf16 = (torch.randint(0, 2**15, (2000,), generator=gen, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    halves = torch.arange(-65536, 65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    ties_f16 = (halves.view(torch.int32) | 0x1000).view(torch.float32)  # halfway between fp16 neighbours
    scale = torch.logspace(-30, 6, 2000, base=2.0)
    extremes = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e30, -1e30, 6e-8, 3e-8, 2.98e-8,
                             float("inf"), float("-inf"), float("nan"), 3.4e38])
    return torch.cat([finite, ties_bf16, halves, ties_f16, scale, -scale, extremes])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_out_rounds_like_torch_on_special_values(isa, out_dtype):
    # lr = 0 and no weight decay leave each weight as it is (p + 0), so param_out
    # must be exactly torch's rounding of every bit pattern.
    gen = torch.Generator().manual_seed(3)
    p = special_floats(gen)
    n = p.numel()
    expected = (p + 0.0).to(out_dtype)
    out = torch.empty(n, dtype=out_dtype)
    adam_step(p, torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
              beta2=0.999, eps=1e-8, param_out=out)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_every_low_precision_grad_decodes_like_torch(isa, grad_dtype):
    # beta1 = 0 makes exp_avg = lerp(0, g, 1) = g: the decoded gradient, NaN/inf included.
    g = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = g.numel()
    m = torch.zeros(n)
    adam_step(torch.zeros(n), g, m, torch.zeros(n), step=1, lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8)
    expected = torch.zeros(n).lerp_(g.float(), 1.0)
    torch.testing.assert_close(m, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_scale_matches_unscaling_by_hand(isa, grad_dtype):
    n = 4097
    p, m, v, gen = make_state(n, seed=4)
    g = (torch.randn(n, generator=gen) * 1024).to(grad_dtype)
    scale = 1.0 / 1024.0 * 0.37  # unscale and clip in one factor
    rp, rm, rv = clones(p, m, v)
    adam_step(p, g, m, v, step=3, weight_decay=0.01, grad_scale=scale, **HYPER)
    by_hand = g.float() * torch.tensor(scale, dtype=torch.float32)
    adam_step(rp, by_hand, rm, rv, step=3, weight_decay=0.01, **HYPER)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    # ... and the same as torch.optim.AdamW on the unscaled gradient.
    ref = make_state(n, seed=4)[0].requires_grad_()
    ref.grad = by_hand
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    opt.state[ref] = {"step": torch.tensor(2.0), "exp_avg": make_state(n, seed=4)[1], "exp_avg_sq": make_state(n, seed=4)[2]}
    opt.step()
    torch.testing.assert_close(p, ref.detach(), rtol=2.4e-7, atol=HYPER["lr"] * 2.4e-7)


def test_unaligned_buffers_and_variants_agree():
    # Odd element offsets (pointers not 32/64-byte aligned), every variant, one and two threads: same bits.
    n = 3 * 65536 + 11
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(n + 3, generator=gen) for _ in range(3)]
    g = torch.randn(n + 1, generator=gen).bfloat16()[1:]
    results = []
    previous_isa = kernels.current_isa()
    try:
        for isa in ISAS:
            for threads in (1, 2):
                kernels.set_isa(isa)
                kernels.set_num_threads(threads)
                p, m, v = (b.clone()[k + 1:k + 1 + n] for k, b in enumerate(base))
                v.abs_()
                out = torch.empty(n + 1, dtype=torch.float16)[1:]
                adam_step(p, g, m, v, step=2, weight_decay=0.02, param_out=out, **HYPER)
                results.append((p, m, v, out))
    finally:
        kernels.set_num_threads(0)
        kernels.set_isa(previous_isa)
    p0, m0, v0, o0 = results[0]
    rp, rm, rv = (b.clone()[k + 1:k + 1 + n] for k, b in enumerate(base))
    rv.abs_()
    reference_step(rp, g.float(), rm, rv, step=2, weight_decay=0.02, **HYPER)
    assert torch.equal(p0, rp) and torch.equal(m0, rm) and torch.equal(v0, rv)
    for p, m, v, out in results[1:]:
        assert torch.equal(p, p0) and torch.equal(m, m0) and torch.equal(v, v0) and torch.equal(out, o0)


def test_version_counters_bumped():
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    out = torch.zeros(8, dtype=torch.bfloat16)
    before = [t._version for t in (p, m, v, out)]
    adam_step(p, torch.ones(8), m, v, step=1, param_out=out, **HYPER)
    assert all(t._version > b for t, b in zip((p, m, v, out), before))


def test_pool_survives_fork():
    n = 3 * 65536
    p, m, v, gen = make_state(n, seed=6)
    g = torch.randn(n, generator=gen)
    adam_step(*clones(p, g, m, v), step=1, **HYPER)  # the parent's pool now has worker threads
    rp, rm, rv = clones(p, m, v)
    reference_step(rp, g, rm, rv, step=1, **HYPER)
    expected = rp.numpy().tobytes()
    cp, cm, cv = clones(p, m, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process (3.12+)
        pid = os.fork()
    if pid == 0:
        # Child: the kernel must work, not hang, without the parent's threads.
        # (No torch compute here: torch's OpenMP pool itself does not survive fork.)
        code = 1
        try:
            adam_step(cp, g, cm, cv, step=1, **HYPER)
            code = 0 if cp.numpy().tobytes() == expected else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_threads_setting():
    kernels.set_num_threads(1)
    try:
        assert kernels.get_num_threads() == 1
    finally:
        kernels.set_num_threads(0)
    assert kernels.get_num_threads() == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="num_threads"):
        kernels.set_num_threads(-1)


def test_isa_selection():
    assert "scalar" in ISAS and kernels.current_isa() in ISAS
    with pytest.raises(ValueError, match="unknown instruction set"):
        kernels.set_isa("sse9")
    for name in {"avx2", "avx512", "neon"} - set(ISAS):
        with pytest.raises(ValueError, match="does not support"):
            kernels.set_isa(name)


def _buffers(n=16):
    return torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda b: b.update(param=torch.zeros(4, 4).t()), ValueError, "param must be contiguous"),
        (lambda b: b.update(grad=torch.zeros(32)[::2]), ValueError, "grad must be contiguous"),
        (lambda b: b.update(exp_avg=torch.zeros(15)), ValueError, "exp_avg has 15 elements but param has 16"),
        (lambda b: b.update(param=torch.zeros(16, dtype=torch.float64)), TypeError, "param must have dtype"),
        (lambda b: b.update(grad=torch.zeros(16, dtype=torch.int32)), TypeError, "grad must have dtype"),
        (lambda b: b.update(exp_avg_sq=torch.zeros(16, dtype=torch.bfloat16)), TypeError, "exp_avg_sq"),
        (lambda b: b.update(param_out=torch.zeros(16)), TypeError, "param_out must have dtype"),
        (lambda b: b.update(param_out=torch.zeros(8, dtype=torch.bfloat16)), ValueError, "param_out has 8"),
        (lambda b: b.update(grad=torch.zeros(16).to_sparse()), ValueError, "sparse"),
        (lambda b: b.update(grad=[0.0] * 16), TypeError, "grad must be a torch.Tensor"),
        (lambda b: b.update(exp_avg=b["param"]), ValueError, "overlap"),
        (lambda b: b.update(lr=float("nan")), ValueError, "lr must be finite"),
        (lambda b: b.update(eps=float("inf")), ValueError, "eps must be finite"),
        (lambda b: b.update(weight_decay=float("-inf")), ValueError, "weight_decay must be finite"),
        (lambda b: b.update(grad_scale=float("nan")), ValueError, "grad_scale must be finite"),
        (lambda b: b.update(beta1=1.0), ValueError, "beta1 must be in"),
        (lambda b: b.update(beta2=-0.1), ValueError, "beta2 must be in"),
        (lambda b: b.update(step=0), ValueError, "step must be >= 1"),
        (lambda b: b.update(step=1.5), TypeError, "step must be an int"),
        (lambda b: b.update(lr="0.1"), TypeError, "lr must be a real number"),
    ],
)
def test_bad_input_raises(mutate, exc, match):
    p, g, m, v = _buffers()
    kwargs = dict(param=p, grad=g, exp_avg=m, exp_avg_sq=v, step=1, **HYPER)
    mutate(kwargs)
    before = p.clone()
    with pytest.raises(exc, match=match):
        adam_step(kwargs.pop("param"), kwargs.pop("grad"), kwargs.pop("exp_avg"), kwargs.pop("exp_avg_sq"), **kwargs)
    assert torch.equal(p, before)  # nothing written


def test_overlapping_slices_rejected():
    buf = torch.zeros(40)
    with pytest.raises(ValueError, match="overlap"):
        adam_step(buf[:16], torch.zeros(16), buf[10:26], torch.zeros(16), step=1, **HYPER)


def test_native_checks_sizes_and_hyperparameters():
    from nvoffload.optim import _adam

    with pytest.raises(ValueError, match="null pointer"):
        _adam.adam_step(0, 0, 0, 0, 0, 0, 0, 8, 8, 0, 3, 0, 0, 0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, False)
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="lr must be finite"):
        _adam.adam_step(p.data_ptr(), p.data_ptr(), p.data_ptr(), p.data_ptr(), 0, 0, 0, 8, 8, 0, 3, 0, 0, 0, 1,
                        float("nan"), 0.9, 0.999, 1e-8, 0.0, True, 1.0, False)
    with pytest.raises(ValueError, match="invalid grad dtype"):
        _adam.adam_step(p.data_ptr(), p.data_ptr(), p.data_ptr(), p.data_ptr(), 0, 0, 0, 8, 8, 7, 3, 0, 0, 0, 1, 1e-3,
                        0.9, 0.999, 1e-8, 0.0, True, 1.0, False)
    with pytest.raises(ValueError, match="invalid state code"):
        _adam.adam_step(p.data_ptr(), p.data_ptr(), p.data_ptr(), p.data_ptr(), 0, 0, 0, 8, 8, 0, 3, 9, 0, 0, 1, 1e-3,
                        0.9, 0.999, 1e-8, 0.0, True, 1.0, False)


def test_empty_tensors_are_a_no_op():
    e = torch.zeros(0)
    adam_step(e, e.clone(), e.clone(), e.clone(), step=1, **HYPER)


@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_bandwidth_probe_moves_the_update_bytes(grad_dtype, out_dtype):
    n = 65536 * 2 + 3
    a, b, c = torch.zeros(n), torch.ones(n), torch.full((n,), 2.0)
    g = torch.ones(n, dtype=grad_dtype)
    out = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    kernels.bandwidth_probe(a, b, c, g, out)
    assert torch.equal(a, torch.ones(n)) and torch.equal(b, torch.full((n,), 2.0)) and torch.equal(c, torch.full((n,), 3.0))
    if out is not None:
        assert torch.equal(out[: n - 3].float(), torch.ones(n - 3))


def test_concurrent_callers_from_python_threads():
    # The GIL is released during the update: several Python threads may call at once.
    import threading

    n = 3 * 65536 + 1
    states = [make_state(n, seed=10 + k) for k in range(4)]
    grads = [torch.randn(n, generator=s[3]) for s in states]
    expected = []
    for (p, m, v, _), g in zip(states, grads):
        rp, rm, rv = clones(p, m, v)
        reference_step(rp, g, rm, rv, step=4, weight_decay=0.01, **HYPER)
        expected.append(rp)

    def work(k):
        p, m, v, _ = states[k]
        adam_step(p, grads[k], m, v, step=4, weight_decay=0.01, **HYPER)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (p, _, _, _), rp in zip(states, expected):
        assert torch.equal(p, rp)
