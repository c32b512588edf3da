"""The fused kernel's compact state forms against the exact update they round.

A compact form runs the exact kernel's fp32 arithmetic (itself bit-equal to
``torch.optim.AdamW(fused=True)``, see test_adam_kernel.py) on the state it
holds, widened to fp32, and rounds when it stores: bf16 moments to nearest
even; bf16 weights stochastically, with the random bits of a hash of the seed
and the element's index, computed here again in numpy (a slice of a tensor
past 2**32 elements included, whose key changes with the index's high word). So every element is
compared bit for bit, on every instruction set and size.
"""

import numpy as np
import pytest
import torch

from nvoffload.optim import kernels
from nvoffload.optim.kernels import adam_step

ISAS = kernels.supported_isas()
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SIZES = [1, 7, 4097, 65537, 3 * 65536 + 5]


@pytest.fixture(params=ISAS)
def isa(request):
    previous = kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(previous)


def _lowbias32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def stochastic_bf16(values: torch.Tensor, seed: int, first_index: int) -> torch.Tensor:
    """The kernel's stochastic rounding of fp32 ``values`` (elements ``first_index``, ... of their tensor)."""
    index = np.arange(values.numel(), dtype=np.uint64) + np.uint64(first_index)
    seed_key = _lowbias32(np.array([seed >> 32], dtype=np.uint32)) ^ np.uint32(seed & 0xFFFFFFFF)
    key = _lowbias32((index >> np.uint64(32)).astype(np.uint32) ^ seed_key)
    bits = ((index.astype(np.uint32) ^ key) * np.uint32(0x9E3779B1)) >> np.uint32(16)
    u = values.numpy().view(np.uint32).copy()
    magnitude = u & np.uint32(0x7FFFFFFF)
    finite = magnitude < np.uint32(0x7F800000)
    out = ((u + np.where(finite, bits, np.uint32(0))) >> np.uint32(16)).astype(np.uint16)
    out[magnitude > np.uint32(0x7F800000)] = 0x7FC0
    return torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16)


def state(n, seed=0, *, bf16_weights=False):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    v = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    g = torch.randn(n, generator=gen)
    return (p.bfloat16() if bf16_weights else p), m, v, g


def exact(p, m, v, g, **kw):
    """The exact kernel on the compact state widened to fp32: (weights, exp_avg, exp_avg_sq) in fp32."""
    p32, m32, v32 = p.float(), m.float(), v.float()
    adam_step(p32, g, m32, v32, **kw)
    return p32, m32, v32


@pytest.mark.parametrize("n", SIZES)
def test_bf16_moments_are_the_exact_update_rounded_to_nearest_even(isa, n):
    p, m, v, g = state(n)
    for step in (1, 2, 3):
        want_p, want_m, want_v = exact(p, m, v, g, step=step, **HYPER)
        adam_step(p, g, m, v, step=step, **HYPER)
        assert torch.equal(p, want_p)  # the master stays fp32: the weights are the exact update's
        assert torch.equal(m, want_m.bfloat16())
        assert torch.equal(v, want_v.bfloat16())


@pytest.mark.parametrize("n", SIZES)
def test_bf16_weights_are_the_exact_update_rounded_stochastically(isa, n):
    p, m, v, g = state(n, bf16_weights=True)
    seed = 0x1234_5678_9ABC_DEF0
    for step in (1, 2):
        want_p, want_m, want_v = exact(p, m, v, g, step=step, **HYPER)
        adam_step(p, g, m, v, step=step, sr_seed=seed + step, **HYPER)
        assert torch.equal(p, stochastic_bf16(want_p, seed + step, 0))
        assert torch.equal(m, want_m.bfloat16())
        assert torch.equal(v, want_v.bfloat16())


def test_stochastic_rounding_depends_on_the_index_in_the_tensor_not_the_slice():
    n, offset = 70000, 4096 * 3
    p, m, v, g = state(n, bf16_weights=True)
    whole = [t.clone() for t in (p, m, v)]
    adam_step(*whole[:1], g, *whole[1:], step=1, sr_seed=7, **HYPER)
    for lo, hi in ((0, offset), (offset, n)):
        adam_step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=1, sr_seed=7, offset=lo, tensor_numel=n, **HYPER)
    assert torch.equal(p, whole[0])
    assert torch.equal(m, whole[1])



def test_stochastic_rounding_past_two_to_the_32_elements(isa):
    # a slice whose registers cross element 2**32 of its tensor: the key changes within a register
    offset, n = (1 << 32) - 37, 100
    p, m, v, g = state(n, bf16_weights=True)
    want_p, _, _ = exact(p, m, v, g, step=1, offset=offset, tensor_numel=offset + n + 3, **HYPER)
    adam_step(p, g, m, v, step=1, sr_seed=11, offset=offset, tensor_numel=offset + n + 3, **HYPER)
    assert torch.equal(p, stochastic_bf16(want_p, 11, offset))
    assert not torch.equal(stochastic_bf16(want_p, 11, offset), stochastic_bf16(want_p, 11, 0))


def test_stochastic_rounding_is_unbiased_and_moves_weights_that_nearest_rounding_keeps():
    # An update of a quarter of a bf16 ulp: rounding to nearest never moves the weight, stochastic rounding
    # moves a quarter of the elements by one ulp, so the mean moves by the update.
    n = 1 << 16
    p = torch.ones(n, dtype=torch.bfloat16)
    ulp = 2.0**-7
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    # first step, no decay: the update is -lr * g / (|g| + eps) = -lr
    lr = ulp / 2 / 4  # a quarter of the ulp below 1.0 (2**-8)
    g = torch.ones(n)
    adam_step(p, g, m, v, step=1, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, sr_seed=99)
    moved = (p != 1.0).float().mean().item()
    assert abs(moved - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5
    assert set(p.unique().tolist()) == {1.0, 1.0 - ulp / 2}
    assert abs(p.double().mean().item() - (1.0 - lr)) < 1e-4
    p_nearest = torch.ones(n)
    adam_step(p_nearest, g, torch.zeros(n), torch.zeros(n), step=1, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8)
    assert torch.equal(p_nearest.bfloat16(), torch.ones(n, dtype=torch.bfloat16))


def test_special_values_keep_their_meaning():
    p = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0] * 4, dtype=torch.bfloat16)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    adam_step(p, torch.zeros(16), m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, sr_seed=3)
    assert p[0::4].tolist() == [float("inf")] * 4 and p[1::4].tolist() == [float("-inf")] * 4
    assert p[2::4].isnan().all() and p[3::4].tolist() == [0.0] * 4


def test_compact_forms_refuse_what_they_cannot_hold():
    n = 64
    p32, p16 = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    m16, v16, g = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
    hp = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(TypeError, match="bf16 weights need bf16"):
        adam_step(p16, g, torch.zeros(n), torch.zeros(n), **hp)
    with pytest.raises(TypeError, match="exp_avg_sq must have dtype torch.bfloat16"):
        adam_step(p32, g, m16, torch.zeros(n), **hp)
    with pytest.raises(ValueError, match="amsgrad"):
        adam_step(p32, g, m16, v16, max_exp_avg_sq=torch.zeros(n), **hp)
    with pytest.raises(ValueError, match="in place"):
        adam_step(p16, g, m16, v16, param_out=torch.zeros(n, dtype=torch.bfloat16), **hp)
    with pytest.raises(ValueError, match="sr_seed"):
        adam_step(p16, g, m16, v16, sr_seed=-1, **hp)
