"""CPU optimizers: the fused native Adam/AdamW kernel and the optimizers built on it.

- :class:`CPUAdamW` / :class:`CPUAdam`: drop-in ``torch.optim.AdamW`` / ``Adam``
  for fp32 CPU parameters.
- :func:`adam_step` (in :mod:`nvoffload.optim.kernels`): the stateless fused
  kernel, for callers that manage their own buffers (e.g. chunks read from NVMe).
- :class:`OffloadOptimizer` / :class:`NVMeAdamW` (in :mod:`nvoffload.optim.offload`):
  a torch optimizer with its state on NVMe, updated during backward.
- :class:`WeightHome` and :class:`InFlightHome`: what holds some parameters' weights off the device (parameter
  streaming) gives the optimizer: their reads and writes, and its side of updates that land after ``step()``.
- :class:`LossScaling`: fp16 dynamic loss scaling for released gradients.
- :data:`STATE_PRECISIONS`: how the offloaded Adam(W) can keep its state (exact fp32, or compact).
- :class:`Layout` and :func:`for_optimizer`: how an optimizer's state is laid out in chunks and which update
  it runs (``initialize`` sizes the swap directories and the resident state from them).
"""

from nvoffload.optim._layout import STATE_PRECISIONS, Layout
from nvoffload.optim._updates import for_optimizer
from nvoffload.optim.cpu_adam import CPUAdam, CPUAdamW
from nvoffload.optim.kernels import adam_step
from nvoffload.optim.loss_scale import LossScaling
from nvoffload.optim.offload import (
    InFlightHome,
    MemoryStats,
    NVMeAdamW,
    OffloadIOError,
    OffloadOptimizer,
    OffloadOptimizerConfig,
    WeightHome,
)

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "InFlightHome",
    "Layout",
    "adam_step",
    "LossScaling",
    "MemoryStats",
    "NVMeAdamW",
    "OffloadOptimizerConfig",
    "OffloadIOError",
    "OffloadOptimizer",
    "STATE_PRECISIONS",
    "WeightHome",
    "for_optimizer",
]
