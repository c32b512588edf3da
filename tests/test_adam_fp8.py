"""The fused kernel's 8-bit moments against the exact update they round.

An 8-bit form decodes the moments (float8 e4m3 codes over a power-of-two scale per block of 256 elements, the
second moment kept as its square root), runs the exact kernel's fp32 arithmetic, and rounds the new moments
stochastically at each block's new scale. So: the weights are the exact update from the decoded moments, bit for
bit (bf16 weights rounded as the bf16 form rounds them); each new moment is one of the two codes around the exact
value at the scale the rule gives; the rounding is unbiased; and every instruction set gives the same bytes.
"""

import pytest
import torch
from test_adam_compact import HYPER, ISAS, isa, stochastic_bf16  # noqa: F401 (isa: the fixture, every instruction set)

from nvoffload.optim import kernels
from nvoffload.optim.kernels import FP8_BLOCK, adam_step, decode_moment, encode_moment, fp8_blocks

SIZES = [1, 7, 300, 65537, 2 * 65536 + 5]


def fp8_state(n, seed=0, *, bf16_weights=False):
    """Weights, 8-bit moments (encoded from random fp32 ones) with their exponents, and a gradient."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1 * torch.rand(n, generator=gen)  # magnitudes spread within blocks
    v = torch.rand(n, generator=gen) ** 4 * 0.01
    g = torch.randn(n, generator=gen)
    codes = torch.empty(2, n, dtype=torch.uint8)
    exponents = torch.empty(2, fp8_blocks(n), dtype=torch.int8)
    encode_moment(m, codes[0], exponents[0])
    encode_moment(v, codes[1], exponents[1], root=True)
    return (p.bfloat16() if bf16_weights else p), codes, exponents, g


def decoded(codes, exponents):
    return decode_moment(codes[0], exponents[0]), decode_moment(codes[1], exponents[1], root=True)


def reference(p, codes, exponents, g, **kw):
    """The exact kernel on the decoded moments (no tail: the 8-bit forms use torch's vector formula throughout):
    fp32 weights, exp_avg and exp_avg_sq."""
    p32 = p.float()
    m, v = decoded(codes, exponents)
    n = p.numel()
    adam_step(p32, g, m, v, tensor_numel=n + (-n % 8), **kw)
    return p32, m, v


def neighbours(x):
    """The float8 e4m3 magnitudes just below and just above ``|x|`` (equal when ``|x|`` is one)."""
    a = x.abs()
    nearest = a.to(torch.float8_e4m3fn)
    code = nearest.view(torch.uint8).to(torch.int32)
    value = nearest.float()
    other = torch.where(value <= a, code + 1, code - 1).clamp(0, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()
    low, high = torch.minimum(value, other), torch.maximum(value, other)
    exact = value == a
    return torch.where(exact, a, low), torch.where(exact, a, high)


def assert_rounded(codes, exponents, want, *, root=False):
    """Each code is one of the two around ``want`` (the exact moment; its square root for ``root``) at its block's
    scale, and the scale is the rule's: the largest magnitude of a block in (224, 448]."""
    target = want.sqrt() if root else want
    expected_codes, expected_exponents = torch.empty_like(codes), torch.empty_like(exponents)
    encode_moment(want, expected_codes, expected_exponents, root=root)
    assert torch.equal(exponents, expected_exponents)
    scale = torch.ldexp(torch.ones(exponents.numel()), exponents.float()).repeat_interleave(FP8_BLOCK)[: want.numel()]
    x = target / scale
    got = codes.view(torch.float8_e4m3fn).float()
    low, high = neighbours(x)
    assert ((got.abs() == low) | (got.abs() == high)).all()
    assert ((got == 0) | (got.sign() == x.sign())).all()
    if root:
        assert not ((got == 0) & (x > 0)).any()  # a nonzero root never rounds to zero


@pytest.mark.parametrize("bf16_weights", [False, True], ids=["fp32-master", "bf16-weights"])
@pytest.mark.parametrize("n", SIZES)
def test_8bit_moments_are_the_exact_update_rounded_stochastically(isa, n, bf16_weights):
    p, codes, exponents, g = fp8_state(n, bf16_weights=bf16_weights)
    for step, seed in [(1, 5), (7, 6)]:
        hp = dict(step=step, **HYPER)
        want_p, want_m, want_v = reference(p, codes, exponents, g, **hp)
        adam_step(p, g, codes[0], codes[1], moment_exponents=exponents.view(-1), sr_seed=seed, **hp)
        if bf16_weights:
            assert torch.equal(p, stochastic_bf16(want_p, seed, 0))
        else:
            assert torch.equal(p, want_p)
        assert_rounded(codes[0], exponents[0], want_m)
        assert_rounded(codes[1], exponents[1], want_v, root=True)


def test_a_block_across_two_to_the_32_elements(isa):
    """A slice whose blocks straddle the 2**32nd element: each element's rounding bits come from its own index (the
    key changes with the index's high word), and every value is still one of its two codes."""
    n, offset = 600, 2**32 - 300
    p, codes, exponents, g = fp8_state(n, seed=4, bf16_weights=True)
    want_p, want_m, want_v = reference(p, codes, exponents, g, step=3, **HYPER)
    adam_step(p, g, codes[0], codes[1], moment_exponents=exponents.view(-1), sr_seed=8, step=3, offset=offset,
              tensor_numel=offset + n + (-n % 8), **HYPER)  # fmt: skip
    assert torch.equal(p, stochastic_bf16(want_p, 8, offset))
    assert_rounded(codes[0], exponents[0], want_m)
    assert_rounded(codes[1], exponents[1], want_v, root=True)


def test_every_instruction_set_gives_the_same_bytes():
    results = []
    for name in ISAS:
        previous = kernels.set_isa(name)
        try:
            p, codes, exponents, g = fp8_state(2 * 65536 + 5, seed=3, bf16_weights=True)
            adam_step(p, g, codes[0], codes[1], moment_exponents=exponents.view(-1), sr_seed=9, step=3, **HYPER)
        finally:
            kernels.set_isa(previous)
        results.append((p, codes, exponents))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_the_moments_rounding_is_unbiased():
    """Over many seeds the decoded new moments average the exact ones to within a small fraction of a code step
    (the bits are uniform, each rounding up with probability the fraction dropped)."""
    n, draws = FP8_BLOCK, 400
    p, codes, exponents, g = fp8_state(n, seed=1)
    _, want_m, want_v = reference(p, codes, exponents, g, step=2, **HYPER)
    total_m, total_r = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for seed in range(draws):
        c, e = codes.clone(), exponents.clone()
        adam_step(p.clone(), g, c[0], c[1], moment_exponents=e.view(-1), sr_seed=seed, step=2, **HYPER)
        total_m += decode_moment(c[0], e[0]).double()
        total_r += decode_moment(c[1], e[1]).double()  # the roots, as rounded
    for total, want in ((total_m, want_m), (total_r, want_v.sqrt())):
        low, high = neighbours(want)
        step = (high - low).double()
        inexact = step > 0
        error = (total / draws - want.double()).abs()
        assert (error[inexact] < 0.2 * step[inexact]).all()  # 8 standard errors at worst
        assert error[inexact].mean() < 0.05 * step[inexact].mean()


def test_decoded_moments_encode_back_to_the_same_values():
    """What a state dict holds (the decoded fp32 moments) loads back into the same values, whatever scales."""
    p, codes, exponents, g = fp8_state(1000, seed=2)
    adam_step(p, g, codes[0], codes[1], moment_exponents=exponents.view(-1), sr_seed=1, step=4, **HYPER)
    m, v = decoded(codes, exponents)
    again, again_exponents = torch.empty_like(codes), torch.empty_like(exponents)
    encode_moment(m, again[0], again_exponents[0])
    encode_moment(v, again[1], again_exponents[1], root=True)
    m2, v2 = decoded(again, again_exponents)
    assert torch.equal(m, m2) and torch.equal(v, v2)


def test_blocks_of_zeros_and_a_tiny_root_beside_a_large_one():
    n = 2 * FP8_BLOCK
    p, g = torch.zeros(n), torch.zeros(n)
    g[FP8_BLOCK] = 1e4  # the second block's largest gradient: the root of the next is 1e-20 of its root
    g[FP8_BLOCK + 1] = 1e-16
    codes = torch.zeros(2, n, dtype=torch.uint8)
    exponents = torch.zeros(2, 2, dtype=torch.int8)
    adam_step(p, g, codes[0], codes[1], moment_exponents=exponents.view(-1), sr_seed=2, step=1, **HYPER)
    assert (codes[:, :FP8_BLOCK] == 0).all() and exponents[:, 0].tolist() == [0, 0]
    assert codes[1, FP8_BLOCK + 1] == 1  # the smallest code, not zero: its square stays a denominator
    assert torch.isfinite(p).all() and p.abs().max() < 1.0


def test_a_nan_or_an_infinity_takes_its_block_not_the_others(isa):
    """A non-finite gradient makes its element's moments NaN codes (e4m3fn has no infinity) and its block's scale
    2^0 (the largest magnitude is not a number); the other elements of the block are rounded at that scale, and the
    other blocks are untouched by it."""
    n = 3 * FP8_BLOCK
    p, codes, exponents, g = fp8_state(n, seed=5)
    g[3] = float("nan")
    g[FP8_BLOCK + 9] = float("inf")
    _, want_m, want_v = reference(p, codes, exponents, g, step=2, **HYPER)
    adam_step(p, g, codes[0], codes[1], moment_exponents=exponents.view(-1), sr_seed=3, step=2, **HYPER)
    for moment, (want, root) in enumerate(((want_m, False), (want_v, True))):
        assert exponents[moment, :2].tolist() == [0, 0]
        bad = ~torch.isfinite(want)
        assert bad.nonzero().flatten().tolist() == [3, FP8_BLOCK + 9]
        assert ((codes[moment][bad] & 0x7F) == 0x7F).all()
        expected_codes, expected_exponents = torch.empty_like(codes[moment]), torch.empty_like(exponents[moment])
        encode_moment(want, expected_codes, expected_exponents, root=root)
        assert torch.equal(exponents[moment], expected_exponents)
        assert_rounded(codes[moment][2 * FP8_BLOCK :], exponents[moment][2:], want[2 * FP8_BLOCK :], root=root)
        good = ~bad[: 2 * FP8_BLOCK]
        got = codes[moment][: 2 * FP8_BLOCK][good].view(torch.float8_e4m3fn).float()
        low, high = neighbours((want.sqrt() if root else want)[: 2 * FP8_BLOCK][good])  # at the scale 2^0
        assert ((got.abs() == low) | (got.abs() == high)).all()
    assert torch.isnan(p[[3, FP8_BLOCK + 9]]).all() and torch.isfinite(p[2 * FP8_BLOCK :]).all()


def test_8bit_moments_refuse_what_they_cannot_hold():
    n = 64
    p32, g = torch.zeros(n), torch.zeros(n)
    m8, v8 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    hp = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="need moment_exponents"):
        adam_step(p32, g, m8, v8, **hp)
    with pytest.raises(ValueError, match="moment_exponents has 1 elements"):
        adam_step(p32, g, m8, v8, moment_exponents=torch.zeros(1, dtype=torch.int8), **hp)
    with pytest.raises(ValueError, match="for 8-bit"):
        adam_step(p32, g, torch.zeros(n), torch.zeros(n), moment_exponents=torch.zeros(2, dtype=torch.int8), **hp)
    with pytest.raises(ValueError, match="amsgrad"):
        adam_step(p32, g, m8, v8, moment_exponents=torch.zeros(2, dtype=torch.int8), max_exp_avg_sq=torch.zeros(n), **hp)
