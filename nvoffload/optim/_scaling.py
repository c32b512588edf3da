"""Released gradients' scaling: the fp16 loss scale, the global norm the worker measured, clipping.

With released gradients no gradient is left in memory when ``step()`` runs: the worker measured each chunk's
summed gradient (``Chunk.grad_norm``) as it took it, so the global norm, and with it clipping and the loss
scale's overflow check, are known from those norms. Every released schedule uses the one :class:`GradScaling`.
"""

from __future__ import annotations

import math

import torch

from nvoffload.optim._layout import Record
from nvoffload.optim._sharing import OneProcess
from nvoffload.optim.loss_scale import DynamicLossScale


class GradScaling:
    """The loss scale and the norm of ``records``' released gradients (see the module docs).

    Args:
        records: the optimizer's list, shared.
        max_grad_norm: clip the global norm to this (None: no clipping).
        loss_scale: the dynamic fp16 loss scale (None: no scaling).
        sharing: one process or several ranks (the norm is summed over them, and the sums made means).
    """

    def __init__(self, records: list[Record], max_grad_norm: float | None, loss_scale: DynamicLossScale | None,
                 sharing: OneProcess):  # fmt: skip
        self._records = records
        self.max_grad_norm = max_grad_norm
        self.loss_scale = loss_scale
        self._sharing = sharing
        self.last_grad_norm: float | None = None  # the global norm the last step() used
        self.clipped = False  # the last step's clipping coefficient was below 1

    @property
    def unscale(self) -> float:
        """What the gradients measured and used are multiplied by: the loss scale undone, and over several ranks,
        their sum turned into the mean."""
        unscale = 1.0 if self.loss_scale is None else 1.0 / self.loss_scale.scale
        return unscale * self._sharing.mean  # exactly unscale on one process (times 1.0)

    def clipping_coefficient(self) -> float | None:
        """The gradients' norm measured, what clipping multiplies them by (1.0 without clipping, and ``clipped``
        says whether it bit); None after an fp16 overflow (the loss scale backs off: skip the step)."""
        norm = self._global_norm()
        self.last_grad_norm = float(norm)
        if self.loss_scale is not None and not math.isfinite(self.last_grad_norm):
            self.loss_scale.update(found_inf=True)
            return None
        coef = 1.0
        if self.max_grad_norm is not None:
            coef = float(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))  # as clip_grad_norm_, in fp32
        self.clipped = coef < 1.0
        return coef

    def stepped(self) -> None:
        """The step's updates are kept: the loss scale grows on its schedule."""
        if self.loss_scale is not None:
            self.loss_scale.update(found_inf=False)

    def grad_norm(self) -> float | None:
        """The global L2 norm of the gradients since the last ``step()`` (summed over its micro-batches,
        unscaled), or of the last step's when none came since (None before any). Call after the update requests
        were drained (``wait_idle``)."""
        if not any(r.fires for r in self._records):
            return self.last_grad_norm
        return float(self._global_norm())

    def _global_norm(self) -> torch.Tensor:
        """The norm of the measured gradients, computed as ``clip_grad_norm_`` does (fp32: the norm of the
        parameters' norms, in group order), unscaled."""
        norms = []
        for rec in self._records:
            if rec.fires and rec.chunks:
                chunks = [c.grad_norm for c in rec.chunks]
                norms.append(chunks[0] if len(chunks) == 1 else math.sqrt(math.fsum(n * n for n in chunks)))
        return self._sharing.norm(norms, self.unscale)
