"""The fused CPU Adam/AdamW kernel: one pass over memory per update.

:func:`adam_step` updates contiguous fp32 master weights and Adam moments in
place from an fp32, bf16 or fp16 gradient, with AdamW's decoupled weight decay
or Adam's L2 penalty, bias correction, a gradient scale factor (loss-scale
unscaling, clipping) and an optional bf16/fp16 copy of the updated weights,
all fused in one multi-threaded, vectorized pass. The arithmetic is that of
torch's fused CPU kernel, operation by operation (same fp32 roundings, same
fused multiply-adds), so results equal ``torch.optim.AdamW(fused=True)`` /
``torch.optim.Adam(fused=True)`` bit for bit, for every tensor size: torch
runs a vector loop of 8 floats (its AVX2 kernel, also on AVX-512 CPUs) and a
scalar loop over the last ``numel % 8`` elements of each tensor, which rounds
``exp_avg_sq`` differently, and the kernel does the same for those elements
(``offset``/``tensor_numel`` place a slice in its tensor). Against torch's
default CPU path (``foreach=False``) the weights and moments agree to within a
few fp32 ulps: that path rounds the tail like the rest, and its ``sqrt`` on
large tensors goes through MKL, sometimes an ulp off.

Compact state (opt-in, not exact AdamW): with bf16 ``exp_avg``/``exp_avg_sq`` the
same fp32 arithmetic runs and the moments are rounded to nearest even when
stored (an fp32 master: 8 bytes a parameter instead of 12); with bf16 weights
too (no fp32 master: 4 bytes a parameter beside the weights) the weights are
updated in place and rounded *stochastically*: up with probability the
fraction of a bf16 ulp dropped, from a hash of ``sr_seed`` and the element's
index in its tensor, so that updates smaller than half an ulp still move the
weights on average, and a step is reproducible whatever the threads or chunks.
With uint8 ``exp_avg``/``exp_avg_sq`` (and ``moment_exponents``) the moments take one
byte each: float8 e4m3 codes of the value (of ``exp_avg_sq``'s square root) over
a power-of-two scale per block of :data:`FP8_BLOCK` elements, rounded
stochastically after each update (see :func:`decode_moment`); the weights are
fp32 or bf16 as above.

The instruction set (AVX-512, AVX2+FMA+F16C, NEON or scalar) is chosen at run
time from the CPU's features; the work runs on a persistent native thread pool
with the GIL released.

Example::

    import torch
    from nvoffload.optim.kernels import adam_step

    p = torch.randn(1 << 20)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.randn(1 << 20, dtype=torch.bfloat16)
    p_bf16 = torch.empty_like(p, dtype=torch.bfloat16)
    adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01, param_out=p_bf16)
"""

from __future__ import annotations

import math
import operator

import torch
from torch.autograd.graph import increment_version

from nvoffload.core.native import native_module

__all__ = [
    "FP8_BLOCK",
    "adam_step",
    "bandwidth_probe",
    "current_isa",
    "decode_moment",
    "encode_moment",
    "fp8_blocks",
    "get_num_threads",
    "set_isa",
    "set_num_threads",
    "supported_isas",
]

_adam = native_module("nvoffload.optim._adam")

_GRAD_DTYPES = {torch.float32: _adam.FLOAT32, torch.bfloat16: _adam.BFLOAT16, torch.float16: _adam.FLOAT16}
# Floats per vector of torch's fused CPU Adam: its last numel % 8 elements of a tensor take the scalar loop.
_TORCH_VECTOR_FLOATS = 8
_OUT_DTYPES = {torch.bfloat16: _adam.BFLOAT16, torch.float16: _adam.FLOAT16}
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
# (weights, moments) -> the kernel's state form
_STATE_FORMS = {
    (torch.float32, torch.float32): _adam.STATE_FP32,
    (torch.float32, torch.bfloat16): _adam.STATE_BF16_MOMENTS,
    (torch.bfloat16, torch.bfloat16): _adam.STATE_BF16,
    (torch.float32, torch.uint8): _adam.STATE_FP8_MOMENTS,
    (torch.bfloat16, torch.uint8): _adam.STATE_FP8,
}
FP8_BLOCK: int = _adam.FP8_BLOCK  # elements per scale of the 8-bit moments
_FP8_MAX = 448.0  # float8 e4m3fn's largest value


