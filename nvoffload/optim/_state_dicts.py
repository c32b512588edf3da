"""The offloaded optimizer's state as torch's state dicts, streamed chunk by chunk for checkpoints larger than
memory, and what it takes (:meth:`StateDicts.memory_stats`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nvoffload.optim._codec import StateSnapshot
from nvoffload.optim._config import MemoryStats


class StateDicts:
    """The state methods of :class:`~nvoffload.optim.OffloadOptimizer` (a base class of it): they read and write
    the state through its codec (``_codec``), after landing what is in flight (``synchronize()``); over several
    ranks each rank holds its own elements (``_sharding``); the loss scale is the step protocol's."""

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """The state as ordinary tensors, read chunk by chunk from the store.

        Same layout as the wrapped optimizer's ``state_dict()`` (for Adam/AdamW:
        ``step``, ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``,
        fp32), plus ``master_param`` (fp32) for bf16/fp16 parameters, and with
        ``loss_scaling`` the scale and growth tracker (``loss_scale``).
        """
        self.synchronize()
        state = self._codec.state_dict(self.param_groups)
        if self._sharding is not None:  # each rank filled its own elements (zeros elsewhere): sum them
            for idx in sorted(state["state"]):
                for key in sorted(state["state"][idx]):
                    value = state["state"][idx][key]
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        self._sharding.ranks.all_reduce(value, "gathering the state dict")
        if self._protocol.loss_scale is not None:
            state["loss_scale"] = self._protocol.loss_scale.state_dict()
        return state

    def state_layout(self) -> dict:
        """:meth:`state_dict` without reading the store: every per-element tensor is a meta tensor (its dtype
        and shape). :meth:`stream_state` then gives their values, one chunk at a time."""
        self.synchronize()
        state = self._codec.layout(self.param_groups)
        if self._protocol.loss_scale is not None:
            state["loss_scale"] = self._protocol.loss_scale.state_dict()
        return state

    def stream_state(self, layout: dict, sink: Callable[[torch.Tensor, slice, torch.Tensor], None]) -> None:
        """Read the state chunk by chunk: ``sink(placeholder, elements, values)`` is called for each meta
        tensor of ``layout`` (from :meth:`state_layout`, with no step since), for its flat ``elements`` in
        increasing order; ``values`` (fp32, host memory) is valid during the call only. For checkpoints larger
        than memory (:func:`nvoffload.save_training_checkpoint`)."""
        self._check_open()
        self._codec.stream(layout, sink)

    def snapshot_state(self, layout: dict) -> StateSnapshot:
        """Hold the state of ``layout``'s tensors (from :meth:`state_layout`, no step since) for streaming while
        the next steps run (:meth:`StateSnapshot.stream`, from any thread): a background checkpoint
        (:func:`nvoffload.start_training_checkpoint`). Release it once streamed (one more generation of the
        state stays on NVMe until then); close the optimizer only after."""
        self._check_open()
        return self._codec.snapshot(layout)

    def load_state_dict(
        self, state_dict: dict, *, source: Callable[[torch.Tensor, slice, torch.Tensor], None] | None = None
    ) -> None:
        """Load a state dict of this optimizer or of the wrapped optimizer's type, streaming it to the store.

        Hyperparameters of the groups are taken from ``state_dict`` (as torch
        does). Parameters without a ``master_param`` entry use the model's
        current weights as master weights; without a ``loss_scale`` entry the
        loss scale stays as it is. ``source(tensor, elements, out)``, when
        given, fills the fp32 ``out`` with the flat ``elements`` of a state
        tensor, one chunk at a time: ``state_dict`` may then hold meta tensors
        (as :meth:`state_layout` gives) that ``source`` reads from elsewhere.
        """
        self.synchronize()
        self._codec.load_state_dict(state_dict, self.param_groups, source)
        if self._protocol.loss_scale is not None and "loss_scale" in state_dict:
            self._protocol.loss_scale.load_state_dict(state_dict["loss_scale"])
        self._protocol.after_load()
        self._pipeline.set_plan(self._protocol.plan())

    # ------------------------------------------------------------------ memory
    def memory_stats(self) -> MemoryStats:
        """Host staging memory (now, peak, limit), bytes on NVMe and I/O bytes since :meth:`reset_io_stats`."""
        return MemoryStats(
            host_bytes=self._host_bytes,
            host_peak_bytes=self._host_bytes,
            host_limit_bytes=self.config.cpu_memory_bytes + self.config.resident_state_bytes,
            nvme_bytes=int(getattr(self._store, "used_bytes", 0)),
            read_bytes=self._io.chunks.read_bytes,
            written_bytes=self._io.chunks.written_bytes,
            resident_bytes=self._resident.used_bytes,
            resident_state_bytes=self._resident.state_bytes,
        )

    def reset_io_stats(self) -> None:
        """Zero the read/written byte counters of :meth:`memory_stats`."""
        self._io.chunks.reset_counts()
