"""Dynamic loss scaling for fp16 when gradients are released during backward, on ``torch.amp.GradScaler``'s schedule.

``GradScaler`` finds overflows by reading every ``param.grad`` in ``step()``;
with :func:`nvoffload.initialize` the gradients are gone by then (each was
consumed as soon as it was final), so the optimizer scales instead: the loop
calls ``loss = optimizer.scale_loss(loss)`` before ``backward()``, the
optimizer unscales each gradient as it consumes it, measures whether any is
inf or NaN, and in ``step()`` skips the step on an overflow (the weights and
state stay as they were) and updates the scale exactly as ``GradScaler.update``
does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LossScaling", "DynamicLossScale"]

_FP32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class LossScaling:
    """``torch.amp.GradScaler``'s arguments, with its defaults.

    Attributes:
        init_scale: the first scale.
        growth_factor: the scale is multiplied by this after ``growth_interval``
            steps in a row without an overflow.
        backoff_factor: the scale is multiplied by this after an overflow (that step is skipped).
        growth_interval: steps without an overflow before the scale grows.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {self.init_scale!r}")
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            raise ValueError(f"growth_factor must be a finite number > 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")


class DynamicLossScale:
    """The current scale and ``GradScaler``'s growth tracker."""

    def __init__(self, config: LossScaling):
        self.config = config
        self.scale = float(config.init_scale)
        self.growth_tracker = 0  # steps in a row without an overflow

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an overflow, else grow every ``growth_interval`` steps (``GradScaler.update``)."""
        if found_inf:
            self.scale *= self.config.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.config.growth_interval:
            grown = self.scale * self.config.growth_factor
            if grown <= _FP32_MAX:  # the scale is an fp32 tensor in GradScaler: it never grows to inf
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
