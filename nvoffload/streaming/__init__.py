"""Parameter streaming: each block's weights live on NVMe, on the device only while the block runs.

:class:`ParameterStreamer` splits a model into *blocks* (the entries of its
``ModuleList`` of layers) and moves each block's parameters through three tiers:

- the store (:mod:`nvoffload.io`): one flat byte tensor per block (its parameters
  at aligned offsets, each with its own dtype), its home;
- host memory (``_host_cache``): copies of blocks in the transfer engine's
  host slab, least recently used first out, within that slab (the
  :class:`~nvoffload.memory.MemoryManager`'s host tier is the slab's accounting); the
  optimizer reads and writes weights there, and a changed block is written
  back before it leaves;
- the device (``_residency``): a block while a forward, a backward
  (``_backward`` says when a pass is done with it) or a ``load_state_dict``
  holds it, and the next block while it arrives (copied by the
  :class:`~nvoffload.transfer.TransferEngine` as the block before it
  computes); off the device its parameters hold no bytes and refuse reads
  (``_guard``).

``_blocks`` partitions a model into blocks and lays each out, ``_hf_models``
matches a checkpoint's names to the model's (``_peft``: through PEFT's
wrapping), ``_materialize`` fills a model built on the meta device block by
block, ``_weights`` serves the current weights to the optimizer (it is its
:class:`~nvoffload.optim.WeightHome`, ``ParameterStreamer.weights``), state dicts
and checkpoints, and ``_streamer`` builds them in those steps and wires the module hooks. For the entry points:
:func:`partition` (a model's blocks and the parameters outside them), :func:`stored_layout` (where a Hugging Face
model's tensors are stored) with :data:`Index` (a part of a tensor), :class:`PeftView` (a PEFT model's base and
adapters), :func:`resident_bytes` and :func:`device_bytes_needed` (the device budget a streamed model needs),
:class:`StreamingStats` (``ParameterStreamer.stats()``: the store bytes and the waits).
"""

from nvoffload.streaming._blocks import find_blocks, partition, resident_bytes, state_tensors
from nvoffload.streaming._hf_models import Index, stored_layout
from nvoffload.streaming._peft import PeftView
from nvoffload.streaming._guard import StreamedParameterError
from nvoffload.streaming._streamer import ParameterStreamer, StreamingStats, compute_device_of, device_bytes_needed

__all__ = [
    "Index", "ParameterStreamer", "PeftView", "StreamedParameterError", "StreamingStats", "compute_device_of",
    "device_bytes_needed", "find_blocks", "partition", "resident_bytes", "state_tensors", "stored_layout",
]
