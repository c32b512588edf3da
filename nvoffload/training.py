"""One entry point for training scripts: all three tiers at once, within the user's budgets.

>>> model, optimizer = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
...     nvoffload.OffloadConfig(swap_dirs=["/mnt/nvme0/swap"], cpu_memory_bytes=4 << 30,
...                             device_memory_bytes=2 << 30))   # doctest: +SKIP

after which the ordinary loop (``loss.backward(); optimizer.step();
optimizer.zero_grad()``) streams the blocks' parameters from NVMe, updates the
optimizer state on NVMe during backward and, with ``offload_activations=True``,
sends the saved activations to NVMe too. Gradient clipping, accumulation and
fp16 loss scaling are the config's (``max_grad_norm``,
``gradient_accumulation_steps``, ``loss_scaling``), not the loop's: no gradient
is left in memory after backward for ``clip_grad_norm_`` or a ``GradScaler``
to read.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from nvoffload import trace
from nvoffload.activations import offload_activations as _offload_activations
from nvoffload.core.buffers import ALIGNMENT_BYTES
from nvoffload.device import compute_device, concrete
from nvoffload.distributed import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    Ranks,
    buckets_budget,
    check_not_ddp,
    reserve_buckets,
)
from nvoffload.io import TensorStore, swap_directories
from nvoffload.memory import (
    MemoryBudgetError,
    MemoryManager,
    TierStats,
    release_freed_host_memory,
    resident_state_share,
)
from nvoffload.optim import Layout, LossScaling, OffloadOptimizer, OffloadOptimizerConfig, for_optimizer
from nvoffload.streaming import (
    ParameterStreamer,
    compute_device_of,
    device_bytes_needed,
    find_blocks,
    partition,
    resident_bytes,
)
from nvoffload.transfer import HostSlab, TransferEngine

__all__ = ["OffloadConfig", "OffloadSession", "initialize"]

_MiB = 1 << 20


def check_activation_host_bytes(value: int, offload_activations: bool) -> None:
    """Raise ValueError unless ``value`` is an ``activation_host_bytes`` (an int >= 0, and 0 without
    ``offload_activations``): :class:`OffloadConfig`'s and ``FinetuneConfig``'s check."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"activation_host_bytes must be an int number of bytes >= 0, got {value!r}")
    if value and not offload_activations:
        raise ValueError("activation_host_bytes keeps offloaded activations in host memory: set offload_activations")


def check_stash_bytes(host_bytes: int | None, staging_bytes: int | None) -> None:
    """Raise ValueError unless ``host_bytes`` is a ``stash_host_bytes`` (None or an int >= 0) and ``staging_bytes`` a
    ``stash_staging_bytes`` (None, or a positive int given with ``host_bytes``)."""
    if host_bytes is not None and (isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0):
        raise ValueError(f"stash_host_bytes must be None or an int number of bytes >= 0, got {host_bytes!r}")
    if staging_bytes is None:
        return
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes <= 0:
        raise ValueError(f"stash_staging_bytes must be None or a positive int number of bytes, got {staging_bytes!r}")
    if host_bytes is None:
        raise ValueError("stash_staging_bytes stages the vertical schedule's stash: set stash_host_bytes too")


