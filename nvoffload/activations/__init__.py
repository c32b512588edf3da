"""Activation offload: the tensors forward saves for backward, moved to NVMe or host memory.

:class:`offload_activations` is a ``saved_tensors_hooks`` context manager (like
``torch.autograd.graph.save_on_cpu``) with deduplication, forwarding of the most
recent tensors and prefetch in backward order. :class:`SavedTensorCounter`
counts what saved tensors hold, for comparisons with other strategies.
"""

from .config import ActivationOffloadConfig, OffloadStats
from .counting import SavedTensorCounter
from .offload import ActivationIOError, offload_activations

__all__ = ["offload_activations", "ActivationIOError", "ActivationOffloadConfig", "OffloadStats", "SavedTensorCounter"]
