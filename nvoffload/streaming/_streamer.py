""":class:`ParameterStreamer`: builds the tiers of parameter streaming and wires them to the model's hooks."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from nvoffload import device as _device
from nvoffload import trace
from nvoffload.core.buffers import ALIGNMENT_BYTES
from nvoffload.io import TensorStore
from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.streaming._backward import BackwardPasses, CallHooks
from nvoffload.streaming._blocks import Block, find_blocks, partition, resident_bytes
from nvoffload.streaming._guard import closed_error
from nvoffload.streaming._hf_models import CheckpointSources
from nvoffload.streaming._host_cache import HostCache
from nvoffload.streaming._materialize import Materializer
from nvoffload.streaming._peft import PeftView
from nvoffload.streaming._residency import DeviceResidency
from nvoffload.streaming._weights import StreamedWeights
from nvoffload.transfer import TransferEngine

__all__ = ["ParameterStreamer", "StreamingStats", "compute_device_of", "device_bytes_needed"]


@dataclass(frozen=True)
class StreamingStats:
    """A snapshot of a streamer's counters, since it was built or its last :meth:`~ParameterStreamer.reset_stats`."""

    bytes_read: int  # read from the store into the host cache
    bytes_written: int  # written from the host cache to the store
    io_wait_s: float  # forward and backward waiting for blocks to arrive (on a GPU: in host memory)
    grad_wait_s: float  # backward waiting for the optimizer to free gradients' device memory


