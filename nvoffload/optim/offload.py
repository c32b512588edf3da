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
  ``max_grad_norm`` always updates in ``step()``. The cost of these modes is
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

import contextlib
import itertools
import math
import os
import queue
import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from nvoffload import device
from nvoffload.memory import retain_freed_host_memory
from nvoffload.optim.kernels import adam_step

__all__ = ["OffloadOptimizerConfig", "OffloadOptimizer", "NVMeAdamW", "OffloadIOError", "MemoryStats", "WeightHome"]

_MIB = 1 << 20
_ALIGN_NUMEL = 1024  # chunk boundaries on 4 KiB of fp32, for O_DIRECT
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# torch optimizers whose update is elementwise: their state can be split into chunks.
_ELEMENTWISE = ("SGD", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_MAX_GENERIC_ROWS = 5  # master + up to four param-shaped state tensors
_INSTANCES = itertools.count()
_RELEASED = object()  # in _Record.spec: the hook queued the update and freed the gradient


class WeightHome(Protocol):
    """Where some parameters' weights live while they are off the device (see :mod:`nvoffload.streaming`).

    The optimizer reads and writes those weights through ``acquire`` (a flat,
    writable host tensor of the parameter's dtype, valid until ``release``);
    ``release(modified=True)`` tells the home that the weights changed. Called
    from the optimizer's worker thread as well as the training thread.
    """

    def holds(self, param: torch.Tensor) -> bool: ...

    def acquire(self, param: torch.Tensor) -> torch.Tensor: ...

    def release(self, param: torch.Tensor, *, modified: bool) -> None: ...


class OffloadIOError(RuntimeError):
    """An I/O error during :meth:`OffloadOptimizer.step`; the parameters were restored to their values before the step."""


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """How :class:`OffloadOptimizer` stages its state.

    Attributes:
        cpu_memory_bytes: host memory for staging chunks (state slots and, with
            CUDA parameters, gradient and weight staging); enforced.
        chunk_bytes: fp32 bytes of master weights per chunk (a multiple of
            4096); None derives it from ``cpu_memory_bytes``.
        prefetch_chunks: chunks read ahead of the one being updated.
        max_grad_norm: clip the global gradient norm to this (as
            ``torch.nn.utils.clip_grad_norm_``) before the update; needs every
            gradient first, so the update runs inside ``step()``.
        overlap: update each parameter as soon as its gradient is final
            (speculatively, see the module docs); False runs everything in ``step()``.
        checksum: ask the store to checksum every chunk.
        retain_host_memory: call :func:`nvoffload.memory.retain_freed_host_memory`
            (process-wide: freed host memory is reused, not handed back to the
            operating system, which keeps the I/O fast between steps).
        release_grads: free each gradient as soon as its hook has queued the
            update (``param.grad`` is None after backward), so that gradients
            never accumulate in device memory; used by parameter streaming.
            Needs ``overlap``, one backward per ``step()`` and no
            ``max_grad_norm`` or fp16 loss scaling (they need every gradient).
    """

    cpu_memory_bytes: int = 256 * _MIB
    chunk_bytes: int | None = None
    prefetch_chunks: int = 2
    max_grad_norm: float | None = None
    overlap: bool = True
    checksum: bool = False
    retain_host_memory: bool = True
    release_grads: bool = False

    def __post_init__(self):
        if not isinstance(self.cpu_memory_bytes, int) or self.cpu_memory_bytes <= 0:
            raise ValueError(f"cpu_memory_bytes must be a positive int, got {self.cpu_memory_bytes!r}")
        if self.chunk_bytes is not None and (self.chunk_bytes <= 0 or self.chunk_bytes % (4 * _ALIGN_NUMEL)):
            raise ValueError(f"chunk_bytes must be a positive multiple of {4 * _ALIGN_NUMEL}, got {self.chunk_bytes}")
        if not isinstance(self.prefetch_chunks, int) or self.prefetch_chunks < 0:
            raise ValueError(f"prefetch_chunks must be an int >= 0, got {self.prefetch_chunks!r}")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {self.max_grad_norm}")
        if self.release_grads and (not self.overlap or self.max_grad_norm is not None):
            raise ValueError("release_grads needs overlap=True and max_grad_norm=None: the update must run in the hooks")

    @property
    def num_slots(self) -> int:
        """State buffers in flight: the chunks read ahead, one being updated, one being written."""
        return self.prefetch_chunks + 2


@dataclass(frozen=True)
class MemoryStats:
    """What the optimizer holds, per tier (bytes)."""

    host_bytes: int  # staging buffers allocated now
    host_peak_bytes: int  # most staging memory held at once
    host_limit_bytes: int  # cpu_memory_bytes
    nvme_bytes: int  # store bytes in use
    read_bytes: int  # read from the store since the last reset_io_stats()
    written_bytes: int


class _Chunk:
    """One contiguous range of one parameter's elements and its state generations in the store."""

    __slots__ = ("record", "index", "start", "numel", "gen", "pending_gen", "applied", "scalars", "pending_scalars")

    def __init__(self, record: _Record, index: int, start: int, numel: int):
        self.record = record
        self.index = index
        self.start = start
        self.numel = numel
        self.gen: int | None = None  # committed generation in the store, None = no state yet
        self.pending_gen: int | None = None  # generation written this step, not yet committed
        self.applied = False  # the model parameter holds this step's (uncommitted) update
        self.scalars: dict = {}  # non-tensor state of a generic optimizer, committed
        self.pending_scalars: dict = {}

    def name(self, gen: int) -> str:
        return f"{self.record.prefix}p{self.record.index}.c{self.index}.g{gen}"


class _Record:
    """Everything the optimizer keeps about one parameter (one record per parameter, no id() keys)."""

    __slots__ = ("prefix", "index", "param", "group", "chunks", "step", "fires", "learned_fires", "spec", "hook")

    def __init__(self, prefix: str, index: int, param: torch.Tensor, group: dict):
        self.prefix = prefix
        self.index = index
        self.param = param
        self.group = group
        self.chunks: list[_Chunk] = []
        self.step = 0  # committed update count, torch's state["step"]
        self.fires = 0  # post-accumulate-grad hook calls since the last step()
        self.learned_fires = 0  # hook calls before the previous step() (0 = not learned; 1 with release_grads)
        # (grad weakref, grad version, hyperparameters, applied) seen by the hook on the learned fire;
        # applied: the update was queued then (else only observed, to re-learn overlap)
        self.spec: tuple | None = None
        self.hook = None

    @property
    def name(self) -> str:
        return f"parameter {self.index} (shape {tuple(self.param.shape)}, {self.param.dtype})"


class _Request:
    __slots__ = ("chunk", "grad", "hparams", "step", "grad_scale")

    def __init__(self, chunk: _Chunk, grad: torch.Tensor, hparams: dict, step: int, grad_scale: float):
        self.chunk, self.grad, self.hparams, self.step, self.grad_scale = chunk, grad, hparams, step, grad_scale


class _AllOf:
    """Store futures waited for together; ``result()`` raises the first error once all are done."""

    __slots__ = ("_futures",)

    def __init__(self, futures: list):
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> None:
        error = None
        for f in self._futures:
            try:
                f.result(timeout)
            except BaseException as exc:  # noqa: BLE001 - every part must finish before the slot is reused
                error = error or exc
        if error is not None:
            raise error


class _Slot:
    """A host buffer holding one chunk's state rows (and, for CUDA parameters, staging)."""

    __slots__ = ("buffer", "grad", "out")

    def __init__(self, buffer: torch.Tensor, grad: torch.Tensor | None, out: torch.Tensor | None):
        self.buffer, self.grad, self.out = buffer, grad, out

    def rows(self, nrows: int, numel: int) -> torch.Tensor:
        return self.buffer[: nrows * numel].view(nrows, numel)


def _host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat host buffer aligned for O_DIRECT, page-locked when CUDA is present."""
    from nvoffload.io import aligned_empty

    if device.cuda_available():
        return device.host_empty(numel, dtype)  # the pinned pool every engine shares (page-aligned blocks)
    return aligned_empty(numel * torch.empty(0, dtype=dtype).element_size()).view(dtype)


class _Pipeline:
    """One worker thread: reads chunks ahead, runs the update, writes back; errors are collected, not lost."""

    def __init__(self, opt: OffloadOptimizer, num_slots: int, make_slot):
        self._opt = opt
        self._queue: queue.Queue = queue.Queue()
        self._free: list[_Slot] = [make_slot() for _ in range(num_slots)]
        self._prefetched: dict[_Chunk, tuple[_Slot, object]] = {}
        self._writes: deque = deque()  # (slot, future)
        self._plan: list[_Chunk] = []
        self._plan_pos = 0
        self._prefetch = opt.config.prefetch_chunks
        self._lock = threading.Condition()
        self._pending = 0
        self.errors: list[BaseException] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nvoffload-optimizer", daemon=True)
        self._thread.start()

    # ---- called from the training thread (and autograd hooks)
    def submit(self, req: _Request) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put(req)

    def set_plan(self, plan: list[_Chunk]) -> None:
        self._queue.put(("plan", plan))

    def wait_idle(self) -> None:
        """Wait until every queued update ran and its writes are on disk."""
        with self._lock:
            self._pending += 1
        self._queue.put(("drain", None))
        with self._lock:
            self._lock.wait_for(lambda: self._pending == 0)

    @contextlib.contextmanager
    def lend(self):
        """A slot for the training thread's own transfers (restoring weights, state dicts), so that host
        memory stays within the budget; the worker waits, idle, until it is given back."""
        handover: queue.Queue = queue.Queue()
        given_back = threading.Event()
        self._queue.put(("lend", (handover, given_back)))
        slot = handover.get()
        try:
            yield slot
        finally:
            given_back.set()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    # ---- worker thread
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.005 if self._can_prefetch() else None)
            except queue.Empty:
                self._prefetch_one()
                continue
            if item is None:
                self._drop_prefetched()
                self._finish_writes(0)
                return
            if isinstance(item, tuple) and item[0] == "plan":
                self._drop_prefetched()
                self._plan, self._plan_pos = item[1], 0
                continue
            if isinstance(item, tuple) and item[0] == "lend":
                handover, given_back = item[1]
                slot = self._take_slot()
                handover.put(slot)
                given_back.wait()
                self._release(slot)
                continue
            # Writes stay in flight while updates come in (reads ahead overlap them); a drain
            # (wait_idle) waits for them all.
            try:
                if isinstance(item, tuple):
                    self._finish_writes(0)
                elif not self.errors:
                    self._process(item)
            except BaseException as exc:  # noqa: BLE001 - reported from step()
                self.errors.append(exc)
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _can_prefetch(self) -> bool:
        return (
            not self.errors
            and len(self._prefetched) < self._prefetch
            and self._plan_pos < len(self._plan)
            and (self._free or self._writes)
        )

    def _prefetch_one(self) -> None:
        while self._plan_pos < len(self._plan):
            chunk = self._plan[self._plan_pos]
            self._plan_pos += 1
            if chunk.gen is None or chunk.pending_gen is not None or chunk in self._prefetched:
                continue
            try:
                slot = self._take_slot()
                master = self._opt._needs_master(chunk)
                self._prefetched[chunk] = (slot, self._opt._read_chunk(chunk, chunk.gen, slot, master=master), master)
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)
            return

    def _drop_prefetched(self) -> None:
        for slot, fut, _ in self._prefetched.values():
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - a dropped read-ahead does not matter
                pass
            self._release(slot)
        self._prefetched.clear()

    def _take_slot(self) -> _Slot:
        if not self._free:
            if self._writes:
                self._finish_writes(len(self._writes) - 1)
            elif self._prefetched:  # read-ahead of chunks that did not come: give one back
                chunk = next(reversed(self._prefetched))
                slot, fut, _ = self._prefetched.pop(chunk)
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001
                    pass
                self._release(slot)
        return self._free.pop()

    def _release(self, slot: _Slot) -> None:
        self._free.append(slot)

    def _finish_writes(self, keep: int) -> None:
        """Wait for the oldest writes until at most ``keep`` are in flight; their errors go to ``errors``."""
        while len(self._writes) > keep:
            slot, fut = self._writes.popleft()
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - reported from step()
                self.errors.append(exc)
            self._release(slot)

    def _process(self, req: _Request) -> None:
        chunk = req.chunk
        opt = self._opt
        fresh = not chunk.applied  # else the model holds an update of this step: the master comes from the store
        if chunk in self._prefetched:
            slot, fut, master = self._prefetched.pop(chunk)
        else:
            slot = self._take_slot()
            fut, master = None, True
            try:
                if chunk.gen is None:
                    opt._init_chunk(chunk, slot)
                else:
                    fut = opt._read_chunk(chunk, chunk.gen, slot, master=opt._needs_master(chunk))
            except BaseException:
                self._release(slot)
                raise
        try:
            if fut is not None:
                fut.result()
            if not master and not fresh:  # read ahead without the master, then the update had to be redone
                opt._read_chunk(chunk, chunk.gen, slot, state=False).result()
            gen = (chunk.gen or 0) + 1
            chunk.applied = True  # from here on the model may hold new values
            opt._update_chunk(req, slot, fresh)
            wfut = opt._write_chunk(chunk, gen, slot)
        except BaseException:
            self._release(slot)
            raise
        chunk.pending_gen = gen
        self._writes.append((slot, wfut))
        # Keep reading ahead while the update computes next.
        if self._can_prefetch():
            self._prefetch_one()


class OffloadOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` and keeps its state on NVMe; see the module docs.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters, with
            no state yet or state to move to NVMe. ``Adam``/``AdamW`` (and
            nvoffload's ``CPUAdam``/``CPUAdamW``) run on the fused native kernel;
            other torch optimizers run their own ``step`` on CPU chunks.
        swap_dir: a directory (or a list of directories, striped) on NVMe, or an
            open :class:`~nvoffload.io.TensorStore` (not closed by :meth:`close`).
        **config: fields of :class:`OffloadOptimizerConfig` (``cpu_memory_bytes``,
            ``chunk_bytes``, ``prefetch_chunks``, ``max_grad_norm``, ``overlap``,
            ``checksum``), or ``config=OffloadOptimizerConfig(...)``.

    Raises:
        FileNotFoundError / PermissionError: the swap directory is missing or unwritable.
        ValueError: the swap directory is too small (the bytes needed are named),
            parameters on several devices, an unsupported optimizer or option,
            an optimizer whose state is not shaped like its parameters (found by a
            trial step on a small stand-in; the state is named), or
            ``cpu_memory_bytes`` too small for one chunk.
    """

    _step_supports_amp_scaling = True  # GradScaler passes grad_scale/found_inf instead of unscaling grads
    session = None  # the nvoffload.OffloadSession, when nvoffload.initialize() built this optimizer

    def __init__(self, optimizer: torch.optim.Optimizer, *, swap_dir, config: OffloadOptimizerConfig | None = None, **kwargs):
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
        cls_names = {c.__name__ for c in type(optimizer).__mro__}
        self._is_adam = bool(cls_names & {"Adam", "AdamW"}) and not (cls_names & {"NAdam", "RAdam", "Adamax", "SparseAdam"})
        if cls_names & {"LBFGS", "SparseAdam"}:
            raise ValueError(
                f"{type(optimizer).__name__} cannot be offloaded: its state is not per-parameter elementwise"
                " (LBFGS keeps a global history; SparseAdam needs sparse gradients)"
            )
        self._elementwise = self._is_adam or bool(cls_names & set(_ELEMENTWISE))
        inner_state = optimizer.state_dict() if optimizer.state else None

        self._store = None
        self._owns_store = False
        self._records: list[_Record] = []
        self._order: list[_Record] = []  # first iteration's gradient order
        self._order_learned = False
        self._can_speculate = config.overlap and config.max_grad_norm is None
        self._speculate = self._can_speculate
        self._closed = False
        self._host_bytes = 0
        self._host_peak = 0
        self._io_read = 0
        self._io_written = 0
        self._io_lock = threading.Lock()
        self._prefix = f"opt{next(_INSTANCES)}."
        self._weight_home: WeightHome | None = None

        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # one list: schedulers see the same groups
        self._device = self._check_devices()
        for group in self.param_groups:
            self._check_state_offloadable(group)
        self._chunk_numel = self._plan_chunks()
        self._open_store(swap_dir)
        self._pipeline = _Pipeline(self, config.num_slots, self._make_slot)
        if inner_state is not None:
            optimizer.state.clear()
            self.load_state_dict(inner_state)

    # ------------------------------------------------------------------ setup
    def add_param_group(self, param_group: dict) -> None:
        """Add a group, as ``torch.optim.Optimizer.add_param_group``; its parameters get hooks and store chunks."""
        inner = getattr(self, "inner", None)
        if inner is not None and getattr(self, "_pipeline", None) is not None:
            inner.add_param_group(param_group)
            self.param_groups = inner.param_groups
            group = inner.param_groups[-1]
            self._check_devices()
            self._check_state_offloadable(group)
            for p in group["params"]:
                self._add_record(p, group)
            return
        super().add_param_group(param_group)

    def _check_devices(self) -> torch.device:
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, found {sorted(str(d) for d in devices)}")
        for g in self.param_groups:
            if self._is_adam and g.get("differentiable", False):
                raise ValueError("differentiable=True cannot be offloaded")
            for p in g["params"]:
                if p.is_sparse or p.layout != torch.strided:
                    raise ValueError(f"parameter of layout {p.layout} cannot be offloaded (dense parameters only)")
                if not p.is_floating_point():
                    raise ValueError(f"parameter of dtype {p.dtype} cannot be offloaded (floating point only)")
        return next(iter(devices)) if devices else torch.device("cpu")

    def _rows(self, record: _Record | None = None) -> int:
        if not self._is_adam:
            return _MAX_GENERIC_ROWS
        amsgrad = any(g.get("amsgrad", False) for g in self.param_groups) if record is None else record.group.get("amsgrad", False)
        return 4 if amsgrad else 3

    def _plan_chunks(self) -> int:
        """Elements per chunk, from ``chunk_bytes`` or the memory budget; raises when the budget is too small."""
        cfg = self.config
        params = [p for g in self.param_groups for p in g["params"]]
        largest = max((p.numel() for p in params), default=1)
        per_elem = self._rows() * 4
        if self._device.type == "cuda":
            per_elem += 4 + 2  # grad and low-precision weight staging
        slots = cfg.num_slots
        if not self._elementwise:
            numel = -(-largest // _ALIGN_NUMEL) * _ALIGN_NUMEL  # whole parameters: the update is not elementwise
        elif cfg.chunk_bytes is not None:
            numel = cfg.chunk_bytes // 4
        else:
            numel = min(cfg.cpu_memory_bytes // (slots * per_elem), 16 * _MIB // 4)
            numel = min(numel, -(-largest // _ALIGN_NUMEL) * _ALIGN_NUMEL)
            numel -= numel % _ALIGN_NUMEL
        needed = slots * max(numel, _ALIGN_NUMEL) * per_elem
        if numel < _ALIGN_NUMEL or needed > cfg.cpu_memory_bytes:
            what = "the largest parameter" if not self._elementwise else "the chunks"
            raise ValueError(
                f"cpu_memory_bytes={cfg.cpu_memory_bytes} is too small: {slots} buffers for {what} need"
                f" {needed} bytes ({max(numel, _ALIGN_NUMEL)} elements x {per_elem} bytes each)"
            )
        return numel

    def _make_slot(self) -> _Slot:
        n = self._chunk_numel
        buf = _host_buffer(self._rows() * n, torch.float32)
        grad = out = None
        if self._device.type == "cuda":
            grad = _host_buffer(n, torch.float32)
            out = _host_buffer(n, torch.bfloat16)
        self._host_bytes += self._slot_bytes()
        self._host_peak = max(self._host_peak, self._host_bytes)
        return _Slot(buf, grad, out)

    def _slot_bytes(self) -> int:
        return self._chunk_numel * (self._rows() * 4 + (6 if self._device.type == "cuda" else 0))

    def _state_bytes(self) -> int:
        per_elem = self._rows() * 4
        return sum(-(-p.numel() // _ALIGN_NUMEL) * _ALIGN_NUMEL * per_elem for g in self.param_groups for p in g["params"])

    def _open_store(self, swap_dir) -> None:
        from nvoffload.io import TensorStore, swap_directories

        if isinstance(swap_dir, TensorStore):
            self._store = swap_dir
        else:
            state = self._state_bytes()  # two generations of each chunk coexist until step() commits
            what = f"the optimizer state (two generations of {state} bytes)"
            dirs = swap_directories(swap_dir, needed_bytes=2 * state, what=what)
            self._store = TensorStore(dirs if len(dirs) > 1 else dirs[0], checksum=self.config.checksum)
            self._owns_store = True
        for g in self.param_groups:
            for p in g["params"]:
                self._add_record(p, g)

    def _add_record(self, p: torch.Tensor, group: dict) -> None:
        rec = _Record(self._prefix, len(self._records), p, group)
        n = p.numel()
        step = self._chunk_numel
        rec.chunks = [_Chunk(rec, i, s, min(step, n - s)) for i, s in enumerate(range(0, n, step))]
        if p.requires_grad:
            rec.hook = p.register_post_accumulate_grad_hook(self._hook_for(rec))
            rec.learned_fires = 1 if self.config.release_grads else 0
        self._records.append(rec)

    def _hook_for(self, rec: _Record):
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._on_grad(rec)

        return hook

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, rec: _Record) -> None:
        rec.fires += 1
        if not self._order_learned and rec.fires == 1:
            self._order.append(rec)
        if rec.spec is not None and rec.spec[0] is _RELEASED and rec.fires > 1:
            self._pipeline.wait_idle()
            self._restore(rec.chunks)
            rec.spec = None
            raise RuntimeError(
                f"backward ran again for {rec.name} after its update had been applied early: release_grads"
                " (parameter streaming) needs exactly one backward pass per step()"
            )
        if not (rec.learned_fires and rec.fires == rec.learned_fires):
            return  # more backward passes than learned: step() finds them (fires > learned_fires)
        grad = self._checked_grad(rec)
        if grad is None:
            return
        hp = self._hparams(rec.group)
        if self.config.release_grads:
            rec.spec = (_RELEASED, None, hp, True)
            self._submit(rec, grad, hp, 1.0)
            rec.param.grad = None  # the queued update holds it until the worker is done
            return
        rec.spec = (weakref.ref(grad), grad._version, hp, self._speculate)
        if self._speculate:
            self._submit(rec, grad, hp, 1.0)

    def _checked_grad(self, rec: _Record) -> torch.Tensor | None:
        g = rec.param.grad
        if g is None:
            return None
        if g.is_sparse or g.layout != torch.strided:
            raise ValueError(f"{rec.name} has a sparse gradient; OffloadOptimizer supports dense gradients only")
        if g.device != rec.param.device:
            raise ValueError(f"{rec.name} is on {rec.param.device} but its gradient is on {g.device}")
        if g.shape != rec.param.shape:
            raise ValueError(f"{rec.name} has a gradient of shape {tuple(g.shape)}")
        return g

    def _hparams(self, group: dict) -> dict:
        return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}

    def _submit(self, rec: _Record, grad: torch.Tensor, hp: dict, grad_scale: float) -> None:
        flat = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
        for chunk in rec.chunks:
            self._pipeline.submit(_Request(chunk, flat[chunk.start : chunk.start + chunk.numel], hp, rec.step + 1, grad_scale))

    # ------------------------------------------------------------------ chunk I/O and update (worker thread)
    def set_weight_home(self, home: WeightHome | None) -> None:
        """Read and write the weights of the parameters ``home`` holds through it (parameter streaming)."""
        self._pipeline.wait_idle()
        self._weight_home = home

    @contextlib.contextmanager
    def _model_weights(self, rec: _Record, *, modify: bool):
        """The parameter's weights as a flat tensor: on the device, or in its :class:`WeightHome`."""
        home = self._weight_home
        if home is None or not home.holds(rec.param):
            yield rec.param.detach().view(-1)
            return
        flat = home.acquire(rec.param)
        try:
            yield flat
        finally:
            home.release(rec.param, modified=modify)

    def _init_chunk(self, chunk: _Chunk, slot: _Slot) -> None:
        """First update of a chunk: master = the model's weights, zero state; saved as generation 0."""
        rec = chunk.record
        rows = slot.rows(self._rows(rec), chunk.numel)
        with self._model_weights(rec, modify=False) as weights:
            rows[0].copy_(weights[chunk.start : chunk.start + chunk.numel])
        rows[1:].zero_()
        self._put_rows(chunk, 0, rows).result()
        chunk.gen = 0
        chunk.scalars = {}

    @staticmethod
    def _split(rec: _Record) -> bool:
        """fp32 parameters keep their master row in its own store entry: it equals the model's weights
        at the start of a step, so an update reads only the moments (8 of 12 bytes per element)."""
        return rec.param.dtype == torch.float32

    def _needs_master(self, chunk: _Chunk) -> bool:
        """Whether an update must read the master weights (the model's are not the committed ones)."""
        return not self._split(chunk.record) or chunk.applied

    def _entries(self, chunk: _Chunk, gen: int, rows: torch.Tensor, *, state: bool = True, master: bool = True):
        """``(store name, rows)`` of a generation; split chunks can leave out the state or the master."""
        if not self._split(chunk.record):
            return [(chunk.name(gen), rows)]
        entries = []
        if state:
            entries.append((chunk.name(gen), rows[1:]))
        if master:
            entries.append((chunk.name(gen) + ".w", rows[0]))
        return entries

    def _read_chunk(self, chunk: _Chunk, gen: int, slot: _Slot, *, state: bool = True, master: bool = True):
        rows = slot.rows(self._rows(chunk.record), chunk.numel)
        futures = []
        for name, out in self._entries(chunk, gen, rows, state=state, master=master):
            futures.append(self._store.get(name, out=out))
            with self._io_lock:
                self._io_read += out.numel() * 4
        return _AllOf(futures)

    def _put_rows(self, chunk: _Chunk, gen: int, rows: torch.Tensor):
        return _AllOf([self._put(name, part) for name, part in self._entries(chunk, gen, rows)])

    def _delete_gen(self, chunk: _Chunk, gen: int) -> None:
        for name in (chunk.name(gen), chunk.name(gen) + ".w"):
            if name in self._store:
                self._store.delete(name)

    def _put(self, name: str, rows: torch.Tensor):
        fut = self._store.put(name, rows)
        with self._io_lock:
            self._io_written += rows.numel() * 4
        return fut

    def _write_chunk(self, chunk: _Chunk, gen: int, slot: _Slot):
        return self._put_rows(chunk, gen, slot.rows(self._rows(chunk.record), chunk.numel))

    def _update_chunk(self, req: _Request, slot: _Slot, fresh: bool) -> None:
        chunk, rec = req.chunk, req.chunk.record
        rows = slot.rows(self._rows(rec), chunk.numel)
        with self._model_weights(rec, modify=True) as weights:
            self._update_weights(req, rows, slot, weights[chunk.start : chunk.start + chunk.numel], fresh)

    def _update_weights(self, req: _Request, rows: torch.Tensor, slot: _Slot, model: torch.Tensor, fresh: bool) -> None:
        chunk, rec, hp = req.chunk, req.chunk.record, req.hparams
        grad = req.grad
        if grad.device.type != "cpu":
            grad = slot.grad[: chunk.numel].copy_(grad)  # synchronous device-to-host copy
        low = rec.param.dtype in _LOW_PRECISION
        if rec.param.dtype == torch.float32 and fresh:
            rows[0].copy_(model)  # the model's fp32 weights are the master (as in torch)
        if self._is_adam:
            out = None
            if low:
                out = model if model.device.type == "cpu" else slot.out[: chunk.numel].view(rec.param.dtype)
            b1, b2 = hp["betas"]
            adam_step(
                rows[0], grad, rows[1], rows[2],
                step=req.step, lr=hp["lr"], beta1=b1, beta2=b2, eps=hp["eps"],
                weight_decay=hp["weight_decay"],
                decoupled_weight_decay=self._decoupled(hp),
                grad_scale=req.grad_scale, maximize=hp.get("maximize", False),
                param_out=out,
                max_exp_avg_sq=rows[3] if hp.get("amsgrad", False) else None,
            )  # fmt: skip
            if not low or model.device.type != "cpu":
                model.copy_(rows[0] if not low else out)
        else:
            self._generic_update(req, rows, grad)
            model.copy_(rows[0])

    def _decoupled(self, hp: dict) -> bool:
        return bool(hp.get("decoupled_weight_decay", isinstance(self.inner, torch.optim.AdamW)))

    def _generic_update(self, req: _Request, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Run the wrapped optimizer's own step on one chunk whose state tensors are views of ``rows``."""
        chunk, rec = req.chunk, req.chunk.record
        shape = rec.param.shape if chunk.numel == rec.param.numel() else (chunk.numel,)
        cp = rows[0].view(shape)
        cp.grad = (grad.float() * req.grad_scale if req.grad_scale != 1.0 else grad.float()).view(shape)
        state: dict = dict(chunk.scalars)
        for i, key in enumerate(state.pop("__rows__", ())):
            state[key] = rows[1 + i].view(shape)
        row_items, scalars = self._split_state(self._inner_step(cp, dict(rec.group, **req.hparams), state), cp.shape)
        for i, (key, value) in enumerate(row_items):
            row = rows[1 + i]
            if value.data_ptr() != row.data_ptr():
                row.copy_(value.reshape(-1))
        scalars["__rows__"] = tuple(key for key, _ in row_items)
        chunk.pending_scalars = scalars

    def _inner_step(self, cp: torch.Tensor, group: dict, state: dict) -> dict:
        """The wrapped optimizer's ``step`` on the single tensor ``cp`` (its ``grad`` set) with ``group``'s
        hyperparameters, starting from ``state``; returns the new state."""
        inner = self.inner
        saved_groups, saved_state = inner.param_groups, inner.state
        try:
            inner.param_groups = [dict(group, params=[cp])]
            inner.state = defaultdict(dict, {cp: state} if state else {})
            inner.step()
            return inner.state[cp]
        finally:
            inner.param_groups, inner.state = saved_groups, saved_state
            cp.grad = None

    def _split_state(self, state: dict, shape: torch.Size) -> tuple[list[tuple[str, torch.Tensor]], dict]:
        """A generic optimizer's state as (key, tensor) rows shaped like the parameter, and scalars;
        raises ValueError for state that cannot be split into chunks."""
        name = type(self.inner).__name__
        rows, scalars = [], {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
            elif value.shape != shape:
                raise ValueError(
                    f"{name} state {key!r} of shape {tuple(value.shape)} cannot be offloaded:"
                    f" only tensors shaped like the parameter {tuple(shape)} and scalars are supported"
                )
            elif value.dtype != torch.float32:
                raise ValueError(f"{name} state {key!r} of dtype {value.dtype} cannot be offloaded (fp32 only)")
            elif len(rows) + 1 >= _MAX_GENERIC_ROWS:
                raise ValueError(f"{name} keeps more than {_MAX_GENERIC_ROWS - 1} tensors per parameter: cannot be offloaded")
            else:
                rows.append((key, value))
        return rows, scalars

    def _check_state_offloadable(self, group: dict) -> None:
        """Refuse a generic optimizer whose state for ``group`` cannot be split into chunks: two trial steps
        on a small fp32 stand-in of each parameter rank in the group, with the group's hyperparameters."""
        if self._is_adam:
            return
        for ndim in sorted({p.dim() for p in group["params"]}):
            cp = torch.zeros(tuple(range(2, 2 + ndim)), requires_grad=True)
            state: dict = {}
            for _ in range(2):
                cp.grad = torch.full_like(cp, 0.1)
                state = self._inner_step(cp, group, state)
                self._split_state(state, cp.shape)

    def _restore(self, chunks: Iterable[_Chunk]) -> None:
        """Put back the committed weights of chunks whose update reached the model; drop their new generation."""
        to_read = []
        for chunk in chunks:
            if chunk.pending_gen is not None and chunk.pending_gen != chunk.gen:
                self._delete_gen(chunk, chunk.pending_gen)
            chunk.pending_gen = None
            chunk.pending_scalars = {}
            if chunk.applied and chunk.gen is not None:
                to_read.append(chunk)
            chunk.applied = False
        if not to_read:
            return
        failures = []
        with self._pipeline.lend() as slot:
            for chunk in to_read:
                rec = chunk.record
                try:
                    self._read_chunk(chunk, chunk.gen, slot, state=False).result()
                    with self._model_weights(rec, modify=True) as weights:
                        weights[chunk.start : chunk.start + chunk.numel].copy_(slot.rows(self._rows(rec), chunk.numel)[0])
                except BaseException as exc:  # noqa: BLE001
                    failures.append(f"{rec.name} elements [{chunk.start}, {chunk.start + chunk.numel}): {exc}")
        if failures:
            raise OffloadIOError("could not restore the weights of " + "; ".join(failures))

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
            ValueError: a sparse gradient, or one on another device.
            Any other error of the update (e.g. of a wrapped optimizer's own
            ``step``) is raised with its own type, after the same restore.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pipe = self._pipeline
        pipe.wait_idle()
        found_inf = getattr(self, "found_inf", None)  # set by torch.amp.GradScaler
        grad_scale = getattr(self, "grad_scale", None)
        scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        records = self._step_order()
        try:
            if self.config.release_grads and (found_inf is not None or grad_scale is not None):
                self._restore(c for r in records for c in r.chunks)
                raise ValueError(
                    "release_grads (parameter streaming) frees gradients during backward, so fp16 loss scaling"
                    " (GradScaler) cannot check them for overflow: train in bf16 or fp32"
                )
            extra = next((r for r in records if r.spec is not None and r.spec[3] and r.fires > r.learned_fires), None)
            if extra is not None:
                self._restore(c for r in records for c in r.chunks)
                raise RuntimeError(
                    f"backward ran {extra.fires} times for {extra.name} before step(), but the optimizer had learned"
                    f" {extra.learned_fires} per step and updated the parameters during backward pass"
                    f" {extra.learned_fires}: the forward passes after it saw the updated weights, so these gradients"
                    " are not the ones of the step's weights. The parameters were restored and the step skipped;"
                    f" zero the gradients and run the step again (the optimizer now expects {extra.fires} backward"
                    " passes per step), keep the number of micro-batches per step constant, or construct the"
                    " optimizer with overlap=False"
                )
            if found_inf is not None and float(found_inf) > 0:
                self._restore(c for r in records for c in r.chunks)
                return loss
            if self.config.max_grad_norm is not None:
                # Exactly torch.nn.utils.clip_grad_norm_ (the gradients are scaled in place, as it does).
                with_grad = [r.param for r in self._records if r.param.grad is not None]  # in group order
                if with_grad:
                    torch.nn.utils.clip_grad_norm_(with_grad, self.config.max_grad_norm)
            clean = True  # every gradient and hyperparameter is the one its hook saw
            for rec in records:
                grad = self._checked_grad(rec)
                spec, rec.spec = rec.spec, None
                if spec is not None and spec[0] is _RELEASED:
                    if spec[2] != self._hparams(rec.group):
                        self._restore(c for r in records for c in r.chunks)
                        raise RuntimeError(
                            f"the hyperparameters of {rec.name} changed between backward and step(); with"
                            " release_grads the update already ran in backward: change them before backward"
                        )
                    continue
                if grad is None:
                    self._restore(rec.chunks)
                    continue
                hp = self._hparams(rec.group)
                if spec is not None:
                    gref, version, spec_hp, applied = spec
                    unchanged = gref() is grad and grad._version == version and spec_hp == hp and scale == 1.0
                    clean = clean and unchanged
                    if applied and unchanged and not pipe.errors:
                        continue
                    for c in rec.chunks:  # recompute from the committed generation
                        if c.pending_gen is not None and c.pending_gen != c.gen:
                            c.pending_gen = None
                self._submit(rec, grad, hp, scale)
            pipe.wait_idle()
            if pipe.errors:
                error, pipe.errors = pipe.errors[0], []
                self._restore(c for r in records for c in r.chunks)
                if isinstance(error, OSError):
                    raise OffloadIOError(f"optimizer step failed, parameters restored: {error}") from error
                error.add_note("nvoffload: the parameters were restored to their values before this step()")
                raise error
            # Gradients or hyperparameters edited between backward and step(): update in step() until a step
            # shows that they no longer are (the hooks still observe them).
            self._speculate = self._can_speculate and clean
            self._commit(records)
        finally:
            for rec in self._records:
                rec.spec = None
                rec.learned_fires = 1 if self.config.release_grads else rec.fires
                rec.fires = 0
            pipe.errors = []
        if not self._order_learned:
            self._order_learned = True
        pipe.set_plan([c for r in self._step_order() for c in r.chunks if r.param.requires_grad])
        return loss

    def _step_order(self) -> list[_Record]:
        seen = set(self._order)
        return list(self._order) + [r for r in self._records if r not in seen]

    def _commit(self, records: list[_Record]) -> None:
        for rec in records:
            updated = False
            for c in rec.chunks:
                if c.pending_gen is None:
                    continue
                updated = True
                if c.gen is not None and c.gen != c.pending_gen:
                    self._delete_gen(c, c.gen)
                c.gen, c.pending_gen, c.applied = c.pending_gen, None, False
                if not self._is_adam:
                    c.scalars, c.pending_scalars = c.pending_scalars, {}
            if updated:
                rec.step += 1

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict:
        """The state as ordinary tensors, read chunk by chunk from the store.

        Same layout as the wrapped optimizer's ``state_dict()`` (for Adam/AdamW:
        ``step``, ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``,
        fp32), plus ``master_param`` (fp32) for bf16/fp16 parameters.
        """
        self._check_open()
        self._pipeline.wait_idle()
        state = {}
        with self._pipeline.lend() as slot:
            for rec in self._records:
                if rec.step == 0 or any(c.gen is None for c in rec.chunks):
                    continue
                state[rec.index] = self._gather_state(rec, slot)
        groups = []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [r.index for r in self._records if r.group is g]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def _gather_state(self, rec: _Record, slot: _Slot) -> dict:
        n = rec.param.numel()
        nrows = self._rows(rec)
        full = torch.empty(nrows, n, dtype=torch.float32)
        for c in rec.chunks:
            self._read_chunk(c, c.gen, slot).result()
            full[:, c.start : c.start + c.numel] = slot.rows(nrows, c.numel)
        shape = rec.param.shape
        if self._is_adam:
            st = {"step": torch.tensor(float(rec.step))}
            keys = _ADAM_KEYS[: nrows - 1]
            for i, key in enumerate(keys):
                st[key] = full[1 + i].view(shape).clone()
        else:
            scalars = dict(rec.chunks[0].scalars)
            keys = scalars.pop("__rows__", ())
            st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
            for i, key in enumerate(keys):
                st[key] = full[1 + i].view(shape).clone()
        if rec.param.dtype in _LOW_PRECISION:
            st["master_param"] = full[0].view(shape).clone()
        return st

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of the wrapped optimizer's type, streaming it to the store.

        Hyperparameters of the groups are taken from ``state_dict`` (as torch
        does). Parameters without a ``master_param`` entry use the model's
        current weights as master weights.
        """
        self._check_open()
        self._pipeline.wait_idle()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, optimizer has {len(self.param_groups)}")
        by_index = {}
        for g, saved in zip(self.param_groups, groups):
            recs = [r for r in self._records if r.group is g]
            if len(saved["params"]) != len(recs):
                raise ValueError(
                    f"loaded state dict contains a parameter group of {len(saved['params'])} parameters"
                    f" that doesn't match the size of optimizer's group ({len(recs)})"
                )
            for idx, rec in zip(saved["params"], recs):
                by_index[idx] = rec
        for idx, st in state_dict["state"].items():
            if idx not in by_index:
                raise ValueError(f"state for parameter {idx} has no matching parameter")
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        with self._pipeline.lend() as slot:
            for idx, rec in by_index.items():
                self._load_record(rec, state_dict["state"].get(idx), slot)
        self._pipeline.set_plan([c for r in self._step_order() for c in r.chunks if r.param.requires_grad])

    def _load_record(self, rec: _Record, st: dict | None, slot: _Slot) -> None:
        for c in rec.chunks:
            if c.gen is not None:
                self._delete_gen(c, c.gen)
            c.gen, c.pending_gen, c.applied, c.scalars = None, None, False, {}
        rec.step = 0
        if not st:
            return
        nrows = self._rows(rec)
        shape = rec.param.shape
        master = st.get("master_param")
        if self._is_adam:
            tensors = [st[k] for k in _ADAM_KEYS[: nrows - 1] if k in st]
            if len(tensors) != nrows - 1:
                raise ValueError(f"state of {rec.name} lacks {_ADAM_KEYS[: nrows - 1]}: has {sorted(st)}")
            scalars = {}
            rec.step = int(float(st["step"]))
        else:
            tensors, keys, scalars = [], [], {}
            for k, v in st.items():
                if k == "master_param":
                    continue
                if isinstance(v, torch.Tensor) and v.shape == shape and v.numel() > 1:
                    tensors.append(v)
                    keys.append(k)
                else:
                    scalars[k] = v
            scalars["__rows__"] = tuple(keys)
            step = st.get("step", 0)
            rec.step = int(float(step)) if isinstance(step, (int, float, torch.Tensor)) else 0
        for t in [t for t in (master, *tensors) if t is not None]:
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"state tensor of shape {tuple(t.shape)} does not fit {rec.name}")
        for c in rec.chunks:
            rows = slot.rows(nrows, c.numel)
            rows.zero_()
            for i, t in enumerate(tensors, start=1):
                rows[i].copy_(t.detach().reshape(-1)[c.start : c.start + c.numel])
            if master is not None:
                rows[0].copy_(master.detach().reshape(-1)[c.start : c.start + c.numel])
            else:  # the model's current weights are the master
                with self._model_weights(rec, modify=False) as weights:
                    rows[0].copy_(weights[c.start : c.start + c.numel])
            self._put_rows(c, 0, rows).result()
            c.gen = 0
            c.scalars = dict(scalars)

    # ------------------------------------------------------------------ misc
    def synchronize(self) -> None:
        """Wait until the updates that backward queued have run and their state is written (``step()`` does too)."""
        self._check_open()
        self._pipeline.wait_idle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; waits for updates still reading gradients."""
        self._pipeline.wait_idle()
        super().zero_grad(set_to_none)

    def memory_stats(self) -> MemoryStats:
        """Host staging memory (now, peak, limit), bytes on NVMe and I/O bytes since :meth:`reset_io_stats`."""
        return MemoryStats(
            host_bytes=self._host_bytes,
            host_peak_bytes=self._host_peak,
            host_limit_bytes=self.config.cpu_memory_bytes,
            nvme_bytes=int(getattr(self._store, "used_bytes", 0)),
            read_bytes=self._io_read,
            written_bytes=self._io_written,
        )

    def reset_io_stats(self) -> None:
        """Zero the read/written byte counters of :meth:`memory_stats`."""
        with self._io_lock:
            self._io_read = self._io_written = 0

    @property
    def overlap_active(self) -> bool:
        """Whether the next step's updates run during backward: False with ``overlap=False`` or
        ``max_grad_norm``, and for the step after one whose gradients or hyperparameters changed
        between backward and ``step()``, until a step without such a change."""
        return self._speculate

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the OffloadOptimizer is closed")

    def close(self) -> None:
        """Stop the worker, remove the hooks, delete the state from the store and close a store it opened
        (and the :class:`~nvoffload.OffloadSession` that :func:`nvoffload.initialize` built)."""
        if self._closed:
            return
        self._closed = True
        self._pipeline.close()
        for rec in self._records:
            if rec.hook is not None:
                rec.hook.remove()
                rec.hook = None
            for c in rec.chunks:
                for gen in (c.gen, c.pending_gen):
                    if gen is not None:
                        self._delete_gen(c, gen)
        if self._owns_store:
            self._store.close()
        if self.session is not None:
            self.session.close()

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        raise TypeError("OffloadOptimizer cannot be pickled; save its state_dict() instead")


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