@dataclass(frozen=True)
class OffloadConfig:
    """Budgets and placement for :func:`initialize`.

    Attributes:
        swap_dirs: directories on NVMe (one swap file each, striped).
        cpu_memory_bytes: host memory for the optimizer's staging buffers, the
            cache of parameter blocks and the activation transfers, together:
            one slab of exactly this size (page-locked once with CUDA), carved
            between the three engines' transfer engines.
        device_memory_bytes: device memory for streamed blocks, the parameters
            outside the blocks and gradients in flight (activations are the
            model's own and not counted).
        optimizer_memory_fraction: share of ``cpu_memory_bytes`` given to the
            optimizer's staging buffers; the rest caches parameter blocks, and
            what it holds beyond every block keeps optimizer state resident in
            host memory, never on NVMe (:func:`nvoffload.memory.resident_state_share`:
            the planner's split too).
        prefetch_blocks: parameter blocks read ahead of the one computing.
        device: the compute device for a model built on the meta device
            (default: CUDA when available, else the CPU); a model with real
            parameters computes where they are.
        offload_activations: also send saved activations to the swap directories.
        activation_memory_bytes: with ``offload_activations``, host memory for
            activation transfers, half for writes in flight and half for reads
            ahead (the staging between device and NVMe), taken from
            ``cpu_memory_bytes``; None: an eighth of it. It also sizes what
            stays on the device: up to half of it in writes in flight, half in
            reads ahead, and a third in the most recent saved tensors (kept,
            never written).
        activation_host_bytes: with ``offload_activations``, saved activations
            (the vertical schedule's block inputs among them) are kept in host
            memory up to this many bytes, taken from ``cpu_memory_bytes``
            besides ``activation_memory_bytes``; only the rest is written to
            NVMe (:class:`~nvoffload.activations.ActivationOffloadConfig`'s
            ``host_resident_bytes``). 0 (default): all of them go to NVMe.
        stash_host_bytes: the vertical schedule's stash (:func:`~nvoffload.vertical_step`): each streamed block's
            input for each micro-batch, kept until that block's backward, is copied off the device as forward
            makes it and kept in host memory up to this many bytes (taken from ``cpu_memory_bytes``), written to
            NVMe beyond, and read back ahead of backward, block by block in reverse; the device holds only the
            stash's transfers in flight (``stash_staging_bytes``), so the number of micro-batches a step is bound
            by host memory and the drives, not by device memory. None (default): the block inputs stay on the
            device (or go through activation offload with ``offload_activations``); 0: all of them to NVMe.
        stash_staging_bytes: with ``stash_host_bytes``, host memory (from ``cpu_memory_bytes``) staging the
            stash's transfers, half for writes in flight and half for reads ahead; it also bounds the stash's
            device memory (block inputs whose copy is in flight, or read back ahead of their block's backward).
            None: an eighth of ``device_memory_bytes``, at most an eighth of ``cpu_memory_bytes``.
        checksum: checksum every tensor in the store (CRC-32C, on by default; see
            :class:`~nvoffload.io.TensorStore`).
        trace_path: record a :mod:`nvoffload.trace` of everything the session does, from
            :func:`initialize` to ``close()``, and write it there (Chrome trace-event JSON, for
            Perfetto) at ``close()``. For a short run; :func:`nvoffload.trace.tracing` records a
            chosen stretch of a long one.
        max_grad_norm: clip the global gradient norm to this, exactly as
            ``torch.nn.utils.clip_grad_norm_`` (None: no clipping). The updates
            still run during backward; when the norm turns out larger, ``step()``
            redoes them from the gradients it kept in the store (4 bytes per
            parameter written each step, and read again when it clips), and
            the steps after it defer their updates until one does not clip
            (``defer_updates``). The
            norm of a parameter larger than one optimizer chunk is summed from
            its chunks' norms, which can differ from torch's in the last bit.
        defer_updates: when the updates run: during backward (False), queued
            by ``step()`` with the norm known and landing during the next
            forward (True), or by the rule (None, the default: deferred after a
            step whose clipping bit); see
            :class:`~nvoffload.optim.OffloadOptimizerConfig`. Exact either way.
        delayed_update: each step's updates run during the next step's forward
            and backward, which read the weights of before them (PipeDream-2BW's
            and ZeRO-Offload's delayed update; opt-in, not exact AdamW: the
            weights are AdamW's applied one step late). Each streamed block's new
            weights wait in a twin of it (host cache, then store) until the next
            ``step()``; see :class:`~nvoffload.optim.OffloadOptimizerConfig`.
        delayed_update_after: with ``delayed_update``, the steps that update
            exactly first.
        gradient_accumulation_steps: backward passes per ``optimizer.step()``;
            their gradients are summed in fp32 in the store (4 bytes per
            parameter written per micro-batch, and read from the second).
        loss_scaling: fp16 dynamic loss scaling on ``torch.amp.GradScaler``'s
            schedule (call ``loss = optimizer.scale_loss(loss)`` before
            ``backward()``); a step whose gradients overflow is skipped.
        retain_host_memory: let the optimizer and activation offload call
            :func:`nvoffload.memory.retain_freed_host_memory`. Off by default
            here, because freed memory then stays with the process: in the 1.3B
            scale run steps took 30 and 25 s instead of 39 and 36 s, but peak
            RSS rose from 1.5 to 4.4 GiB above the budgets
            (``bench/results/bench_streaming_retained.md``). When off,
            :func:`initialize` calls :func:`nvoffload.memory.release_freed_host_memory`
            instead (process-wide), so freed activations and gradients go back
            to the operating system at once (``bench/results/bench_memory.md``).
        bucket_bytes, collective_timeout_s: over several ranks, the gradients' and weights' bucket size
            and the longest wait for one collective (see :class:`~nvoffload.optim.OffloadOptimizerConfig`).
            The released gradients wait on the device in their open bucket until it fills, beside the
            streamed blocks: ``bucket_bytes`` unset (None) is ``DEFAULT_BUCKET_BYTES`` or what
            ``device_memory_bytes`` leaves for it, if less; a value given that does not fit there is refused
            before the first step, naming what does.
        state_precision: how the optimizer keeps Adam's state: ``"fp32"`` (exact AdamW, the default),
            ``"bf16-moments"`` or ``"bf16"`` (compact, not exact; see
            :class:`~nvoffload.optim.OffloadOptimizerConfig`).
    """

    swap_dirs: Sequence[str | os.PathLike] = field(default_factory=list)
    cpu_memory_bytes: int = 4 << 30
    device_memory_bytes: int = 8 << 30
    optimizer_memory_fraction: float = 0.5
    prefetch_blocks: int = 1
    device: str | None = None
    offload_activations: bool = False
    activation_memory_bytes: int | None = None
    activation_host_bytes: int = 0
    stash_host_bytes: int | None = None
    stash_staging_bytes: int | None = None
    checksum: bool = True
    trace_path: str | None = None
    max_grad_norm: float | None = None
    gradient_accumulation_steps: int = 1
    loss_scaling: LossScaling | None = None
    retain_host_memory: bool = False
    bucket_bytes: int | None = None
    collective_timeout_s: float = DEFAULT_TIMEOUT_S
    state_precision: str = "fp32"
    defer_updates: bool | None = None
    delayed_update: bool = False
    delayed_update_after: int = 0

    def __post_init__(self):
        object.__setattr__(self, "swap_dirs", tuple(swap_directories(self.swap_dirs)))
        sizes = {"cpu_memory_bytes": self.cpu_memory_bytes, "device_memory_bytes": self.device_memory_bytes}
        if self.activation_memory_bytes is not None:
            sizes["activation_memory_bytes"] = self.activation_memory_bytes
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int number of bytes, got {value!r}")
        check_activation_host_bytes(self.activation_host_bytes, self.offload_activations)
        check_stash_bytes(self.stash_host_bytes, self.stash_staging_bytes)
        if self.trace_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.trace_path))):
            raise ValueError(f"trace_path: the directory of {self.trace_path} does not exist")
        if not 0 < self.optimizer_memory_fraction < 1:
            raise ValueError(f"optimizer_memory_fraction must be in (0, 1), got {self.optimizer_memory_fraction}")
        if not isinstance(self.prefetch_blocks, int) or self.prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0, got {self.prefetch_blocks!r}")
        self.optimizer_config(cpu_memory_bytes=1)  # validates the optimizer's fields at the boundary

    def optimizer_config(self, cpu_memory_bytes: int, resident_state_bytes: int = 0) -> OffloadOptimizerConfig:
        """The :class:`~nvoffload.optim.OffloadOptimizerConfig` of the optimizer :func:`initialize` builds."""
        return OffloadOptimizerConfig(
            cpu_memory_bytes=cpu_memory_bytes, resident_state_bytes=resident_state_bytes, release_grads=True, checksum=self.checksum,
            retain_host_memory=self.retain_host_memory, max_grad_norm=self.max_grad_norm,
            gradient_accumulation_steps=self.gradient_accumulation_steps, loss_scaling=self.loss_scaling,
            bucket_bytes=DEFAULT_BUCKET_BYTES if self.bucket_bytes is None else self.bucket_bytes,
            collective_timeout_s=self.collective_timeout_s,
            state_precision=self.state_precision, defer_updates=self.defer_updates,
            delayed_update=self.delayed_update, delayed_update_after=self.delayed_update_after,
        )  # fmt: skip

    @property
    def activation_bytes(self) -> int:
        """Host bytes reserved for activation offload: its transfers' staging and the activations it keeps in host
        memory (0 without ``offload_activations``)."""
        return self.activation_staging_bytes + self.activation_host_bytes

    @property
    def activation_staging_bytes(self) -> int:
        """Host bytes for activation transfers in flight (0 without ``offload_activations``)."""
        if not self.offload_activations:
            return 0
        return self.activation_memory_bytes if self.activation_memory_bytes is not None else self.cpu_memory_bytes // 8

    @property
    def stash_bytes(self) -> int:
        """Host bytes reserved for the vertical schedule's stash: its staging and the block inputs it keeps in host
        memory (0 without ``stash_host_bytes``)."""
        return 0 if self.stash_host_bytes is None else self.stash_host_bytes + self.stash_staging

    @property
    def stash_staging(self) -> int:
        """Host bytes staging the stash's transfers (``stash_staging_bytes`` or its default; 0 without a stash)."""
        if self.stash_host_bytes is None:
            return 0
        if self.stash_staging_bytes is not None:
            return self.stash_staging_bytes
        return max(_MiB, min(self.device_memory_bytes, self.cpu_memory_bytes) // 8)


class OffloadSession:
    """What :func:`initialize` set up: the store, the budgets, the host slab, the streamer, the optimizer.

    Reachable as ``optimizer.session``. :meth:`close` (or the optimizer's
    ``close()``) removes the hooks and the swap files and gives back the host
    slab (``slab``: ``cpu_memory_bytes``, carved between the engines' transfer
    engines, ``transfers``).
    """

    def __init__(self, config, store, memory, resources, streamer, optimizer, activations, stash=None):
        self.config = config
        self.store = store
        self.memory = memory
        self.slab: HostSlab = resources.slab
        self.transfers: dict[str, TransferEngine] = resources.engines
        self._resources = resources
        self.streamer = streamer
        self.optimizer = optimizer
        self._activations = activations
        self._stash = stash
        self._stash_counted = (0, 0)  # the stash's NVMe bytes read and written at the last reset_stats()
        self._handles = []  # the model's forward hooks installed by initialize()
        self.closed = False

    def memory_stats(self) -> dict[str, TierStats]:
        """Used, peak and limit bytes of the device and host tiers, plus the bytes on NVMe (as ``nvme``); on
        CUDA the device tier also has what torch's caching allocator reserves (``reserved_bytes``, and its
        peak), which the budget bounds up to activations, workspaces and the allocator's rounding."""
        stats = self.memory.stats()
        used = self.store.used_bytes
        stats["nvme"] = TierStats(used, used, self.store.capacity_bytes)
        return stats

    def io_bytes(self) -> tuple[int, int]:
        """Bytes read and written on NVMe by the streamer, the optimizer and the stash since the last
        :meth:`reset_stats`."""
        opt, streamed = self.optimizer.memory_stats(), self.streamer.stats()
        stash_read, stash_written = (now - then for now, then in zip(self._stash_nvme_bytes(), self._stash_counted))
        return (streamed.bytes_read + opt.read_bytes + stash_read,
                streamed.bytes_written + opt.written_bytes + stash_written)  # fmt: skip

    def _stash_nvme_bytes(self) -> tuple[int, int]:
        """Bytes the stash has read from and written to NVMe since it opened (not those kept in host memory)."""
        if self._stash is None:
            return 0, 0
        stats = self._stash.stats()
        return stats.bytes_read - stats.host_bytes_read, stats.bytes_written - stats.host_bytes_written

    def reset_stats(self) -> None:
        """Restart the peaks and I/O counters (call at the start of a step)."""
        self._stash_counted = self._stash_nvme_bytes()
        self.memory.reset_peaks()
        self.optimizer.reset_io_stats()
        self.streamer.reset_stats()

    @property
    def activation_offload(self):
        """The :class:`~nvoffload.activations.offload_activations` context the model's forward runs in
        (``offload_activations=True``), None without: enter it around a forward that does not go through the
        model's ``__call__``."""
        return self._activations

    @property
    def stash(self):
        """The vertical schedule's stash (``stash_host_bytes``), None without: an
        :class:`~nvoffload.activations.offload_activations` context that :func:`~nvoffload.vertical_step` enters
        around each streamed block's call for one micro-batch, so that what the call keeps for backward (the block's
        input) moves off the device: into host memory up to ``stash_host_bytes``, to NVMe beyond, read back ahead
        in backward order. Its ``stats()`` count the bytes (``bytes_written - host_bytes_written`` went to NVMe)."""
        return self._stash

    def settle(self) -> None:
        """What the model's forward pre-hook does before each forward (call it before a forward that does not
        go through the model's ``__call__``): the forward sees every update its previous backward queued
        (normally ``step()`` already waited; updates deferred by ``step()`` are waited for block by block, as
        each block is copied to the device; the gradients an earlier micro-batch keeps go on being written
        while the next one computes); after a backward that raised, its step is undone (the next one starts
        from the last ``step()``'s weights); parameters unfrozen since the last forward train from this one on."""
        opt = self.optimizer
        if self.streamer.passes.failed:
            opt.abandon_step()
        elif opt.updates_queued:
            opt.synchronize()
        opt.check_trainer()
        self.streamer.follow_requires_grad()
        opt.follow_requires_grad()

    def save_checkpoint(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
        """Write the model's weights to a safetensors file, one tensor at a time: see
        :meth:`StreamedWeights.save_checkpoint <nvoffload.streaming._weights.StreamedWeights.save_checkpoint>` (``streamer.weights``)."""
        self.streamer.weights.save_checkpoint(path, metadata)

    def save_pretrained(
        self, save_directory: str | os.PathLike, *, max_shard_bytes: int | None = None,
        extra: Callable[[str], object] | None = None, merged: bool = False,
    ) -> list[str]:  # fmt: skip
        """Write the model as a Hugging Face directory (sharded safetensors, index, ``config.json``), one tensor
        in memory at a time, atomically: see :func:`nvoffload.pretrained.save_pretrained` (``max_shard_bytes``
        None: its default, 50 GB; ``extra``: called with the new directory to add files, e.g. a tokenizer's
        ``save_pretrained``). A PEFT model writes its adapter as PEFT does, or with ``merged`` its base model with
        the adapter merged. Call it after ``optimizer.step()``, not while updates are in flight."""
        from nvoffload.pretrained import DEFAULT_MAX_SHARD_BYTES, save_pretrained

        return save_pretrained(
            self.streamer.model, save_directory, read=self.streamer.weights.current, extra=extra, merged=merged,
            max_shard_bytes=DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes,
        )  # fmt: skip

    def close(self) -> None:
        if self.closed:
            return
        if self.config.trace_path is not None:
            trace.stop(self.config.trace_path)
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            self.optimizer.close()  # first: the updates it lands write the streamer's weights
        finally:
            for hooks in (self._activations, self._stash):
                if hooks is not None:
                    hooks.close()
            self.streamer.close()
            self._resources.close()
            self.store.close()


def _check_free_space(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: OffloadConfig, resident_state_bytes: int
) -> None:  # fmt: skip
    """Raise ``OSError(ENOSPC)`` before anything is written when the swap directories cannot hold the model's
    weights and two generations of the optimizer state in its ``state_precision`` that ``resident_state_bytes``
    of host memory do not keep (with the kept gradients): activations come on top."""
    update = for_optimizer(optimizer)
    layout = Layout(
        adam=update.adam, elementwise=update.elementwise, param_groups=optimizer.param_groups, prefix="",
        kept_grads=config.optimizer_config(1).keeps_grads, state_precision=config.state_precision,
    )  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state, kept = layout.store_state_bytes(resident_state_bytes), layout.kept_grad_bytes()
    swap_directories(
        config.swap_dirs, needed_bytes=weights + 2 * state + kept,
        what=f"the weights ({weights} bytes) and the optimizer state (two generations of {state} bytes, and {kept} of gradients)",
    )  # fmt: skip


_SESSION_ATTR = "_nvoffload_session"  # on the model: a weak reference to the session streaming it


class _Transfers:
    """The session's host slab, compute device and one transfer engine per engine, each over its carve of the slab."""

    def __init__(self, host_bytes: int, device: torch.device):
        self.slab = HostSlab(host_bytes, "nvoffload's host memory (cpu_memory_bytes)")
        self.device = compute_device(device)
        self.engines: dict[str, TransferEngine] = {}
        self.reserved: list[HostSlab] = []  # carves that only hold room (the gloo gradient buckets')

    def engine(self, name: str, nbytes: int | None, what: str) -> TransferEngine:
        """A transfer engine over ``nbytes`` carved from the slab (all of what is left when ``nbytes`` is None:
        the slab counts that carve by the buffers it hands out, see :meth:`HostSlab.carve`)."""
        elastic = nbytes is None
        if nbytes is None:
            nbytes = self.slab.available_bytes
            if nbytes < ALIGNMENT_BYTES:
                shares = ", ".join(f"{n} {e.slab.capacity_bytes}" for n, e in self.engines.items())
                raise MemoryBudgetError(
                    f"cpu_memory_bytes ({self.slab.capacity_bytes}) leaves nothing for {what} after the other "
                    f"engines' shares ({shares}): raise it, or lower optimizer_memory_fraction or activation_memory_bytes"
                )
        carve = self.slab.carve(nbytes, what, by_buffers=elastic)
        self.engines[name] = TransferEngine(carve, self.device, what=what)
        return self.engines[name]

    def close(self) -> None:
        """Close the engines and give their carves back, then the device and the slab."""
        for engine in self.engines.values():
            engine.close()
            engine.slab.close()
        self.engines = {}
        for carve in self.reserved:
            carve.close()
        self.reserved = []
        self.device.close()
        self.slab.close()


def _resident_state_bytes(model: nn.Module, blocks: list[nn.Module], config: OffloadConfig, optimizer_bytes: int,
                          host_left_bytes: int) -> int:
    """Host bytes for the optimizer's resident state: what the share left for parameter blocks (``host_left_bytes``,
    what the host slab has left before the optimizer's, activation offload's and the stash's carves, less those) holds beyond
    caching every block (:func:`~nvoffload.memory.resident_state_share`, the planner's rule)."""
    pages = [-(-n // ALIGNMENT_BYTES) * ALIGNMENT_BYTES for n in (optimizer_bytes, config.activation_bytes, config.stash_bytes)]
    stream_host = host_left_bytes - sum(pages)
    return resident_state_share(stream_host, [b.nbytes for b in partition(model, blocks)[0]], config.prefetch_blocks,
                                delayed_update=config.delayed_update)


def _bucket_bytes(model: nn.Module, blocks: list[nn.Module], config: OffloadConfig, ranks: Ranks) -> int:
    """The gradient buckets' size over several ranks, the same on every one (the buckets must fill alike).

    A released gradient waits in its open bucket, counted in the device tier, until the bucket fills (or
    backward ends), while backward holds the next block with room for its gradients: a bucket the device budget
    cannot hold beside them waits for device memory that only its own all-reduce would free (issue 54).
    ``bucket_bytes`` unset is ``DEFAULT_BUCKET_BYTES`` or the largest that fits (the smallest over the ranks);
    set, one that does not fit is refused before the first step, naming what does. Where the reduced buckets are
    device memory too (NCCL: two in flight, :func:`~nvoffload.distributed.buckets_budget`), they count."""
    error, fits = None, 0
    try:
        fits = _bucket_bytes_that_fit(model, blocks, config, ranks.device.type != "cpu")
    except MemoryBudgetError as exc:
        error = exc
    ranks.agree(error, "checking the gradient buckets against device_memory_bytes")
    return ranks.min(fits, "the gradient buckets' size")


def _bucket_bytes_that_fit(model: nn.Module, blocks: list[nn.Module], config: OffloadConfig, on_device: bool) -> int:
    """This rank's bucket size (see :func:`_bucket_bytes`); MemoryBudgetError naming the flags when none fits."""
    streamed, resident = partition(model, blocks)
    if not streamed or config.device_memory_bytes < device_bytes_needed(streamed, resident, config.delayed_update):
        return DEFAULT_BUCKET_BYTES  # the streamer refuses the budget, naming the smallest that works
    params = list(model.parameters())
    fixed = resident_bytes(resident) + resident_bytes(resident, grads=True)
    # backward holds each block with room for its gradients, beside the gradients of the blocks after it still in
    # the open bucket (at most a bucket of them), and the reduced buckets where they are device memory
    later = itertools.accumulate([b.grad_bytes for b in reversed(streamed)], initial=0)
    holds = [(b.nbytes + b.grad_bytes, after) for b, after in zip(reversed(streamed), later)]

    def shortfall(bucket: int) -> int:
        on_the_side = buckets_budget(params, bucket) if on_device else 0
        need = max(fixed + hold + min(bucket, after) + on_the_side for hold, after in holds)
        return need - config.device_memory_bytes

    largest = _largest(lambda bucket: shortfall(bucket) <= 0, DEFAULT_BUCKET_BYTES)
    asked = config.bucket_bytes if config.bucket_bytes is not None else max(largest, 1)
    if shortfall(asked) > 0:
        lower = f"lower bucket_bytes to at most {largest} or " if largest else ""
        reduced = ", and two reduced buckets are in flight there" if on_device else ""
        raise MemoryBudgetError(
            f"device_memory_bytes={config.device_memory_bytes} is {shortfall(asked)} bytes short of the streamed"
            f" blocks' backward beside the gradient buckets between the ranks (bucket_bytes={asked}: the released"
            f" gradients wait on the device in the open bucket until it fills{reduced}):"
            f" {lower}raise device_memory_bytes to at least {config.device_memory_bytes + shortfall(asked)}"
        )
    return asked


def _largest(fits: Callable[[int], bool], most: int) -> int:
    """The largest ``n`` in ``[1, most]`` with ``fits(n)`` (``fits`` true up to some ``n``, false above); 0 if none."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _pages(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def _host_budget_that_fits(config: OffloadConfig, shortfall_bytes: int) -> str:
    """The ``cpu_memory_bytes`` (rounded up to MiB) whose parameter-streaming share, what is left after the
    optimizer's fraction and activation offload's bytes, is ``shortfall_bytes`` larger."""
    grown = config.cpu_memory_bytes + math.ceil(shortfall_bytes / (1 - config.optimizer_memory_fraction))
    smallest = -(-(grown + 4 * ALIGNMENT_BYTES) // _MiB) * _MiB  # the slab and each carve round to 4 KiB
    activations = f" and activation offload's {config.activation_bytes} bytes" if config.activation_bytes else ""
    activations += f" and the stash's {config.stash_bytes} bytes" if config.stash_host_bytes is not None else ""
    return (
        f"cpu_memory_bytes must be at least {smallest} ({smallest // _MiB} MiB): parameter streaming gets what is"
        f" left after the optimizer's share (optimizer_memory_fraction={config.optimizer_memory_fraction:g}){activations}"
    )


@dataclass(frozen=True)
class _HostBudgets:
    """What :func:`_carve_host_slab` gave the optimizer, bytes."""

    optimizer_bytes: int  # its staging: cpu_memory_bytes * optimizer_memory_fraction
    resident_state_bytes: int  # its state kept resident in host memory, carved beside the staging
    bucket_bytes: int  # the gradient buckets' between the ranks (the default with one)


def _check_arguments(model: nn.Module, optimizer: torch.optim.Optimizer, config: OffloadConfig) -> None:
    """Refuse what :func:`initialize` cannot stream: a config of another type, an optimizer with state, a model
    wrapped in ``DistributedDataParallel`` or streamed by a session still open."""
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an nvoffload.OffloadConfig, got {type(config).__name__}")
    if optimizer.state:
        raise ValueError("initialize() needs an optimizer without state; load its state afterwards")
    check_not_ddp(model)
    previous = getattr(model, _SESSION_ATTR, lambda: None)()
    if previous is not None and not previous.closed:
        raise ValueError(
            f"this {type(model).__name__} is already streamed by an nvoffload session: close that one first"
            " (optimizer.close()), or build the model again"
        )


def _carve_host_slab(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: OffloadConfig, blocks: list[nn.Module],
    ranks: Ranks | None, memory: MemoryManager, resources: _Transfers,
) -> _HostBudgets:  # fmt: skip
    """Carve ``resources``' host slab between the engines' transfer engines: the optimizer's staging and resident
    state, activation offload's bytes, and the rest for parameter streaming (over several ranks, the gradient
    buckets reserved in it); first check that the swap directories hold what the store will write."""
    optimizer_bytes = int(config.cpu_memory_bytes * config.optimizer_memory_fraction)
    # with gloo the reduced gradients (two buckets in flight at most) are host memory, carved from the
    # streamer's share below, as the host tier counted them before the slab was the one accounting
    gloo = ranks is not None and ranks.device.type == "cpu"
    bucket_bytes = DEFAULT_BUCKET_BYTES if ranks is None else _bucket_bytes(model, blocks, config, ranks)
    bucket_pages = _pages(buckets_budget(list(model.parameters()), bucket_bytes)) if gloo else 0
    resident_state = _resident_state_bytes(
        model, blocks, config, optimizer_bytes, resources.slab.available_bytes - bucket_pages
    )  # fmt: skip
    _check_free_space(model, optimizer, config, resident_state)  # nothing is written before the store
    resources.engine("optimizer", optimizer_bytes + resident_state, "the optimizer's host memory")
    if config.activation_bytes:
        resources.engine("activations", config.activation_bytes, "activation offload's host memory")
    if config.stash_host_bytes is not None:
        resources.engine("stash", config.stash_bytes, "the vertical schedule's stash")
    streamer_transfer = resources.engine("streamer", None, "parameter streaming's host memory")
    if ranks is not None:
        buckets = reserve_buckets(
            memory, ranks, list(model.parameters()), bucket_bytes, host_slab=streamer_transfer.slab
        )  # fmt: skip
        resources.reserved += [buckets] if buckets is not None else []
    return _HostBudgets(optimizer_bytes=optimizer_bytes, resident_state_bytes=resident_state, bucket_bytes=bucket_bytes)


def _offload_optimizer(
    optimizer: torch.optim.Optimizer, streamer: ParameterStreamer, store: TensorStore, config: OffloadConfig,
    budgets: _HostBudgets, transfer: TransferEngine, process_group,
) -> OffloadOptimizer:  # fmt: skip
    """The offloaded optimizer over the streamer's parameters, its state in ``store``, staged through ``transfer``."""
    for group in optimizer.param_groups:  # parameters built on the meta device were replaced
        group["params"] = [streamer.replaced.get(p, p) for p in group["params"]]
    optimizer_config = dataclasses.replace(
        config.optimizer_config(budgets.optimizer_bytes, budgets.resident_state_bytes), bucket_bytes=budgets.bucket_bytes
    )  # fmt: skip
    return OffloadOptimizer(
        optimizer, swap_dir=store, transfer=transfer, config=optimizer_config, process_group=process_group,
    )  # fmt: skip


def _open_session(
    model: nn.Module, config: OffloadConfig, store: TensorStore, memory: MemoryManager, resources: _Transfers,
    streamer: ParameterStreamer, offloaded: OffloadOptimizer,
) -> OffloadSession:  # fmt: skip
    """Wire the engines into a session: the optimizer writes the streamer's weights, activation offload (with
    ``offload_activations``) and the settling of queued updates run around each of the model's forwards, and the
    optimizer and the model reach the session."""
    offloaded.set_weight_home(streamer.weights)
    activations = stash = None
    if config.stash_host_bytes is not None:  # the block inputs alone, written as saved (none kept recent), any size
        half = config.stash_staging // 2
        stash = _offload_activations(
            store, min_bytes=0, keep_recent_bytes=0, max_pending_write_bytes=half, prefetch_bytes=half,
            retain_host_memory=config.retain_host_memory, host_resident_bytes=config.stash_host_bytes,
            transfer=resources.engines["stash"],
        )  # fmt: skip
    if config.offload_activations:
        half = config.activation_staging_bytes // 2
        activations = _offload_activations(
            store, max_pending_write_bytes=half, prefetch_bytes=half, keep_recent_bytes=config.activation_staging_bytes // 3,
            retain_host_memory=config.retain_host_memory, host_resident_bytes=config.activation_host_bytes,
            transfer=resources.engines["activations"],
        )  # fmt: skip
    session = OffloadSession(config, store, memory, resources, streamer, offloaded, activations, stash)
    optimizer_ref = weakref.ref(offloaded)

    def settle(module, args) -> None:
        opt = optimizer_ref()
        if opt is not None and opt.session is not None:
            opt.session.settle()

    session._handles.append(model.register_forward_pre_hook(settle))
    if activations is not None:

        def enter(module, args) -> None:
            activations.__enter__()

        def leave(module, args, output) -> None:
            activations.__exit__(None, None, None)

        session._handles += [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    offloaded.session = session
    setattr(model, _SESSION_ATTR, weakref.ref(session))
    return session


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: OffloadConfig,
    *,
    blocks: Sequence[nn.Module] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    checkpoint=None,
    process_group=None,
) -> tuple[nn.Module, OffloadOptimizer]:
    """Stream ``model``'s parameters and ``optimizer``'s state through the three tiers.

    Args:
        model: the model, on the device or on the meta device (then filled from
            ``checkpoint``, or by ``param_init_fn`` / ``reset_parameters()``, one
            block at a time, straight into the store: a model larger than RAM
            never is in memory at once).
        optimizer: a torch optimizer over ``model.parameters()`` (Adam/AdamW run
            on the fused kernel), with no state yet.
        config: the budgets; see :class:`OffloadConfig`.
        blocks: the modules to stream (default: the model's largest ``ModuleList``).
        param_init_fn, checkpoint: see :class:`~nvoffload.streaming.ParameterStreamer`.
        process_group: the ranks to train with (default: ``torch.distributed``'s default group when it is
            initialized with more than one rank): each rank streams the model from its own ``swap_dirs``
            and keeps its share of the optimizer state (see :mod:`nvoffload.distributed`). The model must
            not be wrapped in ``DistributedDataParallel``.

    Returns:
        ``(model, optimizer)``: the same model with hooks installed, and an
        :class:`~nvoffload.optim.OffloadOptimizer` whose ``session`` is an
        :class:`OffloadSession`. Gradients are consumed during backward (the
        update of each parameter runs as soon as its gradient is final and the
        gradient is freed), so ``param.grad`` is None after ``backward()``:
        clipping, accumulation and fp16 loss scaling are ``config``'s
        (``max_grad_norm``, ``gradient_accumulation_steps``, ``loss_scaling``;
        ``optimizer.grad_norm()`` gives the norm ``clip_grad_norm_`` would).

    Every copy between NVMe, host memory and the device goes through a
    :class:`~nvoffload.transfer.TransferEngine`: one for the optimizer (over
    ``cpu_memory_bytes * optimizer_memory_fraction``), one for activation
    offload (over ``activation_bytes``) and one for parameter streaming (the
    rest), each over its carve of one host slab of ``cpu_memory_bytes``,
    sharing the device's copy streams.

    Raises:
        MemoryBudgetError: budgets smaller than the model needs (the smallest
            that works is named).
    """
    _check_arguments(model, optimizer, config)
    if config.trace_path is not None:
        trace.start()  # before anything moves: the materialization is traced too
    if not config.retain_host_memory:
        release_freed_host_memory()
    device = concrete(config.device) if config.device is not None else compute_device_of(model)
    memory = MemoryManager(
        device_memory_bytes=config.device_memory_bytes, cpu_memory_bytes=config.cpu_memory_bytes, device=device
    )
    ranks = Ranks.resolve(process_group)
    blocks = list(blocks) if blocks is not None else find_blocks(model)
    resources = _Transfers(config.cpu_memory_bytes, device)
    memory.use_host_slab(resources.slab)  # the host tier is the slab's accounting: every host byte is a carve's
    store = streamer = None
    try:
        budgets = _carve_host_slab(model, optimizer, config, blocks, ranks, memory, resources)
        store = TensorStore(list(config.swap_dirs), checksum=config.checksum)
        streamer = ParameterStreamer(
            model, store, memory, device=device, blocks=blocks, prefetch_blocks=config.prefetch_blocks,
            param_init_fn=param_init_fn, checkpoint=checkpoint, transfer=resources.engines["streamer"],
            delayed_update=config.delayed_update,
        )  # fmt: skip
        offloaded = _offload_optimizer(
            optimizer, streamer, store, config, budgets, resources.engines["optimizer"], process_group
        )  # fmt: skip
    except BaseException as exc:
        if streamer is not None:
            streamer.close()
        resources.close()
        if store is not None:
            store.close()
        if config.trace_path is not None:
            trace.stop()
        if isinstance(exc, MemoryBudgetError) and exc.host_shortfall_bytes:
            raise MemoryBudgetError(f"{exc}. {_host_budget_that_fits(config, exc.host_shortfall_bytes)}") from None
        raise
    _open_session(model, config, store, memory, resources, streamer, offloaded)
    return model, offloaded