class ParameterStreamer:
    """Streams the parameters of a model's blocks between NVMe, host memory and the device.

    Each block's parameters are one flat byte tensor in the store (each at an
    aligned offset, with its own dtype: a block may mix dtypes), cached in host
    memory as the host budget allows, and on the device only while a forward,
    a backward or a ``load_state_dict`` uses the block. Off the device a
    parameter keeps its identity, shape, dtype, device, ``grad`` and hooks, so
    optimizers, autograd and checkpoint code keep working, but its storage holds
    no bytes and reading it raises :class:`~nvoffload.streaming.StreamedParameterError`
    (read it with ``streamer.weights.gather`` or ``state_dict()``, which give the current weights,
    for the model or any sub-module). Parameters outside every block
    (embeddings, final norm, head) stay on the device, counted in the device budget.

    Every copy goes through a :class:`~nvoffload.transfer.TransferEngine`, and
    the next block's copy to the device runs on its copy stream while the block
    before it computes (double buffering, when the device budget has room for
    both). Module hooks, never a replaced ``forward``: a block's forward
    pre-hook has the compute stream wait for the block's copy (starting it if
    it was not started ahead), starts the next block's copy and reads the blocks
    after it from the store into host memory; its forward hook lets it go. Its
    backward pre-hook does the same in reverse order (autograd saved the
    parameters themselves, whose storage is refilled in place), and the
    backward pass lets it go once it is done with the block
    (see :class:`~nvoffload.streaming._backward.BackwardPasses`). The optimizer
    reads and writes streamed weights through :attr:`weights`, its
    :class:`~nvoffload.optim.WeightHome`, so the next forward sees the updates.
    Its counters (store bytes, waits) are read as one snapshot: :meth:`stats`.

    Args:
        model: the model; its parameters may be on the device or on the meta
            device (then ``param_init_fn`` or ``checkpoint`` fills them, one
            block at a time, straight into the store). Its buffers on the meta
            device come from ``checkpoint``; those it does not hold (non-persistent
            ones such as rotary ``inv_freq``, or all without a checkpoint) are
            computed by a twin of the model built from its ``config`` on the CPU
            with its parameters on the meta device (``type(model)(model.config)``,
            as for a Hugging Face ``PreTrainedModel``); a model that cannot be
            rebuilt so raises ``ValueError`` naming the buffer.
        store: the tensor store that holds the blocks' weights.
        memory: the budgets; raises :class:`~nvoffload.memory.MemoryBudgetError`
            at construction when they cannot hold the resident parameters plus
            ``2 + prefetch_blocks`` of the largest block (with its gradients).
        device: the compute device (default: where the parameters are; the CPU
            for a model on the meta device without CUDA).
        blocks: the modules to stream (default: :func:`find_blocks`); a parameter
            in two of them raises ``ValueError``.
        prefetch_blocks: blocks read ahead into host memory beyond the one being
            copied to the device ahead of its use.
        delayed_update: the optimizer's updates are delayed (its ``delayed_update``): the budgets also hold a
            block's twin and the block it is made from (host), and the staged new weights of the trained
            parameters outside the blocks (device, allocated here).
        param_init_fn: called on each module of a meta model to initialize its
            parameters once they have memory, children before parents (default:
            for a Hugging Face ``PreTrainedModel`` its ``_init_weights``, else
            ``reset_parameters()`` of the modules that have it). Parameters are
            NaN until then: one left unset raises ``ValueError`` naming it.
        checkpoint: a reader with ``keys()``, ``info(name)`` and ``read(name, out=)``
            (:func:`nvoffload.checkpoint.open_checkpoint`) to fill a model built on
            the meta device from, one tensor at a time. Its tensors must match the
            model's parameters and persistent buffers by name (one name of a tied
            parameter is enough, as in Hugging Face checkpoints without
            ``lm_head.weight``) and shape; other dtypes are converted. For a
            Hugging Face model, names are matched as transformers matches them:
            its family's renamings (GPT-NeoX's ``embed_out``), the model's
            ``base_model_prefix`` added or stripped (the hub's GPT-2 names
            ``h.0...``, ``GPT2LMHeadModel`` ``transformer.h.0...``), its
            ``_keys_to_ignore_on_load_unexpected`` ignored. A missing or
            unexpected tensor raises ``KeyError`` before anything is read. A
            PEFT model is filled from its base model's checkpoint (its adapters
            initialized as PEFT does), or from a list of two: the base model's
            and the adapter's (``[open_checkpoint(base_dir), open_checkpoint(adapter_dir)]``).
        transfer: the transfer engine to move the blocks with; its slab holds the
            host cache, and it stays open at :meth:`close`. Default: the streamer's
            own, over a :class:`~nvoffload.transfer.HostSlab` of the host budget
            ``memory`` has left, closed with the streamer.
    """

    def __init__(
        self,
        model: nn.Module,
        store: TensorStore,
        memory: MemoryManager,
        *,
        device: torch.device | str | None = None,
        blocks: Iterable[nn.Module] | None = None,
        prefetch_blocks: int = 1,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        checkpoint=None,
        transfer: TransferEngine | None = None,
        delayed_update: bool = False,
    ):
        if not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0, got {prefetch_blocks!r}")
        self.model = model
        self.store = store
        self.memory = memory
        self.prefetch_blocks = prefetch_blocks
        self.device = _device.concrete(device) if device is not None else compute_device_of(model)
        if transfer is not None and transfer.device.device.type != self.device.type:
            raise ValueError(f"the transfer engine copies to {transfer.device.device}, not to {self.device}")
        # a transfer engine's whole share (initialize carves the gloo gradient buckets' room from it, as the
        # host tier counted them before: the same budgets pass)
        host_bytes = memory.available_bytes("host") if transfer is None else transfer.slab.capacity_bytes
        # 1. partition (_blocks): the blocks, each's layout, and the parameters outside them; the budgets checked
        self._blocks, self._resident = partition(model, blocks if blocks is not None else find_blocks(model))
        self._backward_order = self._blocks[::-1]  # the blocks as backward runs them, read ahead in that order
        resident = resident_bytes(self._resident), resident_bytes(self._resident, grads=True)
        _check_budgets(self._blocks, *resident, memory, host_bytes, prefetch_blocks, delayed_update)
        # 2. names (_hf_models): how the tensors of a model on the meta device are filled, the checkpoint's
        # names matched to the model's and checked before anything is read or allocated
        peft = PeftView.of(model)
        filling = Materializer(model, self.device, param_init_fn=param_init_fn, view=peft)
        sources = CheckpointSources(model, checkpoint, peft) if checkpoint is not None else None
        self._owns_transfer = transfer is None
        if transfer is None:
            transfer = TransferEngine(host_bytes, self.device, what="parameter streaming's host memory")
        self.transfer = transfer
        try:
            if self._owns_transfer and memory.host_slab is None:  # the host tier is the slab's accounting
                memory.use_host_slab(transfer.slab)
            # the tiers: read ahead, the block copied to the device next and ``prefetch_blocks`` after it
            largest = max(b.nbytes for b in self._blocks)
            self.cache = HostCache(store, transfer, read_ahead_bytes=(1 + prefetch_blocks) * largest)
            self._residency = DeviceResidency(memory, self.cache, transfer, self.device, model, resident[0])
            memory.allocate("device", resident[0], "parameters outside the streamed blocks")
            if delayed_update:  # their gradients' bytes: the trained ones' weights, once more
                memory.allocate("device", resident[1], "the delayed update's staged weights")
            # 3. fill (_materialize), one block at a time, and 4. residency: each block stored and cached
            # (_host_cache), its parameters off the device (_residency) before the next is filled
            for block in filling.filled(self._blocks, self._resident, sources):
                self.cache.install(block, block.pack)
                self._residency.park(block)
        except BaseException:
            self._close_transfer()
            raise
        self.replaced: dict[nn.Parameter, nn.Parameter] = filling.replaced  # meta parameters -> their successors
        # the streamed parameters' current weights: the optimizer's WeightHome, and the state-dict hooks' body
        self.weights = StreamedWeights(model, self._blocks, self.cache, self._residency)
        # when each backward pass is done with a block; outside backward, ``passes.failed``: a pass that raised
        self.passes = BackwardPasses(self._residency)
        self._closed = False
        self._computing: dict[Block, int] = {}  # with a trace: when each block's forward or backward began
        self._staged_grads: tuple[Block | None, int] = (None, 0)  # the block backward staged last, its gradients' bytes
        self._grad_hooked: set[nn.Parameter] = set()  # the parameters with a gradient hook (follow_requires_grad)
        weakref.finalize(self, self._residency.close)  # a streamer dropped without close() closes its parameters
        self._install_hooks()

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        """Hooks on the model that stay for its lifetime; after :meth:`close` those that would need the weights raise."""
        for block in self._blocks:
            m = block.module
            calls = CallHooks(
                _hook(self, ParameterStreamer._before_backward, block, needs_weights=True),
                _hook(self, ParameterStreamer._after_backward_call, block),
            )  # the module's backward hooks, per call
            m.register_forward_pre_hook(_hook(self, ParameterStreamer._before_forward, block, calls, needs_weights=True))
            m.register_forward_hook(_hook(self, ParameterStreamer._after_forward, block, calls), always_call=True)
        self.follow_requires_grad()
        for module, owned in self.weights.owners:
            for register, method, needs_weights in (
                (module.register_state_dict_post_hook, StreamedWeights.after_state_dict, True),
                (module.register_load_state_dict_pre_hook, StreamedWeights.before_load, True),
                (module.register_load_state_dict_post_hook, StreamedWeights.after_load, False),
            ):
                register(_hook(self, _on_weights(method), owned, needs_weights=needs_weights))

    def follow_requires_grad(self) -> None:
        """Give the parameters that require grad and have no gradient hook yet (all at first; later, those unfrozen
        since) the hook that counts their gradients and lets their block go once the gradients are accumulated.
        Call it before the forward of a step (:func:`nvoffload.initialize` does), and before the optimizer's
        :meth:`~nvoffload.optim.OffloadOptimizer.follow_requires_grad`: the hook must run before the optimizer's.

        Raises ValueError naming them for parameters the model did not have when the streamer was set up (a PEFT
        model wrapped after :func:`nvoffload.initialize`: its adapters would be neither streamed nor trained)."""
        params = [(p, (block,)) for block in self._blocks for p in block.params]
        params += [(p, ()) for _, p in self._resident]
        known = {p for p, _ in params}
        added = [name for name, p in self.model.named_parameters() if p not in known]
        if added:
            raise ValueError(
                f"{', '.join(added[:3])}{', ...' if len(added) > 3 else ''}: parameters the model did not have when "
                "nvoffload.initialize() ran (PEFT's adapters, wrapped by get_peft_model after it?), neither streamed "
                "nor trained: wrap the model (peft.get_peft_model) before nvoffload.initialize(), and initialize the "
                "wrapped model"
            )
        with torch._C.DisableTorchFunctionSubclass():  # nothing here reads the weights: past the off-device guard
            for p, block in params:
                if p.requires_grad and p not in self._grad_hooked:
                    p.register_post_accumulate_grad_hook(self.passes.grad_hook(id(p), *block))
                    self._grad_hooked.add(p)

    def _before_forward(self, block: Block, calls: CallHooks, module, args) -> None:
        if _graph_task() != -1:  # a checkpointed call recomputed by backward, which holds the block: no read ahead
            self._residency.hold(block, "forward")
            return
        waited_ns = time.monotonic_ns()
        self.passes.release_unfinished()
        self._staged_grads = (None, 0)  # found again by the next backward (parameters may be frozen or unfrozen)
        self._residency.hold(block, "forward")
        self.cache.read_ahead(self._blocks, block)
        self._residency.stage(self._blocks[block.pos + 1] if block.pos + 1 < len(self._blocks) else None)
        if trace.active() is not None:
            self._compute_began(block, waited_ns)
        calls.forward_began(module, args)

    def _compute_began(self, block: Block, waited_ns: int) -> None:
        """With a trace: the wait for ``block``'s weights (since ``waited_ns``) as a span; its compute starts now."""
        now = time.monotonic_ns()
        trace.active().add("compute", f"wait {block.index}", waited_ns, now)
        self._computing[block] = now

    def _compute_ended(self, block: Block, what: str) -> None:
        """With a trace: ``block``'s compute (since :meth:`_compute_began`) as a span."""
        started = self._computing.pop(block, None)
        recording = trace.active()
        if recording is not None and started is not None:
            recording.add("compute", f"{what} {block.index}", started, time.monotonic_ns())

    def _after_forward(self, block: Block, calls: CallHooks, module, args, output) -> None:
        if _graph_task() != -1:
            if self._residency.holds(block, "forward"):
                self._residency.unhold(block, "forward")
            return
        if self._computing:
            self._compute_ended(block, "forward")
        if self._residency.holds(block, "forward"):  # none when the pre-hook raised
            # The last block is the first backward needs: it stays on the device, unless no backward is coming.
            stay = block.pos == len(self._blocks) - 1 and torch.is_grad_enabled() and bool(block.trainable)
            self._residency.unhold(block, "forward", stay=stay)
            calls.forward_ended(module, output)

    @property
    def blocks(self) -> list[nn.Module]:
        """The streamed blocks' modules, in forward order."""
        return [b.module for b in self._blocks]

    def stats(self) -> StreamingStats:
        """The store bytes the host cache read and wrote and the time the passes waited, as one snapshot."""
        return StreamingStats(
            bytes_read=self.cache.bytes_read,
            bytes_written=self.cache.bytes_written,
            io_wait_s=self._residency.io_wait_s,
            grad_wait_s=self._residency.grad_wait_s,
        )

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats` (:meth:`~nvoffload.training.OffloadSession.reset_stats` calls it)."""
        self.cache.bytes_read = self.cache.bytes_written = 0
        self._residency.io_wait_s = self._residency.grad_wait_s = 0.0

    @contextlib.contextmanager
    def kept(self, module: nn.Module):
        """Keep the streamed block ``module`` on the device while the context is open, across several calls of
        it (the micro-batches of :func:`nvoffload.vertical.vertical_step`): copied once, at the first call or
        before. At the exit the last block stays for the backward to come (when grad is enabled), as after its
        forward."""
        block = next((b for b in self._blocks if b.module is module), None)
        if block is None:
            raise ValueError(f"{type(module).__name__} is not one of the streamed blocks")
        self._residency.hold(block, "kept")
        try:
            yield
        finally:
            stay = block.pos == len(self._blocks) - 1 and torch.is_grad_enabled() and bool(block.trainable)
            self._residency.unhold(block, "kept", stay=stay)

    def _before_backward(self, block: Block, module) -> None:
        waited_ns = time.monotonic_ns()
        staged, staged_grads = self._staged_grads  # found by the pre-hook before, which staged this block
        grads = staged_grads if staged is block else self._grad_headroom(block)
        self.passes.enter(block, headroom_bytes=grads)
        self.cache.read_ahead(self._backward_order, block)
        # the next block arrives now; its gradients and this block's are made while both are on the device
        nxt = self._blocks[block.pos - 1] if block.pos > 0 else None
        self._staged_grads = (nxt, self._grad_headroom(nxt) if nxt else 0)
        self._residency.stage(nxt, headroom_bytes=grads + self._staged_grads[1])
        if trace.active() is not None:
            self._compute_began(block, waited_ns)

    def _grad_headroom(self, block: Block) -> int:
        """Device bytes of the gradients ``block``'s backward makes (the first block's: the resident ones' too)."""
        return block.grad_bytes + (resident_bytes(self._resident, grads=True) if block.pos == 0 else 0)

    def _after_backward_call(self, block: Block, module, *grads) -> None:
        if self._computing:
            self._compute_ended(block, "backward")
        self.passes.inputs_done(block)

    def close(self) -> None:
        """Take every block off the device and give back the host cache.

        The streamed parameters' weights go with it (save them first with
        ``streamer.weights.save_checkpoint`` or ``state_dict()``): from now on reading a
        streamed parameter, running a block forward or backward, and
        ``state_dict()`` or ``load_state_dict()`` of a module holding streamed
        parameters raise :class:`~nvoffload.streaming.StreamedParameterError`.
        """
        if self._closed:
            return
        self._closed = True
        self.passes.closed = True
        self._residency.close()
        self.cache.close()
        self._close_transfer()

    def _close_transfer(self) -> None:
        if self._owns_transfer:
            self.transfer.close()


_graph_task = torch._C._current_graph_task_id  # != -1: a block's forward runs inside a backward pass (recomputed)


def _hook(streamer: ParameterStreamer, method, *bound, needs_weights: bool = False):
    """A hook calling ``method(streamer, *bound, *hook_args)`` without keeping the streamer alive.

    Once the streamer is closed (or gone) the hook does nothing, or, if it
    ``needs_weights``, raises :class:`~nvoffload.streaming.StreamedParameterError`.
    """
    ref, model = weakref.ref(streamer), type(streamer.model).__name__
    what = bound[0] if bound and isinstance(bound[0], Block) else "a module"

    def hook(*args):
        live = ref()
        if live is None or live._closed:
            if needs_weights:
                raise closed_error(f"{what} of this {model} needs streamed weights, but")
            return None
        return method(live, *bound, *args)

    return hook


def _on_weights(method: Callable) -> Callable:
    """``method`` of :class:`StreamedWeights` as a method of the streamer (for :func:`_hook`): called on its weights."""
    return lambda streamer, *args: method(streamer.weights, *args)


def compute_device_of(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its real parameters; for a model on the meta device, CUDA when present."""
    devices = {p.device for p in model.parameters()} - {torch.device("meta")}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices: {sorted(map(str, devices))}")
    if devices:
        return devices.pop()
    return _device.concrete("cuda") if _device.cuda_available() else torch.device("cpu")


def device_bytes_needed(blocks: list[Block], resident, delayed_update: bool) -> int:
    """The least device memory streaming works in: the resident parameters and their gradients (delayed: and the
    staged new weights of the trained ones), one block computing, its gradients, one arriving (3 x the largest)."""
    return _device_bytes(blocks, resident_bytes(resident), resident_bytes(resident, grads=True), delayed_update)


def _device_bytes(blocks: list[Block], resident_bytes: int, resident_grad_bytes: int, delayed_update: bool) -> int:
    """:func:`device_bytes_needed` of the resident parameters' bytes and their gradients'."""
    return resident_bytes + resident_grad_bytes * (2 if delayed_update else 1) + 3 * max(b.nbytes for b in blocks)


def _check_budgets(blocks: list[Block], resident_bytes: int, resident_grad_bytes: int, memory: MemoryManager,
                   host_bytes: int, prefetch_blocks: int, delayed_update: bool) -> None:  # fmt: skip
    """Raise :class:`MemoryBudgetError` when the device budget or the ``host_bytes`` of the host cache are too small."""
    if not blocks:
        raise ValueError("the model has no parameters in its blocks: nothing to stream")
    largest = max(b.nbytes for b in blocks)
    device_needed = _device_bytes(blocks, resident_bytes, resident_grad_bytes, delayed_update)
    # in host memory (slab buffers are 4 KiB-aligned): one block computing, one arriving, those read ahead; and
    # delayed, a twin being written and the block it is made from
    in_host = 2 + prefetch_blocks + (2 if delayed_update else 0)
    host_needed = in_host * -(-largest // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    problems = []
    if memory.limit_bytes("device") < device_needed:
        problems.append(
            f"device_memory_bytes must be at least {device_needed} (resident parameters and their gradients"
            f"{' and staged new weights' if delayed_update else ''}: {device_needed - 3 * largest}, plus 3 x the"
            f" largest block's {largest})"
        )
    if host_bytes < host_needed:
        problems.append(
            f"the host budget has {host_bytes} bytes left for parameter blocks; "
            f"streaming needs at least {host_needed} ({in_host} x the largest block's {largest}"
            f"{', two of them for the delayed update' if delayed_update else ''})"
        )
    if problems:
        raise MemoryBudgetError(
            "budgets too small for parameter streaming: " + "; ".join(problems),
            host_shortfall_bytes=max(0, host_needed - host_bytes),
        )
