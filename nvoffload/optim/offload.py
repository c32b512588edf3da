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
:mod:`~nvoffload.optim._codec` (state dicts), :mod:`~nvoffload.optim._config`
(the configuration), :mod:`~nvoffload.optim._setup` and
:mod:`~nvoffload.optim._lifetime` (construction, closing); this module is the
``torch.optim.Optimizer`` users hold (its state dicts in
:mod:`~nvoffload.optim._state_dicts`).

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

import functools
import itertools
import weakref
from collections.abc import Callable

import torch

from nvoffload.distributed import Ranks
from nvoffload.memory import retain_freed_host_memory
from nvoffload.optim._chunk_io import ChunkIO, WeightHome
from nvoffload.optim._chunk_state import ResidentState
from nvoffload.optim._codec import StateCodec
from nvoffload.optim._config import MemoryStats, OffloadOptimizerConfig
from nvoffload.optim._generations import OffloadIOError
from nvoffload.optim._hf_trainer import check_trainer_optimizer, check_trainer_recipe, log_optimizer_grad_norm
from nvoffload.optim._in_flight import InFlightHome
from nvoffload.optim._layout import Record
from nvoffload.optim._lifetime import Lifetime, refuse_held_elsewhere
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._protocol import step_protocol
from nvoffload.optim._schedule import StepProtocol
from nvoffload.optim._setup import check_groups, open_storage, planned_layout, shard
from nvoffload.optim._state_dicts import StateDicts
from nvoffload.optim._updates import for_optimizer
from nvoffload.transfer import TransferEngine

__all__ = [
    "OffloadOptimizerConfig", "OffloadOptimizer", "NVMeAdamW", "OffloadIOError", "MemoryStats", "WeightHome", "InFlightHome",
]  # fmt: skip

_INSTANCES = itertools.count()
for _public in (OffloadIOError, WeightHome, InFlightHome, OffloadOptimizerConfig, MemoryStats):
    _public.__module__ = __name__  # their public home (tracebacks, pickles, docs)
del _public


class OffloadOptimizer(StateDicts, torch.optim.Optimizer):
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
        self._pipeline: Pipeline | None = None  # until then, add_param_group is torch's (its __init__ calls it)
        self._records: list[Record] = []

        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # one list: schedulers see the same groups
        device = self._check_groups(self.param_groups)
        self._sharding = shard(process_group, device, self.param_groups, self._update, optimizer, config)
        self._layout = planned_layout(self._update, self.param_groups, f"opt{next(_INSTANCES)}.", config, self._sharding)
        # slots and resident state, allocated once, freed when closed or collected
        self._host_bytes = config.num_slots * self._layout.slot_bytes + config.resident_state_bytes // 4096 * 4096
        storage = open_storage(swap_dir, self._layout, config, self._host_bytes, device, transfer, self._sharding)
        self._store = storage.store
        self._io = ChunkIO(self._store, self._layout, storage.transfer)
        slots = [self._layout.new_slot(storage.slab) for _ in range(config.num_slots)]
        self._resident = ResidentState(storage.slab, config.resident_state_bytes, self._layout.slot_rows)
        self._pipeline = Pipeline(self._io, self._update, slots, config.prefetch_chunks)
        self._protocol = step_protocol(self._records, self._io, self._pipeline, config, self._sharding)
        self._codec = StateCodec(self._records, self._io, self._update, self._pipeline)
        self._life = Lifetime(self, self._pipeline, self._records, self._io, storage.owns_store, storage.close_transfer)
        try:
            for g in self.param_groups:
                for p in g["params"]:
                    self._add_record(p, g)
            if inner_state is not None:
                optimizer.state.clear()
                self.load_state_dict(inner_state)
        except BaseException:
            self._life.shutdown()  # refused: its hooks and state go now, not when the error's traceback is dropped
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
        device = check_groups(self.param_groups, groups, self._update)
        refuse_held_elsewhere(self, groups)
        return device

    def _add_record(self, p: torch.Tensor, group: dict) -> None:
        rec = self._layout.new_record(len(self._records), p, group)
        if p.requires_grad:
            for c in rec.chunks:
                self._resident.offer(c, self._layout.chunk_state_bytes(c))
        self._records.append(rec)
        self._hook_if_trained(rec)

    def _hook_if_trained(self, rec: Record) -> None:
        """Give a parameter that requires grad the hooks of the step protocol (a frozen one has none: no gradient,
        no state); they hold the optimizer weakly."""
        self._protocol.hook(rec, functools.partial(_hook_for, weakref.ref(self)))

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
        return self._protocol.grad_norm()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; waits for updates still reading gradients (not with
        ``delayed_update`` and ``set_to_none``, nor with ``release_grads``, whose gradients are None after their
        hooks: the queued updates hold the gradients they read)."""
        self._check_open()
        self._protocol.before_zero_grad(set_to_none)
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

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        self._life.check_open()

    def close(self) -> None:
        """Stop the worker, remove the hooks, delete the state from the store and close a store it opened
        (and the :class:`~nvoffload.OffloadSession` that :func:`nvoffload.initialize` built). With
        ``delayed_update`` the update in flight lands first (its error is raised once all that is done)."""
        try:
            if not self._life.closed:
                self._protocol.land()
        finally:
            if self._life.shutdown() and self.session is not None:
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
