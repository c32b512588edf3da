"""The drop-in NVMe optimizer: optimizer state in a tensor store, updated while backward runs.

:class:`OffloadOptimizer` wraps a ``torch.optim.Optimizer`` built over the
model's parameters and keeps its state -- fp32 master weights and the
optimizer's moments, 12 bytes per parameter for Adam -- on NVMe, in chunks of
a :class:`~nvoffload.io.TensorStore`. :class:`NVMeAdamW` builds the same thing
directly from AdamW's arguments.

How a step runs:

* A bounded set of host buffers (``cpu_memory_bytes``, enforced and measured
  in :meth:`OffloadOptimizer.memory_stats`) streams the chunks: read the next
  chunks ahead (in the order the first iteration's gradients arrived, i.e.
  reverse layer order), update with the fused kernel
  (:func:`~nvoffload.optim.kernels.adam_step`; other torch optimizers run their
  own ``step`` on the chunk), write the updated low-precision/fp32 weights to
  the model and the new state to the store. fp32 weights are their own master
  copy: their master row is a separate store entry that an update does not
  read (8 of the 12 bytes per element are read, all 12 written).
* With ``overlap=True``, a post-accumulate-grad hook on each parameter queues
  that parameter's chunks as soon as its gradient is final, on the micro-batch
  that the previous step showed to be the last before ``step()`` (gradient
  accumulation is learned), while backward continues on earlier layers.
  ``step()`` waits for the pipeline's tail and commits. Until it commits, a
  parameter whose update ran early already holds its new value: the weights
  change during backward, before ``step()`` returns.
* Every update is written to a new generation of the chunk's state; the old
  generation is deleted only when ``step()`` commits. That makes the early
  updates speculative: when ``step()`` finds that a gradient was changed after
  its hook copied it (``tensor._version``: the user's ``clip_grad_norm_``, a
  ``GradScaler``'s scale) or a hyperparameter (``lr``, ...) changed, it
  recomputes that parameter from the old generation with the current gradient
  and hyperparameters; when a ``GradScaler`` reports an overflow it restores
  the old weights and skips the step; when an error happens (I/O or not) it
  restores every parameter it touched and raises from ``step()``.
* After a step whose gradients or hyperparameters changed between backward
  and ``step()``, the next step runs its whole update inside ``step()`` (the
  hooks only watch); overlap comes back after a step in which nothing changed.
  ``max_grad_norm`` always updates in ``step()``, except with ``release_grads``
  (parameter streaming), where the hooks update and ``step()`` redoes a step
  that needs clipping from gradients kept in the store, and the steps after it
  defer (``defer_updates``: ``step()`` queues the updates with the norm known,
  and they run during the next forward). The cost of these modes is
  the lost overlap, never other results.
* Fewer micro-batches than learned: that step updates in ``step()``, and the
  new count is learned. More: the forward passes after the learned last one
  ran on weights already updated, so ``step()`` restores the weights, skips the
  step with a RuntimeError and learns the new count (run the step again).

Semantics follow torch: ``param_groups``, ``add_param_group``, ``zero_grad``,
LR schedulers, per-parameter ``step`` counts, parameters without gradients
skipped. ``state_dict()`` streams the state from NVMe into ordinary tensors (the
keys of torch's optimizer, plus ``master_param`` for bf16/fp16 parameters) and is
interchangeable with the wrapped optimizer's own state dict;
``load_state_dict()`` streams it back. ``optimizer.state`` stays empty: the
state is in the store.

Lifetime: a parameter belongs to one open offload optimizer at a time (its
hooks update the parameter during backward): building another over it, or
``add_param_group`` with it, raises ValueError until the first is closed or
collected (an unreachable one is collected then). :meth:`OffloadOptimizer.close`
(or ``with``) lets the worker thread finish, deletes the state from the store
and ends the thread. An optimizer that is never closed does the same when it is
garbage-collected (the worker does not hold it), and at interpreter exit its
worker is stopped and joined before the interpreter finalizes (a dropped one's
worker, still finishing, too: :mod:`nvoffload.core.workers`). After
``close()``, ``step``, ``zero_grad``, ``synchronize``, the state dict methods,
``add_param_group`` and ``set_weight_home`` raise ``RuntimeError("the
OffloadOptimizer is closed")``. No wait on the worker hangs: it raises as soon
as the worker thread ends, or when the worker made no progress for
``NVOFFLOAD_WAIT_LIMIT_S`` (ten minutes by default).

The pieces: :mod:`~nvoffload.optim._layout` (records, chunks, store names,
chunk sizes), :mod:`~nvoffload.optim._chunk_io` (chunk state to and from the
store, model weights), :mod:`~nvoffload.optim._updates` (fused Adam or the
wrapped optimizer's own step), :mod:`~nvoffload.optim._pipeline` (the worker
thread), :mod:`~nvoffload.optim._protocol` (the update schedules: when an
update runs, chosen once; speculate, redo, defer, delay, restore, commit),
:mod:`~nvoffload.optim._codec` (state dicts); this module is the
``torch.optim.Optimizer`` users hold.

Example::

    model = GPT(GPTConfig.preset("small"))
    opt = NVMeAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                    swap_dir="/mnt/nvme/swap", cpu_memory_bytes=512 << 20)
    with opt:
        for x, y in batches:
            loss = model(x, y)
            loss.backward()       # updates run here, layer by layer
            opt.step()            # waits for the tail, commits
            opt.zero_grad()
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nvoffload.distributed import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, Ranks, Sharding
from nvoffload.memory import retain_freed_host_memory
from nvoffload.optim._chunk_io import ChunkIO, ResidentState, WeightHome
from nvoffload.optim._codec import StateCodec, StateSnapshot
from nvoffload.optim._hf_trainer import check_trainer_optimizer, check_trainer_recipe, log_optimizer_grad_norm
from nvoffload.optim._layout import ALIGN_NUMEL, STATE_PRECISIONS, Layout, Record
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._generations import OffloadIOError
from nvoffload.optim._protocol import step_protocol
from nvoffload.optim._schedule import StepProtocol
from nvoffload.optim._updates import for_optimizer
from nvoffload.optim.loss_scale import LossScaling
from nvoffload.transfer import TransferEngine

__all__ = ["OffloadOptimizerConfig", "OffloadOptimizer", "NVMeAdamW", "OffloadIOError", "MemoryStats", "WeightHome"]

_INSTANCES = itertools.count()
_OPEN: weakref.WeakSet[OffloadOptimizer] = weakref.WeakSet()  # not closed: each one's hooks update its parameters
OffloadIOError.__module__ = WeightHome.__module__ = __name__  # their public home (tracebacks, pickles, docs)


_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


class OffloadOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` and keeps its state on NVMe; see the module docs.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters, with
            no state yet or state to move to NVMe. ``Adam``/``AdamW`` (and
            nvoffload's ``CPUAdam``/``CPUAdamW``) run on the fused native kernel;
            other torch optimizers run their own ``step`` on CPU chunks.
        swap_dir: a directory (or a list of directories, striped) on NVMe, or an
            open :class:`~nvoffload.io.TensorStore` (not closed by :meth:`close`).
        transfer: the :class:`~nvoffload.transfer.TransferEngine` to move
            gradients and weights with, whose slab the slots are carved from
            (:func:`nvoffload.initialize` shares one between its engines); by
            default the optimizer makes its own for the parameters' device.
        process_group: the ranks to train with (default: ``torch.distributed``'s default group when it is
            initialized with more than one rank). Each rank then keeps and updates its share of the state
            (see :mod:`nvoffload.distributed`); give each rank its own ``swap_dir``. The model must not be
            wrapped in ``DistributedDataParallel``: this optimizer averages the gradients itself.
        **config: fields of :class:`OffloadOptimizerConfig` (``cpu_memory_bytes``,
            ``chunk_bytes``, ``prefetch_chunks``, ``max_grad_norm``, ``overlap``,
            ``checksum``), or ``config=OffloadOptimizerConfig(...)``.

    Raises:
        FileNotFoundError / PermissionError: the swap directory is missing or unwritable.
        ValueError: the swap directory is too small (the bytes needed are named),
            parameters on several devices, an unsupported optimizer or option,
            parameters that differ between the ranks,
            an optimizer whose state is not shaped like its parameters (found by a
            trial step on a small stand-in; the state is named),
            ``cpu_memory_bytes`` too small for one chunk, or a parameter that another
            open ``OffloadOptimizer`` holds (close that one first: both would update it).
    """

    _step_supports_amp_scaling = True  # GradScaler passes grad_scale/found_inf instead of unscaling grads
    session = None  # the nvoffload.OffloadSession, when nvoffload.initialize() built this optimizer

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        swap_dir,
        config: OffloadOptimizerConfig | None = None,
        transfer: TransferEngine | None = None,
        process_group=None,
        **kwargs,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, OffloadOptimizer):
            raise TypeError("optimizer is already an OffloadOptimizer")
        if config is None:
            config = OffloadOptimizerConfig(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either config= or its fields, not both ({sorted(kwargs)})")
        self.config = config
        self.inner = optimizer
        if config.retain_host_memory:
            retain_freed_host_memory()
        self._update = for_optimizer(optimizer, config.state_precision)
        inner_state = optimizer.state_dict() if optimizer.state else None
        self._closed = False
        self._pipeline: Pipeline | None = None  # until then, add_param_group is torch's (its __init__ calls it)
        self._records: list[Record] = []

        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # one list: schedulers see the same groups
        device = self._check_groups(self.param_groups)
        self._sharding = self._shard(process_group, device)
        if config.delayed_update and self._sharding is not None:
            raise ValueError("delayed_update trains on one process; over several ranks, leave it off")
        if config.defer_updates and self._sharding is not None:
            raise ValueError("defer_updates=True defers on one process; over several ranks, leave it None or False")
        self._layout = Layout(
            adam=self._update.adam, elementwise=self._update.elementwise, param_groups=self.param_groups,
            prefix=f"opt{next(_INSTANCES)}.", kept_grads=config.keeps_grads,
            owned=self._sharding.owned if self._sharding is not None else None, state_precision=config.state_precision,
        )  # fmt: skip
        self._layout.plan(chunk_bytes=config.chunk_bytes, cpu_memory_bytes=config.cpu_memory_bytes, num_slots=config.num_slots)
        # slots and resident state, allocated once, freed when closed or collected
        self._host_bytes = config.num_slots * self._layout.slot_bytes + config.resident_state_bytes // 4096 * 4096
        if transfer is None:
            transfer = TransferEngine(self._host_bytes, device, what="the optimizer's host memory")
            slab, close_transfer = transfer.slab, transfer.close
        else:
            slab = transfer.slab.carve(self._host_bytes, "the optimizer's slots")
            close_transfer = slab.close
        try:
            opened = None
            try:
                opened = self._open_store(swap_dir)
            finally:  # every rank raises when one could not open its swap directories
                if self._sharding is not None:
                    self._sharding.ranks.agree(sys.exc_info()[1], "opening the swap directories")
        except BaseException:
            if opened is not None and opened[1]:
                opened[0].close()
            close_transfer()
            raise
        self._store, self._owns_store = opened
        self._io = ChunkIO(self._store, self._layout, transfer)
        slots = [self._layout.new_slot(slab) for _ in range(config.num_slots)]
        self._resident = ResidentState(slab, config.resident_state_bytes, self._layout.slot_rows)
        self._pipeline = Pipeline(self._io, self._update, slots, config.prefetch_chunks)
        self._protocol = step_protocol(self._records, self._io, self._pipeline, config, self._sharding)
        self._codec = StateCodec(self._records, self._io, self._update, self._pipeline)
        # Closing, collection and interpreter exit all stop the worker and release the state; neither the
        # worker nor these callbacks hold the optimizer, so a dropped optimizer is collected.
        release = functools.partial(_release, self._records, self._io, self._owns_store, close_transfer)
        exit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
        self._finalizer = weakref.finalize(self, _stop_worker, self._pipeline, release, exit_hook)
        self._finalizer.atexit = False  # exit_hook joins the worker at exit instead
        atexit.register(exit_hook)
        _OPEN.add(self)
        try:
            for g in self.param_groups:
                for p in g["params"]:
                    self._add_record(p, g)
            if inner_state is not None:
                optimizer.state.clear()
                self.load_state_dict(inner_state)
        except BaseException:
            self._shutdown()  # refused: its hooks and state go now, not when the error's traceback is dropped
            raise

    # ------------------------------------------------------------------ setup
    def add_param_group(self, param_group: dict) -> None:
        """Add a group, as ``torch.optim.Optimizer.add_param_group``; its parameters get hooks and store chunks."""
        if getattr(self, "_pipeline", None) is None:
            super().add_param_group(param_group)
            return
        self._check_open()
        if self._sharding is not None:
            raise RuntimeError("add_param_group is not supported over several ranks: give every group at construction")
        self.inner.add_param_group(param_group)
        self.param_groups = self.inner.param_groups
        group = self.param_groups[-1]
        try:
            self._check_groups([group])
        except ValueError:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise
        for p in group["params"]:
            self._add_record(p, group)

    def _check_groups(self, groups: list[dict]) -> torch.device:
        """Refuse parameters or groups that cannot be offloaded; returns the parameters' device."""
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, found {sorted(str(d) for d in devices)}")
        for g in groups:
            for p in g["params"]:
                if p.is_sparse or p.layout != torch.strided:
                    raise ValueError(f"parameter of layout {p.layout} cannot be offloaded (dense parameters only)")
                if p.dtype not in _PARAM_DTYPES:
                    raise ValueError(
                        f"parameter of dtype {p.dtype} cannot be offloaded (float32, bfloat16 or float16: the"
                        " master weights are float32)"
                    )
            self._update.check_group(g)
        if self._held_elsewhere(groups) is not None:
            gc.collect()  # an unreachable optimizer not collected yet (a reference cycle) holds nothing
        held = self._held_elsewhere(groups)
        if held is not None:
            raise ValueError(
                f"a parameter of shape {tuple(held.shape)} ({held.dtype}) is held by another OffloadOptimizer that"
                " is still open: its hooks would update it in every backward as well. Close that one first"
                " (opt.close(), or build it in a with block)"
            )
        return next(iter(devices)) if devices else torch.device("cpu")

    def _held_elsewhere(self, groups: list[dict]) -> torch.Tensor | None:
        """A parameter of ``groups`` that another open offload optimizer holds, or None."""
        mine = {id(p) for g in groups for p in g["params"]}  # all alive while we look: ids are unique
        for other in list(_OPEN):
            if other is not self:
                for g in other.param_groups:
                    for p in g["params"]:
                        if id(p) in mine:
                            return p
        return None

    def _shard(self, process_group, device: torch.device) -> Sharding | None:
        """This rank's share of the state over ``process_group``'s ranks (None: one process)."""
        ranks = Ranks.resolve(process_group, timeout_s=self.config.collective_timeout_s)
        if ranks is None:
            return None
        if not self._update.adam:
            raise ValueError(
                f"{type(self.inner).__name__} cannot be sharded over ranks: only Adam and AdamW (and nvoffload's"
                " CPUAdam/CPUAdamW) split their state between ranks"
            )
        if device.type != ranks.device.type:
            raise ValueError(
                f"the parameters are on {device} but the process group communicates on {ranks.device.type}:"
                " use the nccl backend for CUDA parameters, gloo for CPU ones"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        summary = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params]
        ranks.same(summary, "the optimizer's parameters (shapes, dtypes, requires_grad, in group order)")
        return Sharding(ranks, params, ALIGN_NUMEL, self.config.bucket_bytes)

    def _open_store(self, swap_dir):
        """The store to use, and whether this optimizer opened it (and closes it)."""
        from nvoffload.io import TensorStore, swap_directories

        if isinstance(swap_dir, TensorStore):
            return swap_dir, False
        state = self._layout.store_state_bytes(self.config.resident_state_bytes)  # two generations until a commit
        kept = self._layout.kept_grad_bytes()
        what = f"the optimizer state (two generations of {state} bytes" + (f", and {kept} of gradients)" if kept else ")")
        dirs = swap_directories(swap_dir, needed_bytes=2 * state + kept, what=what)
        return TensorStore(dirs if len(dirs) > 1 else dirs[0], checksum=self.config.checksum), True

    def _add_record(self, p: torch.Tensor, group: dict) -> None:
        rec = self._layout.new_record(len(self._records), p, group)
        if p.requires_grad:
            for c in rec.chunks:
                self._resident.offer(c, self._layout.chunk_state_bytes(c))
        self._records.append(rec)
        self._hook_if_trained(rec)

    def _hook_if_trained(self, rec: Record) -> None:
        """Give a parameter that requires grad its post-accumulate-grad hook (a frozen one has none: no
        gradient, no state); with ``delayed_update`` also a hook on its gradient before it is accumulated."""
        if not rec.hooks and rec.param.requires_grad:
            ref = weakref.ref(self)
            rec.hooks = (rec.param.register_post_accumulate_grad_hook(_hook_for(ref, rec, StepProtocol.on_grad)),)
            if self.config.delayed_update and not self.config.release_grads:  # released: never accumulated into
                rec.hooks += (rec.param.register_hook(_hook_for(ref, rec, StepProtocol.before_accumulate)),)
            rec.learned_fires = 1 if self.config.release_grads else 0

    def follow_requires_grad(self) -> None:
        """Hook the parameters unfrozen (``requires_grad_(True)``) since they were added, so that their gradients
        are taken and their updates run like the others'; :func:`nvoffload.initialize` calls it before each
        forward. (Parameters frozen since keep their hooks, which no gradient fires.)"""
        self._check_open()
        for rec in self._records:
            self._hook_if_trained(rec)

    def check_trainer(self) -> None:
        """ValueError when a ``transformers.Trainer`` (trl's ``SFTTrainer`` too) on the call stack trains the model
        with an optimizer of its own instead of this one, which would train nothing; :func:`nvoffload.initialize`
        calls it before each forward."""
        check_trainer_optimizer(self)

    def set_weight_home(self, home: WeightHome | None) -> None:
        """Read and write the weights of the parameters ``home`` holds through it (parameter streaming); updates in
        flight land first, in the home they write."""
        self._check_open()
        self._pipeline.wait_idle()
        self._protocol.land()
        self._io.weight_home = home

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Finish the update of every parameter with a gradient, and commit it.

        Waits for the updates queued during backward, recomputes those whose
        gradient or hyperparameters changed since, runs the rest, and commits
        the new state generation. Supports ``torch.amp.GradScaler`` (its scale
        and overflow flag are applied here; an overflow skips the step).

        Raises:
            OffloadIOError: an I/O error; the parameters hold their values from
                before this step and the optimizer state is unchanged.
            ValueError: with ``release_grads``, a ``transformers.Trainer`` drives
                the step with another ``max_grad_norm`` or ``gradient_accumulation_steps``
                (it could not clip: see :mod:`nvoffload.optim._hf_trainer`); the step is undone.
            ValueError: a sparse gradient, or one on another device.
            Any other error of the update (e.g. of a wrapped optimizer's own
            ``step``) is raised with its own type, after the same restore.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trainer = None
        if self.config.release_grads:
            try:
                trainer = check_trainer_recipe(self.config.max_grad_norm, self.config.gradient_accumulation_steps)
            except ValueError:
                self._protocol.abandon()
                raise
        # found_inf and grad_scale are set by torch.amp.GradScaler
        self._protocol.finish(found_inf=getattr(self, "found_inf", None), grad_scale=getattr(self, "grad_scale", None))
        if trainer is not None:
            log_optimizer_grad_norm(trainer, self._protocol.grad_norm())
        return loss

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale, to call ``backward()`` on (``loss`` itself without
        ``loss_scaling``): the fp16 counterpart of ``GradScaler.scale`` for released gradients."""
        self._check_open()
        scale = self._protocol.loss_scale
        return loss if scale is None else loss * scale.scale

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (``GradScaler.get_scale()``), None without ``loss_scaling``."""
        scale = self._protocol.loss_scale
        return None if scale is None else scale.scale

    def grad_norm(self) -> float | None:
        """The global L2 norm of the gradients, as ``torch.nn.utils.clip_grad_norm_`` returns it.

        With ``release_grads`` no gradient is left after backward, so this is
        the norm measured as they were consumed: of the micro-batches since the
        last ``step()`` summed, unscaled by the loss scale; after ``step()``,
        the norm that step clipped against (inf or NaN: the step was skipped).
        Otherwise the norm of the ``.grad`` tensors now (over several ranks, once they are averaged: call
        it on every rank). None before any gradient.
        """
        self._check_open()
        if self._sharding is not None and not self.config.release_grads:
            self._protocol.average_grads()
        if self.config.release_grads:
            if self._protocol.step_in_progress:  # measured by the worker as it takes the gradients
                self._pipeline.wait_idle()
            return self._protocol.grad_norm()  # after step(): known, without waiting for updates deferred
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return None
        # Reduced on the device; one host read (a read per gradient would wait for the device each time).
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; waits for updates still reading gradients (not with
        ``delayed_update`` and ``set_to_none``, nor with ``release_grads``, whose gradients are None after their
        hooks: the queued updates hold the gradients they read)."""
        self._check_open()
        if not (self.config.delayed_update and set_to_none or self.config.release_grads):
            self._pipeline.wait_idle()
        super().zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Wait until the updates that backward queued have run and their state is written (``step()`` does too);
        with ``delayed_update``, also land those the last ``step()`` queued (commit them, new weights in the model)."""
        self._check_open()
        self._pipeline.wait_idle()
        self._protocol.land()

    def abandon_step(self) -> None:
        """Undo what backward did since the last ``step()``: the weights its queued updates changed are restored
        and the gradients kept between micro-batches are forgotten (a backward that raised cannot be finished)."""
        self._check_open()
        self._protocol.abandon()

    def backward_passes(self, count: int):
        """A context manager: with ``release_grads``, each ``step()`` inside it follows ``count`` backward passes
        instead of ``gradient_accumulation_steps`` (:func:`nvoffload.vertical.vertical_step`: one backward for
        all its micro-batches). Raises RuntimeError at entry when a step is in progress."""
        self._check_open()
        if not self.config.release_grads:
            raise ValueError("backward_passes() is for release_grads (parameter streaming); otherwise the count is learned")
        return self._protocol.backward_passes(count)

    @property
    def defers_updates(self) -> bool:
        """Whether this step's updates wait for ``step()`` (deferred, see ``defer_updates``), not run in backward."""
        return self._protocol.defer

    @property
    def updates_queued(self) -> bool:
        """Whether backward queued updates since the last ``step()`` (gradients merely kept between
        micro-batches do not count: they change no weight)."""
        return self._protocol.updates_queued

    @property
    def step_in_progress(self) -> bool:
        """Whether backward ran since the last ``step()``: its updates are queued or its gradients kept for the
        next micro-batch, and the state on NVMe is not yet the step's (nothing to checkpoint now)."""
        return self._protocol.step_in_progress

    @property
    def overlap_active(self) -> bool:
        """Whether the next step's updates run during backward: False with ``overlap=False`` or
        ``max_grad_norm`` (unless ``release_grads``), and for the step after one whose gradients or
        hyperparameters changed between backward and ``step()``, until a step without such a change."""
        return self._protocol.speculate

    @property
    def ranks(self) -> Ranks | None:
        """The ranks this optimizer shares its state with (None: one process)."""
        return None if self._sharding is None else self._sharding.ranks

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
            read_bytes=self._io.read_bytes,
            written_bytes=self._io.written_bytes,
            resident_bytes=self._resident.used_bytes,
            resident_state_bytes=self._resident.state_bytes,
        )

    def reset_io_stats(self) -> None:
        """Zero the read/written byte counters of :meth:`memory_stats`."""
        self._io.reset_counts()

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the OffloadOptimizer is closed")

    def _shutdown(self) -> bool:
        """Let the worker finish what is queued, delete the state from the store (closing a store this
        optimizer opened) and end; False if that already happened."""
        if self._closed:
            return False
        self._closed = True
        _OPEN.discard(self)
        self._finalizer()
        self._pipeline.join()
        return True

    def close(self) -> None:
        """Stop the worker, remove the hooks, delete the state from the store and close a store it opened
        (and the :class:`~nvoffload.OffloadSession` that :func:`nvoffload.initialize` built). With
        ``delayed_update`` the update in flight lands first (its error is raised once all that is done)."""
        try:
            if not self._closed:
                self._protocol.land()
        finally:
            if self._shutdown() and self.session is not None:
                self.session.close()

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        raise TypeError("OffloadOptimizer cannot be pickled; save its state_dict() instead")


