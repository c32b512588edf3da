"""nvoffload: train models larger than GPU and CPU memory on one server.

Parameters, optimizer states and activations live on NVMe SSDs and stream
through pinned host memory to the device; the CPU Adam step overlaps SSD I/O and
backward compute.

Subpackages:

- :mod:`nvoffload.io` -- async O_DIRECT I/O engine, aligned buffers, tensor store.
- :mod:`nvoffload.optim` -- fused CPU Adam/AdamW and the NVMe-offloaded optimizer.
- :mod:`nvoffload.activations` -- saved-tensor offload for activations.
- :mod:`nvoffload.streaming` -- parameter streaming, block by block.
- :mod:`nvoffload.memory` -- the budgets of the device and host tiers.
- :mod:`nvoffload.device` -- the thin CUDA layer (everything else is device-neutral).

:func:`initialize` with an :class:`OffloadConfig` puts all of them to work on a
model and its optimizer; :func:`vertical_step` runs a step's micro-batches block by block
(:mod:`nvoffload.vertical`); :func:`save_training_checkpoint` and
:func:`load_training_checkpoint` save and resume a run (:mod:`nvoffload.training_checkpoint`);
:func:`start_training_checkpoint` saves one while training goes on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The API by the module that holds each name. Imported when first used (``__getattr__``): ``import nvoffload`` (and
# ``nvoffload.cli``) imports neither torch nor the native core, so the command line answers a Ctrl-C that comes while
# torch is still loading in one line (:func:`nvoffload.cli.main`).
_API = {
    "LossScaling": "nvoffload.optim.loss_scale",
    "OffloadConfig": "nvoffload.training",
    "OffloadSession": "nvoffload.training",
    "initialize": "nvoffload.training",
    "BackgroundCheckpoint": "nvoffload.training_checkpoint",
    "TrainingCheckpoint": "nvoffload.training_checkpoint",
    "latest_training_checkpoint": "nvoffload.training_checkpoint",
    "load_training_checkpoint": "nvoffload.training_checkpoint",
    "save_training_checkpoint": "nvoffload.training_checkpoint",
    "start_training_checkpoint": "nvoffload.training_checkpoint",
    "vertical_step": "nvoffload.vertical",
}
__all__ = sorted(_API)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from nvoffload.optim.loss_scale import LossScaling
    from nvoffload.training import OffloadConfig, OffloadSession, initialize
    from nvoffload.training_checkpoint import (
        BackgroundCheckpoint,
        TrainingCheckpoint,
        latest_training_checkpoint,
        load_training_checkpoint,
        save_training_checkpoint,
        start_training_checkpoint,
    )
    from nvoffload.vertical import vertical_step


def __getattr__(name: str):
    """A name of the API, or a subpackage or module (``nvoffload.streaming``), imported on first use."""
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
