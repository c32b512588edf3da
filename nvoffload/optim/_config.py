"""The offloaded optimizer's configuration (:class:`OffloadOptimizerConfig`, validated at construction) and what
it reports of its memory (:class:`MemoryStats`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nvoffload.distributed import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S
from nvoffload.optim._layout import ALIGN_NUMEL, STATE_PRECISIONS
from nvoffload.optim.loss_scale import LossScaling

__all__ = ["OffloadOptimizerConfig", "MemoryStats"]


def _is_int(value) -> bool:
    """An int that is not a bool (``True`` is no byte count)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """How :class:`OffloadOptimizer` stages its state.

    Attributes:
        cpu_memory_bytes: host memory for staging chunks (state slots with
            gradient and weight staging); one slab of exactly the slots' bytes
            (page-locked with CUDA), within this.
        chunk_bytes: fp32 bytes of master weights per chunk (a multiple of
            4096); None derives it from ``cpu_memory_bytes``.
        prefetch_chunks: chunks read ahead of the one being updated.
        max_grad_norm: clip the global gradient norm to this (as
            ``torch.nn.utils.clip_grad_norm_``, after unscaling a ``GradScaler``'s
            gradients) before the update; needs every gradient first, so the
            update runs inside ``step()`` (with ``release_grads`` it still runs
            during backward and ``step()`` redoes it when the norm is too large).
        overlap: update each parameter as soon as its gradient is final
            (speculatively, see the module docs); False runs everything in ``step()``.
        checksum: ask the store it opens to checksum every chunk (CRC-32C, on by default; a
            ``TensorStore`` passed as ``swap_dir`` keeps its own setting).
        retain_host_memory: call :func:`nvoffload.memory.retain_freed_host_memory`
            (process-wide: freed host memory is reused, not handed back to the
            operating system, which keeps the I/O fast between steps).
        release_grads: free each gradient as soon as its hook has consumed it
            (``param.grad`` is None after backward), so that gradients never
            accumulate in device memory; used by parameter streaming. Needs
            ``overlap``. Micro-batches are summed in an fp32 copy in the store;
            ``max_grad_norm`` and ``loss_scaling`` work from the norms measured
            as the gradients pass (see :mod:`nvoffload.optim._released`).
        gradient_accumulation_steps: with ``release_grads``, backward passes per
            ``step()`` (without it the optimizer learns the count).
        loss_scaling: with ``release_grads``, fp16 dynamic loss scaling on
            ``GradScaler``'s schedule (scale the loss with
            :meth:`OffloadOptimizer.scale_loss`); without it, use ``torch.amp.GradScaler``.
        bucket_bytes: over several ranks, the largest bucket gradients and weights travel in (bytes; two
            buckets of held gradients are in flight at once, on the communication device).
        collective_timeout_s: over several ranks, the longest wait for one collective before it raises
            (another rank died or hangs), seconds.
        resident_state_bytes: host memory, besides ``cpu_memory_bytes`` and in the same slab, for state kept
            resident: never read from or written to the store, updated from host memory (its fp32 master and
            moments). Chunks take it in the order of the parameters (the groups' order: a model's first
            layers, whose updates come last in backward), while the two generations of a chunk's state fit
            (``2 * rows * 4`` bytes an element: 24 for AdamW); parameters that do not require grad when added
            take none. The results, ``state_dict()`` and checkpoints are the same as with everything in the
            store. 0: all of the state is in the store.
        state_precision: how Adam/AdamW keep their state (opt-in trades; the default is exact):
            ``"fp32"``: exact AdamW, 12 bytes a parameter (fp32 master, ``exp_avg``, ``exp_avg_sq``);
            ``"bf16-moments"``: the same fp32 arithmetic with both moments stored as bf16 (8 bytes);
            ``"bf16"``: also no fp32 master for bf16 parameters, whose own weights are updated in place with
            stochastic rounding (4 bytes of state, plus a 2-byte copy of the weights each generation; fp32
            parameters keep their weights as the master, fp16 ones are refused);
            ``"8bit"``: as ``"bf16"``, with each moment in one byte (float8 e4m3 over a power-of-two scale per 256
            elements, the second moment as its square root, rounded stochastically: 2 bytes of state, see
            :mod:`nvoffload.optim.kernels`). A state dict holds the moments as fp32 values whatever the
            precision; it or a checkpoint records the precision and loads only into an optimizer of the same
            one; amsgrad needs ``"fp32"``.
        delayed_update: run each step's updates during the next forward and backward instead of inside
            ``step()`` (PipeDream-2BW's and ZeRO-Offload's delayed update; opt-in, not exact AdamW): ``step()``
            lands the updates the previous ``step()`` queued, then queues this step's and returns, so the
            optimizer and its NVMe traffic are off the step's critical path. The weights a step trains on are
            torch's AdamW applied one step late (the gradients up to the step before last). Clipping and loss
            scaling keep their meaning: the norm and the overflow are those of this step's gradients, known in
            ``step()`` before any of its updates runs. Costs one more copy of the trained weights (the staged
            new weights): in device memory for parameters on the device; with ``release_grads`` (parameter
            streaming), a twin of each streamed block in the host cache and, evicted, in the store, and each
            gradient kept in the store (4 bytes a parameter written and read a step). ``synchronize()``,
            ``state_dict()``, a training checkpoint and ``close()`` land the update in flight; call
            ``synchronize()`` before reading the trained weights or loading weights into the model. On one
            process.
        defer_updates: with ``release_grads``, when a step's updates run (exact either way; see
            :mod:`nvoffload.optim._released`). ``False``: during backward, as each gradient is final
            (speculation: with ``max_grad_norm``, a step whose norm clips runs every update again in ``step()``
            from the kept gradients). ``True``: ``step()`` queues them, the norm known, and the next forward
            waits for each streamed block's (the optimizer's work and NVMe traffic overlap that forward; the
            gradient is kept in the store every step: 4 bytes a parameter written and read). ``None``
            (default): speculate, and defer the step after one whose clipping bit, until a step does not clip.
            On one process (over several ranks it speculates).
        delayed_update_after: with ``delayed_update``, the optimizer steps that update exactly, in ``step()``,
            before the updates are delayed (counted by the parameters' ``step``, which state dicts and
            checkpoints keep): the first steps, where the loss falls fastest, are where a stale update costs most
            (ZeRO-Offload also starts its delayed update after some steps).
    """

    cpu_memory_bytes: int = 256 << 20
    chunk_bytes: int | None = None
    prefetch_chunks: int = 2
    max_grad_norm: float | None = None
    overlap: bool = True
    checksum: bool = True
    retain_host_memory: bool = True
    release_grads: bool = False
    gradient_accumulation_steps: int = 1
    loss_scaling: LossScaling | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    collective_timeout_s: float = DEFAULT_TIMEOUT_S
    resident_state_bytes: int = 0
    state_precision: str = "fp32"
    delayed_update: bool = False
    delayed_update_after: int = 0
    defer_updates: bool | None = None

    def __post_init__(self):
        if not _is_int(self.cpu_memory_bytes) or self.cpu_memory_bytes <= 0:
            raise ValueError(f"cpu_memory_bytes must be a positive int, got {self.cpu_memory_bytes!r}")
        if self.chunk_bytes is not None and (
            not _is_int(self.chunk_bytes) or self.chunk_bytes <= 0 or self.chunk_bytes % (4 * ALIGN_NUMEL)
        ):
            raise ValueError(f"chunk_bytes must be a positive multiple of {4 * ALIGN_NUMEL}, got {self.chunk_bytes!r}")
        if not _is_int(self.resident_state_bytes) or self.resident_state_bytes < 0:
            raise ValueError(f"resident_state_bytes must be an int >= 0, got {self.resident_state_bytes!r}")
        if self.state_precision not in STATE_PRECISIONS:
            raise ValueError(f"state_precision must be one of {', '.join(STATE_PRECISIONS)}; got {self.state_precision!r}")
        if not _is_int(self.prefetch_chunks) or self.prefetch_chunks < 0:
            raise ValueError(f"prefetch_chunks must be an int >= 0, got {self.prefetch_chunks!r}")
        if self.max_grad_norm is not None and not (
            isinstance(self.max_grad_norm, (int, float)) and not isinstance(self.max_grad_norm, bool)
            and self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)
        ):  # fmt: skip
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {self.max_grad_norm!r}")
        if not isinstance(self.delayed_update, bool):
            raise ValueError(f"delayed_update must be a bool, got {self.delayed_update!r}")
        if not _is_int(self.delayed_update_after) or self.delayed_update_after < 0:
            raise ValueError(f"delayed_update_after must be an int >= 0, got {self.delayed_update_after!r}")
        if self.delayed_update_after and not self.delayed_update:
            raise ValueError("delayed_update_after counts the exact steps before delayed updates: set delayed_update too")
        if self.defer_updates is not None and not isinstance(self.defer_updates, bool):
            raise ValueError(f"defer_updates must be True, False or None, got {self.defer_updates!r}")
        if self.defer_updates and not self.release_grads:
            raise ValueError("defer_updates is for release_grads: otherwise the gradients wait in .grad for step()")
        if self.release_grads and not self.overlap:
            raise ValueError("release_grads needs overlap=True: the gradients are consumed in the hooks")
        steps = self.gradient_accumulation_steps
        if not _is_int(steps) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")
        if not self.release_grads and (steps != 1 or self.loss_scaling is not None):
            raise ValueError(
                "gradient_accumulation_steps and loss_scaling are for release_grads; otherwise the optimizer"
                " learns the micro-batches per step and takes torch.amp.GradScaler"
            )
        if not _is_int(self.bucket_bytes) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        timeout = self.collective_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or not math.isfinite(timeout):
            raise ValueError(f"collective_timeout_s must be a positive finite number, got {timeout!r}")
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, LossScaling):
            raise TypeError(f"loss_scaling must be an nvoffload.optim.LossScaling, got {type(self.loss_scaling).__name__}")

    @property
    def keeps_grads(self) -> bool:
        """Whether gradients are kept in the store: summed over micro-batches, for a clipped redo, or for
        updates deferred to ``step()`` or delayed."""
        return self.release_grads and (
            self.gradient_accumulation_steps > 1 or self.max_grad_norm is not None or bool(self.defer_updates)
            or self.delayed_update
        )

    @property
    def num_slots(self) -> int:
        """State buffers in flight: the chunks read ahead, one being updated, one being written."""
        return self.prefetch_chunks + 2


@dataclass(frozen=True)
class MemoryStats:
    """What the optimizer holds, per tier (bytes)."""

    host_bytes: int  # staging buffers and resident state allocated now
    host_peak_bytes: int  # most of that memory held at once
    host_limit_bytes: int  # cpu_memory_bytes + resident_state_bytes
    nvme_bytes: int  # store bytes in use
    read_bytes: int  # read from the store since the last reset_io_stats()
    written_bytes: int
    resident_bytes: int = 0  # host memory holding resident state (two generations of it)
    resident_state_bytes: int = 0  # one generation of the resident state: store bytes per update it saves, each way