def _check_buffer(name: str, t: object, dtypes: dict | tuple, numel: int | None) -> torch.Tensor:
    """Validate one buffer: a dense contiguous CPU tensor of an allowed dtype and the expected size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout} (sparse gradients are not supported)")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but param has {numel}")
    return t


def _check_buffers(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    max_exp_avg_sq: torch.Tensor | None,
    moment_exponents: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Validate the buffers of one update (fp32 everywhere, or a compact state form); returns them by name."""
    fp32 = (torch.float32,)
    _check_buffer("param", param, _STATE_DTYPES, None)
    n = param.numel()
    buffers = {
        "param": param,
        "grad": _check_buffer("grad", grad, _GRAD_DTYPES, n),
        "exp_avg": _check_buffer("exp_avg", exp_avg, _MOMENT_DTYPES, n),
        "exp_avg_sq": _check_buffer("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n),
    }
    if (param.dtype, exp_avg.dtype) not in _STATE_FORMS:
        raise TypeError(
            "bf16 weights need bf16 or uint8 (8-bit) exp_avg and exp_avg_sq (the compact states without an fp32 master)"
        )
    if exp_avg.dtype == torch.uint8:
        if moment_exponents is None:
            raise ValueError("8-bit moments need moment_exponents (int8, 2 x fp8_blocks(numel): the blocks' scales)")
        exponents = 2 * fp8_blocks(n)
        buffers["moment_exponents"] = _check_buffer("moment_exponents", moment_exponents, (torch.int8,), exponents)
    elif moment_exponents is not None:
        raise ValueError("moment_exponents is for 8-bit (uint8) moments")
    if param_out is not None:
        if param.dtype != torch.float32:
            raise ValueError("param_out is for fp32 weights (bf16 weights are updated in place)")
        buffers["param_out"] = _check_buffer("param_out", param_out, _OUT_DTYPES, n)
    if max_exp_avg_sq is not None:
        if exp_avg.dtype != torch.float32:
            raise ValueError("max_exp_avg_sq (amsgrad) needs fp32 moments")
        buffers["max_exp_avg_sq"] = _check_buffer("max_exp_avg_sq", max_exp_avg_sq, fp32, n)
    _check_disjoint(buffers)
    return buffers


def _check_disjoint(buffers: dict[str, torch.Tensor]) -> None:
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in buffers.items() if t.numel() > 0
    )
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name} and {other} overlap in memory; every buffer of adam_step must be distinct")


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    grad_scale: float = 1.0,
    maximize: bool = False,
    param_out: torch.Tensor | None = None,
    max_exp_avg_sq: torch.Tensor | None = None,
    offset: int = 0,
    tensor_numel: int | None = None,
    sr_seed: int = 0,
    moment_exponents: torch.Tensor | None = None,
) -> None:
    """One fused Adam/AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` in place.

    Args:
        param, exp_avg, exp_avg_sq: contiguous CPU tensors of equal numel: all fp32 (exact AdamW), fp32
            weights with bf16 moments, or all bf16 (the weights rounded stochastically); or 8-bit moments (uint8)
            beside fp32 or bf16 weights (see the module docs).
        grad: contiguous CPU fp32, bf16 or fp16 tensor of the same numel; the
            gradient used is ``grad * grad_scale`` (negated if ``maximize``).
        step: the 1-based step count used for bias correction (torch's
            ``state["step"]`` after its increment).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        decoupled_weight_decay: True is AdamW (``param *= 1 - lr * weight_decay``),
            False is Adam's L2 penalty (``grad += weight_decay * param``).
        grad_scale: factor applied to the gradient (e.g. ``1 / loss_scale``, or
            a clipping coefficient).
        maximize: ascend instead of descend, as in torch.
        param_out: optional contiguous bf16/fp16 tensor that receives the updated
            weights rounded to nearest even, in the same pass.
        max_exp_avg_sq: the AMSGrad running maximum (fp32, same numel); when
            given, the update is AMSGrad's, as ``torch.optim.AdamW(amsgrad=True)``.
        offset, tensor_numel: the buffers are the flat elements ``[offset, offset + numel)`` of a tensor
            of ``tensor_numel`` elements (default: the whole tensor), so that the tensor's last
            ``tensor_numel % 8`` elements get the arithmetic torch gives them (and bf16 weights the random
            bits of their index in the tensor).
        sr_seed: bf16 weights and 8-bit moments: the stochastic rounding's seed (an unsigned 64-bit int; one per
            tensor and step, so that no two updates of an element draw the same bits).
        moment_exponents: with uint8 (8-bit) ``exp_avg`` and ``exp_avg_sq``: each block's scale exponent
            (int8, ``exp_avg``'s :func:`fp8_blocks` then ``exp_avg_sq``'s), read and rewritten in place. Blocks
            count from the buffers' first element.

    Raises:
        TypeError: a buffer is not a tensor or has the wrong dtype.
        ValueError: a buffer is non-contiguous, sparse, off the CPU, of another
            size or overlapping another; a hyperparameter is NaN/inf or out of range;
            ``offset``/``tensor_numel`` that cannot hold the buffers.
    """
    buffers = _check_buffers(param, grad, exp_avg, exp_avg_sq, param_out, max_exp_avg_sq, moment_exponents)
    n = param.numel()
    step, sr_seed = _checked_step(step), _checked_seed(sr_seed)
    lr, beta1, beta2, eps = _finite("lr", lr), _finite("beta1", beta1), _finite("beta2", beta2), _finite("eps", eps)
    weight_decay, grad_scale = _finite("weight_decay", weight_decay), _finite("grad_scale", grad_scale)
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    offset, total = _checked_span(n, offset, tensor_numel)
    if n == 0:
        return
    tail_from = min(max(total - total % _TORCH_VECTOR_FLOATS - offset, 0), n)
    optional = [0 if t is None else t.data_ptr() for t in (max_exp_avg_sq, moment_exponents, param_out)]
    _adam.adam_step(
        param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), *optional, n, tail_from,
        _GRAD_DTYPES[grad.dtype], _adam.NONE if param_out is None else _OUT_DTYPES[param_out.dtype],
        _STATE_FORMS[param.dtype, exp_avg.dtype], sr_seed, offset, step, lr, beta1, beta2, eps, weight_decay,
        bool(decoupled_weight_decay), grad_scale, bool(maximize),
    )  # fmt: skip
    # The native code wrote through raw pointers: bump the version counters as
    # an in-place torch op would, so autograd notices stale saved tensors.
    increment_version([t for name, t in buffers.items() if name != "grad"])


