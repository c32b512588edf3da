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

__all__ = [
    "LossScaling",
    "OffloadConfig",
    "OffloadSession",
    "TrainingCheckpoint",
    "BackgroundCheckpoint",
    "initialize",
    "latest_training_checkpoint",
    "load_training_checkpoint",
    "save_training_checkpoint",
    "start_training_checkpoint",
    "vertical_step",
]
__version__ = "0.1.0"
