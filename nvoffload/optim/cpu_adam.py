"""Drop-in ``torch.optim.AdamW`` / ``torch.optim.Adam`` for CPU tensors on the fused native kernel.

:class:`CPUAdamW` and :class:`CPUAdam` subclass torch's own ``AdamW`` and
``Adam``: the constructor, its validation, ``param_groups``, ``state_dict`` /
``load_state_dict`` (state keys ``step``, ``exp_avg``, ``exp_avg_sq`` and
``max_exp_avg_sq``), LR schedulers and ``zero_grad`` are torch's, so checkpoints
move freely between torch's optimizers and these. Only ``step`` differs: each
parameter is updated by one call of :func:`nvoffload.optim.kernels.adam_step`,
which fuses the whole update in one multi-threaded, vectorized pass.

Example::

    model = torch.nn.Linear(1024, 1024)
    opt = CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss = model(torch.randn(8, 1024)).square().mean()
    loss.backward()
    opt.step()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from nvoffload.optim.kernels import adam_step

__all__ = ["CPUAdam", "CPUAdamW"]


def _check_finite(lr: object, betas: tuple, eps: object, weight_decay: object) -> None:
    """Reject NaN/inf hyperparameters (torch's range checks let inf through)."""
    for name, value in (("lr", lr), ("beta1", betas[0]), ("beta2", betas[1]), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        if not math.isfinite(float(value)):
            raise ValueError(f"Invalid {name}: {float(value)} (must be finite)")


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory (a permutation of a contiguous layout)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dense with the same strides (ignoring size-1 dimensions)."""
    if a.is_contiguous() and b.is_contiguous():
        return a.shape == b.shape
    return (
        a.shape == b.shape
        and _is_dense(a)
        and all(sa == sb or n == 1 for sa, sb, n in zip(a.stride(), b.stride(), a.shape))
    )


def _dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """``t``, or a 1-D view of all its elements in memory order; None if they do not fill one block."""
    if t.is_contiguous():
        return t  # the kernel takes any contiguous shape
    if _is_dense(t):
        return t.as_strided((t.numel(),), (1,))
    return None


class _FusedStep:
    """``step`` for torch's Adam family, on the native kernel (mixed in before torch's class)."""

    param_groups: list[dict]
    state: dict

    def _state_for(self, p: torch.Tensor, work: torch.Tensor, amsgrad: bool) -> dict:
        """The parameter's state, created lazily with ``work``'s memory layout (as torch does)."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(work, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(work, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(work, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            # Loaded state may have another layout than the parameter (e.g. saved
            # contiguous): give it the parameter's once, so one flat pass fits all.
            if key in state and not _same_layout(state[key], work):
                state[key] = torch.empty_like(work).copy_(state[key])
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform a single optimization step.

        Args:
            closure: a closure that reevaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = (float(b) for b in group["betas"])
            amsgrad = bool(group["amsgrad"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, p.grad, group, beta1, beta2, amsgrad)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict, beta1: float, beta2: float, amsgrad: bool) -> None:
        if grad.is_sparse:
            raise ValueError(f"{type(self).__name__} does not support sparse gradients (parameter of shape {tuple(p.shape)})")
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise TypeError(
                f"{type(self).__name__} updates fp32 CPU parameters; got {p.dtype} on {p.device} (shape {tuple(p.shape)})"
            )
        dense = _dense_flat(p) is not None
        work = p if dense else p.contiguous()  # a parameter with gaps in memory goes through a copy
        state = self._state_for(p, work, amsgrad)
        if not _same_layout(grad, work):
            grad = torch.empty_like(work, dtype=grad.dtype).copy_(grad)
        state["step"] += 1
        max_exp_avg_sq = state["max_exp_avg_sq"] if amsgrad else None
        adam_step(
            _dense_flat(work),
            _dense_flat(grad),
            _dense_flat(state["exp_avg"]),
            _dense_flat(state["exp_avg_sq"]),
            step=int(state["step"].item()),
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            maximize=bool(group["maximize"]),
            max_exp_avg_sq=None if max_exp_avg_sq is None else _dense_flat(max_exp_avg_sq),
        )
        if not dense:
            p.copy_(work)


class CPUAdamW(_FusedStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` for fp32 CPU parameters, stepped by the fused native kernel.

    Same arguments, defaults, validation, ``state_dict`` and scheduler behaviour
    as ``torch.optim.AdamW`` (results equal ``AdamW(fused=True)``'s bit for bit, and
    its default path's to within fp32 rounding: see :mod:`nvoffload.optim.kernels`);
    ``amsgrad`` and ``maximize`` are supported. Also
    rejects NaN/inf hyperparameters with ``ValueError``; sparse gradients raise
    ``ValueError`` and non-fp32 or non-CPU parameters ``TypeError`` at ``step``.
    A tensor ``lr`` (1 element) is read as a float at each step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=False)
        _check_finite(lr, betas, eps, weight_decay)


class CPUAdam(_FusedStep, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay) for fp32 CPU parameters, stepped by the fused native kernel.

    The counterpart of :class:`CPUAdamW` with ``torch.optim.Adam``'s defaults
    (``weight_decay=0``, ``decoupled_weight_decay=False``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=False,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        _check_finite(lr, betas, eps, weight_decay)