def _hook_for(ref: weakref.ref, rec: Record, call: Callable[[StepProtocol, Record], None]):
    """A gradient hook of ``rec``'s (post-accumulate-grad, or on the gradient before accumulation) that calls
    ``call(protocol, rec)``; it holds the optimizer weakly."""

    def hook(_: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            call(opt._protocol, rec)

    return hook


def _release(records: list[Record], io: ChunkIO, owns_store: bool, close_transfer) -> None:
    """Remove the hooks and delete every generation from the store; close the store if the optimizer opened it,
    and give back its host memory. Runs on the worker thread, after its last update."""
    for rec in records:
        for handle in rec.hooks:
            handle.remove()
        rec.hooks = ()
        for c in rec.chunks:
            io.discard(c)
    if owns_store:
        io.store.close()
    close_transfer()


def _stop_worker(pipeline: Pipeline, release, exit_hook) -> None:
    """The optimizer's finalizer (also called by ``close()``): the worker releases the state and ends.
    Takes no lock and does not wait, so that it is safe wherever garbage collection runs it."""
    atexit.unregister(exit_hook)
    pipeline.stop(then=release)


def _shutdown_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, stop and join the worker of an optimizer that was not closed: a daemon thread
    still inside native I/O when the interpreter finalizes aborts the process."""
    opt = ref()
    if opt is not None:
        opt._shutdown()


class NVMeAdamW(OffloadOptimizer):
    """``torch.optim.AdamW`` with its state on NVMe: ``OffloadOptimizer(torch.optim.AdamW(...), swap_dir=...)``.

    Takes AdamW's arguments and :class:`OffloadOptimizerConfig`'s fields as keywords.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        swap_dir,
        **config,
    ):
        inner = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(inner, swap_dir=swap_dir, **config)