def _checked_step(step: int) -> int:
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, got {type(step).__name__}") from None
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based, as torch counts after its increment), got {step}")
    return step


def _checked_seed(sr_seed: int) -> int:
    sr_seed = operator.index(sr_seed)
    if not 0 <= sr_seed < 1 << 64:
        raise ValueError(f"sr_seed must be an unsigned 64-bit int, got {sr_seed}")
    return sr_seed


def _checked_span(n: int, offset: int, tensor_numel: int | None) -> tuple[int, int]:
    """``(offset, tensor_numel)`` of buffers of ``n`` elements within their tensor, checked."""
    offset, total = operator.index(offset), n if tensor_numel is None else operator.index(tensor_numel)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if offset + n > total:
        raise ValueError(f"offset {offset} + {n} elements exceeds tensor_numel {total}")
    return offset, total


def fp8_blocks(numel: int) -> int:
    """Scale blocks of one 8-bit moment of ``numel`` elements (the last may be partial)."""
    return -(-numel // FP8_BLOCK)


def decode_moment(codes: torch.Tensor, exponents: torch.Tensor, *, root: bool = False) -> torch.Tensor:
    """The fp32 values of one 8-bit moment: ``codes`` (uint8, float8 e4m3fn bits) times each block's
    ``2 ** exponents`` (int8, one per :data:`FP8_BLOCK` elements), squared for ``exp_avg_sq`` (``root``: the
    codes hold its square root). Every value is exact in fp32."""
    values = codes.view(torch.float8_e4m3fn).float()
    scales = torch.ldexp(torch.ones(exponents.numel()), exponents.float())
    values.mul_(scales.repeat_interleave(FP8_BLOCK)[: values.numel()])
    return values.mul_(values) if root else values


def encode_moment(values: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor, *, root: bool = False) -> None:
    """Write fp32 ``values`` of one moment into ``codes`` and ``exponents`` (as :func:`decode_moment` reads them;
    ``root``: ``exp_avg_sq``, kept as its square root), with the kernel's scales and rounded to nearest even:
    values decoded from codes are encoded back to the same values."""
    x = values.float().sqrt() if root else values.float()
    n = x.numel()
    blocks = torch.zeros(fp8_blocks(n) * FP8_BLOCK)
    blocks[:n] = x.abs().reshape(-1)
    absmax = blocks.view(-1, FP8_BLOCK).amax(dim=1)
    k = torch.frexp(absmax).exponent - 9  # absmax 2^-k in [256, 512)
    k = torch.where(torch.ldexp(absmax, -k.float()) > _FP8_MAX, k + 1, k).clamp_(min=-126)
    k = torch.where((absmax > 0) & torch.isfinite(absmax), k, torch.zeros_like(k))
    exponents.copy_(k)
    inverse = torch.ldexp(torch.ones(k.numel()), -k.float()).repeat_interleave(FP8_BLOCK)[:n]
    encoded = (x.reshape(-1) * inverse).to(torch.float8_e4m3fn).view(torch.uint8)
    if root:  # a nonzero root never rounds to zero (its square is a denominator)
        encoded = torch.where((encoded == 0) & (x.reshape(-1) > 0), torch.ones_like(encoded), encoded)
    codes.copy_(encoded.view(codes.shape))


def bandwidth_probe(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None = None,
) -> None:
    """Move exactly the bytes :func:`adam_step` moves, with trivial arithmetic.

    Reads the three fp32 arrays and ``grad``, writes the three back (``+= grad``)
    and, when given, writes ``param_out``: the memory-bandwidth limit of the
    update's access pattern, measured by the same threads and instruction set.
    Overwrites the contents of every buffer (benchmark use only).
    """
    _check_buffers(param, grad, exp_avg, exp_avg_sq, param_out, None, None)
    if param.dtype != torch.float32 or exp_avg.dtype != torch.float32:
        raise TypeError("bandwidth_probe moves the fp32 state's bytes: param, exp_avg and exp_avg_sq must be fp32")
    n = param.numel()
    _adam.stream_probe(
        param.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        grad.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        n,
        _GRAD_DTYPES[grad.dtype],
        _adam.NONE if param_out is None else _OUT_DTYPES[param_out.dtype],
    )


def set_num_threads(num_threads: int) -> None:
    """Threads the kernel uses (the caller counts as one); 0 restores the default, the CPUs this process may run on."""
    _adam.set_num_threads(operator.index(num_threads))


def get_num_threads() -> int:
    """Threads the kernel uses."""
    return _adam.get_num_threads()


def supported_isas() -> list[str]:
    """Kernel variants this CPU can run: a subset of ``["scalar", "avx2", "avx512", "neon"]``."""
    return list(_adam.supported_isas())


def current_isa() -> str:
    """The kernel variant in use (by default the best one :func:`supported_isas` lists)."""
    return _adam.current_isa()


def set_isa(name: str) -> str:
    """Use the named kernel variant (``"auto"`` = the best one); returns the previous one.

    Raises ValueError for an unknown name or one this CPU does not support.
    """
    return _adam.set_isa(name)
