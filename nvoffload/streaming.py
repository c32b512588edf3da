"""Parameter streaming: each block's weights live on NVMe, on the device only while the block runs.

:class:`ParameterStreamer` splits a model into *blocks* (the entries of its
``ModuleList`` of layers) and keeps each block's parameters as one flat tensor
in a :class:`~nvoffload.io.TensorStore`, cached in host memory as the
:class:`~nvoffload.memory.MemoryManager`'s host budget allows (least recently
used first out; a block whose weights the optimizer changed is written back
before it leaves). Module hooks, never a replaced ``forward``:

- forward pre-hook: bring the block's weights to the device, start reading the
  next blocks into host memory;
- forward hook: free the block's device memory;
- backward pre-hook: bring the weights back (autograd saved the parameters
  themselves, whose storage is refilled in place), read the previous blocks ahead;
- after the last gradient of the block is accumulated: free it again.

A parameter keeps its identity, shape and dtype throughout; only its storage
is resized to zero bytes while the block is off the device, so optimizers,
autograd and checkpoint code keep working. Parameters outside every block
(embeddings, final norm, head) stay on the device, counted in the device
budget. The optimizer reads and writes streamed weights through the
streamer (it is a :class:`~nvoffload.optim.WeightHome`), so the next forward
sees the updated weights.

``model.state_dict()`` gathers full tensors from the store one block at a time,
and ``model.load_state_dict()`` scatters them back the same way.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from nvoffload import device as _device
from nvoffload.checkpoint import SafetensorsWriter
from nvoffload.io import TensorStore, aligned_empty
from nvoffload.memory import MemoryBudgetError, MemoryManager

__all__ = ["ParameterStreamer", "find_blocks", "state_tensors"]

_GRAD_WAIT_LIMIT_S = 600.0  # longest wait for the optimizer to free device memory held by gradients


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's layers: the entries of its largest ``nn.ModuleList`` with parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(True for _ in m.parameters())]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of layers to stream; pass blocks= explicitly"
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What ``module.state_dict()`` holds, without reading it: parameters (every name of a
    tied one) and persistent buffers, by state-dict key."""
    tensors = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for key, p in m._parameters.items():
            if p is not None:
                tensors[dot + key] = p
        for key, b in m._buffers.items():
            if b is not None and key not in m._non_persistent_buffers_set:
                tensors[dot + key] = b
    return tensors


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s storage with its own version counter (writes do not bump autograd's)."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


class _Block:
    """One streamed block: its parameters' place in one flat tensor, and where that tensor is now."""

    def __init__(self, index: int, pos: int, module: nn.Module, params: list[tuple[str, nn.Parameter]]):
        self.index = index
        self.pos = pos  # place among the streamed blocks (forward order)
        self.module = module
        self.name = f"stream.block{index}"
        self.params = [p for _, p in params]
        self.param_names = [n for n, _ in params]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"block {index} mixes parameter dtypes {sorted(map(str, dtypes))}; cast the model first")
        self.dtype = self.params[0].dtype
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.nbytes = total * self.params[0].element_size()
        self.host: torch.Tensor | None = None  # cached weights (flat)
        self.loading = None  # IOFuture of a read into ``host``
        self.dirty = False  # host copy newer than the store
        self.pins = 0  # optimizer users of ``host``
        self.on_device = False
        self.in_use = 0  # forward/backward passes running in the block
        self.grads_pending = 0  # trainable parameters whose gradient is not accumulated yet
        self.trainable = [p for p in self.params if p.requires_grad]

    def view(self, flat: torch.Tensor, param_index: int) -> torch.Tensor:
        start = self.offsets[param_index]
        return flat[start : start + self.params[param_index].numel()]


class ParameterStreamer:
    """Streams the parameters of a model's blocks between NVMe, host memory and the device.

    Args:
        model: the model; its parameters may be on the device or on the meta
            device (then ``param_init_fn`` or ``checkpoint`` fills them, one
            block at a time, straight into the store).
        store: the tensor store that holds the blocks' weights.
        memory: the budgets; raises :class:`~nvoffload.memory.MemoryBudgetError`
            at construction when they cannot hold the resident parameters plus
            ``2 + prefetch_blocks`` of the largest block (with its gradients).
        device: the compute device (default: where the parameters are; the CPU
            for a model on the meta device without CUDA).
        blocks: the modules to stream (default: :func:`find_blocks`).
        prefetch_blocks: blocks read ahead into host memory.
        param_init_fn: called on each module of a meta model to initialize its
            parameters once they have memory (default: ``reset_parameters()``).
        checkpoint: a reader with ``keys()``, ``info(name)`` and ``read(name, out=)``
            (:func:`nvoffload.checkpoint.open_checkpoint`) to fill a model built on
            the meta device from, one tensor at a time. Its tensors must match the
            model's parameters and persistent buffers by name (one name of a tied
            parameter is enough) and shape; other dtypes are converted. A missing
            or unexpected tensor raises ``KeyError`` before anything is read.
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
    ):
        if not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be an int >= 0, got {prefetch_blocks!r}")
        self.model = model
        self.store = store
        self.memory = memory
        self.prefetch_blocks = prefetch_blocks
        self._param_init_fn = param_init_fn
        self._checkpoint = checkpoint
        self.device = torch.device(device) if device is not None else self._infer_device(model)
        self._lock = threading.RLock()
        self._lru: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # host-cached blocks
        self._handles = []
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_wait_s = 0.0  # time forward and backward waited for blocks to arrive
        self.grad_wait_s = 0.0  # time backward waited for the optimizer to take gradients (device memory)

        names = {p: n for n, p in model.named_parameters()}
        module_list = list(blocks) if blocks is not None else find_blocks(model)
        self._blocks: list[_Block] = []
        self._by_param: dict[nn.Parameter, tuple[_Block, int]] = {}
        seen: set[nn.Parameter] = set()
        for i, module in enumerate(module_list):
            params = [(names[p], p) for p in module.parameters() if p not in seen]
            seen.update(p for _, p in params)
            if not params:
                continue
            self._blocks.append(_Block(i, len(self._blocks), module, params))
        self._resident = [(n, p) for n, p in model.named_parameters() if p not in seen]
        self._check_budgets()
        self._sources = self._plan_checkpoint() if checkpoint is not None else {}
        self._materialize()
        self._install_hooks()

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _infer_device(model: nn.Module) -> torch.device:
        devices = {p.device for p in model.parameters()} - {torch.device("meta")}
        if len(devices) > 1:
            raise ValueError(f"the model's parameters are on several devices: {sorted(map(str, devices))}")
        if devices:
            return devices.pop()
        return torch.device("cuda") if _device.cuda_available() else torch.device("cpu")

    def _resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self._resident)

    def _check_budgets(self) -> None:
        if not self._blocks:
            raise ValueError("the model has no parameters in its blocks: nothing to stream")
        largest = max(b.nbytes for b in self._blocks)
        trainable = sum(p.numel() * p.element_size() for _, p in self._resident if p.requires_grad)
        # resident weights and their gradients; one block computing, one arriving, its gradients
        device_needed = self._resident_bytes() + trainable + 3 * largest
        host_needed = (2 + self.prefetch_blocks) * largest
        problems = []
        if self.memory.limit_bytes("device") < device_needed:
            problems.append(
                f"device_memory_bytes must be at least {device_needed} (resident parameters and their gradients: "
                f"{self._resident_bytes() + trainable}, plus 3 x the largest block's {largest})"
            )
        if self.memory.available_bytes("host") < host_needed:
            problems.append(
                f"the host budget has {self.memory.available_bytes('host')} bytes left for parameter blocks; "
                f"streaming needs at least {host_needed} ({2 + self.prefetch_blocks} x the largest block's {largest})"
            )
        if problems:
            raise MemoryBudgetError("budgets too small for parameter streaming: " + "; ".join(problems))

    def _materialize(self) -> None:
        """Give resident parameters memory, and write every block to the store, one block at a time.

        Parameters on the meta device are replaced by new ``nn.Parameter`` objects
        on the device (in every module that holds them, so ties survive);
        :attr:`replaced` maps the old objects to the new ones.
        """
        self.replaced: dict[nn.Parameter, nn.Parameter] = {}
        owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for module in self.model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(p, []).append((module, key))
        self.memory.allocate("device", self._resident_bytes(), "parameters outside the streamed blocks")
        for i, (name, p) in enumerate(self._resident):
            if p.is_meta:
                p = self._replace_meta(p, owners)
                self._resident[i] = (name, p)
                self._fill(p, [m for m, _ in owners[p]])
            elif p.device != self.device:
                raise ValueError(f"parameter {name} is on {p.device}, the streamer's device is {self.device}")
        for block in self._blocks:
            meta = [j for j, p in enumerate(block.params) if p.is_meta]
            for j in meta:
                block.params[j] = self._replace_meta(block.params[j], owners)
            if meta:
                self._init_block(block)
            host = self._host_buffer(block)
            for j, p in enumerate(block.params):
                block.view(host, j).copy_(p.detach().reshape(-1))
                if p.device != self.device:
                    p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                p.untyped_storage().resize_(0)
            self._write_back(block, host)
            self._free_host_buffer(block, host)
            block.trainable = [p for p in block.params if p.requires_grad]
            self._by_param.update({p: (block, j) for j, p in enumerate(block.params)})
        self._materialize_buffers()

    def _replace_meta(self, old: nn.Parameter, owners) -> nn.Parameter:
        new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=self.device), requires_grad=old.requires_grad)
        for module, key in owners[old]:
            module._parameters[key] = new
        owners[new] = owners[old]
        self.replaced[old] = new
        if old in self._sources:
            self._sources[new] = self._sources.pop(old)
        return new

    def _fill(self, p: nn.Parameter, modules: list[nn.Module]) -> None:
        if self._checkpoint is not None:
            self._read_checkpoint(p, p.data)
        else:
            for m in modules:
                self._call_init(m)

    def _init_block(self, block: _Block) -> None:
        if self._checkpoint is not None:
            for p in block.params:
                self._read_checkpoint(p, p.data)
            return
        for m in block.module.modules():
            self._call_init(m)

    def _call_init(self, module: nn.Module) -> None:
        with torch.no_grad():
            if self._param_init_fn is not None:
                self._param_init_fn(module)
            elif hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
                module.reset_parameters()

    def _plan_checkpoint(self) -> dict[torch.Tensor, str]:
        """The checkpoint tensor to read for each parameter and buffer, checked before anything is read."""
        ckpt = self._checkpoint
        aliases: dict[torch.Tensor, list[str]] = {}
        for name, t in state_tensors(self.model).items():
            aliases.setdefault(t, []).append(name)
        sources, missing = {}, []
        for t, names in aliases.items():
            if not t.is_meta:
                if isinstance(t, nn.Parameter):
                    raise ValueError(
                        f"checkpoint= fills a model built on the meta device, but {names[0]} is on {t.device}: "
                        "build the model under `with torch.device('meta'):` or call load_state_dict() instead"
                    )
                continue  # a buffer the model computed itself
            found = next((n for n in names if n in ckpt), None)
            if found is None:
                missing.append(names[0])
                continue
            shape = tuple(ckpt.info(found).shape)
            if shape != tuple(t.shape):
                raise ValueError(f"checkpoint tensor {found!r} has shape {shape}, the model's has {tuple(t.shape)}")
            sources[t] = found
        known = {n for names in aliases.values() for n in names}
        unexpected = [n for n in ckpt.keys() if n not in known]
        if missing or unexpected:
            raise KeyError(
                "the checkpoint does not match the model: "
                + "; ".join(
                    f"{what} {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
                    for what, names in (("missing", missing), ("unexpected", unexpected))
                    if names
                )
            )
        return sources

    def _read_checkpoint(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        name = self._sources[tensor]
        stored = self._checkpoint.info(name).dtype
        if stored == out.dtype and out.device.type == "cpu":
            self._checkpoint.read(name, out=out)
        else:
            with torch.no_grad():
                out.copy_(self._checkpoint.read(name).view(out.shape))

    def _materialize_buffers(self) -> None:
        """Give buffers built on the meta device memory and their checkpoint values."""
        for module in self.model.modules():
            for key, b in module._buffers.items():
                if b is None or not b.is_meta:
                    continue
                if b not in self._sources:
                    raise ValueError(
                        f"buffer {key!r} of {type(module).__name__} is on the meta device and "
                        "no checkpoint holds it: build buffers on the device (they are not streamed)"
                    )
                new = torch.empty(b.shape, dtype=b.dtype, device=self.device)
                self._read_checkpoint(b, new)
                module._buffers[key] = new

    def _install_hooks(self) -> None:
        for block in self._blocks:
            m = block.module
            self._handles.append(m.register_forward_pre_hook(self._hook(self._before_forward, block)))
            self._handles.append(m.register_forward_hook(self._hook(self._after_forward, block)))
            self._handles.append(m.register_full_backward_pre_hook(self._hook(self._before_backward, block)))
            if not block.trainable:
                self._handles.append(m.register_full_backward_hook(self._hook(self._after_backward, block)))
            for p in block.trainable:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(self._grad_ready, block, p)))
        for _, p in self._resident:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(self._track_grad, p)))
        self._handles.append(self.model.register_state_dict_post_hook(_state_dict_hook(self)))
        for block in self._blocks:
            self._handles.append(block.module.register_load_state_dict_pre_hook(self._hook(self._before_load, block)))
            self._handles.append(block.module.register_load_state_dict_post_hook(self._hook(self._after_load, block)))

    def _hook(self, method, *bound):
        """A hook calling ``method(*bound)`` (whatever torch passes is not needed) without keeping self alive."""
        ref, func = weakref.ref(self), method.__func__

        def hook(*args):
            streamer = ref()
            if streamer is not None:
                func(streamer, *bound)

        return hook

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, block: _Block) -> None:
        self._to_device(block, headroom_bytes=0)
        block.in_use += 1
        self._prefetch(self._blocks[block.pos + 1 :])

    def _after_forward(self, block: _Block) -> None:
        block.in_use -= 1
        if block.in_use == 0:
            self._off_device(block)

    def _before_backward(self, block: _Block) -> None:
        # Room for the gradients this block makes (the first block: the resident parameters' too).
        grads = sum(p.numel() * p.element_size() for p in block.trainable)
        if block.pos == 0:
            grads += sum(p.numel() * p.element_size() for _, p in self._resident if p.requires_grad)
        self._to_device(block, headroom_bytes=grads)
        block.in_use += 1
        block.grads_pending = len(block.trainable)
        self._prefetch(self._blocks[block.pos - 1 :: -1] if block.pos else [])

    def _grad_ready(self, block: _Block, param: nn.Parameter) -> None:
        self._track_grad(param)
        block.grads_pending -= 1
        if block.grads_pending == 0:
            self._after_backward(block)

    def _after_backward(self, block: _Block) -> None:
        block.in_use = max(block.in_use - 1, 0)
        if block.in_use == 0:
            self._off_device(block)

    def _track_grad(self, param: torch.Tensor) -> None:
        """Count a gradient in the device tier until autograd and the optimizer let go of it."""
        grad = param.grad
        if grad is not None and not hasattr(grad, "_nvoffload_counted"):
            nbytes = grad.numel() * grad.element_size()
            self.memory.track("device", nbytes)
            grad._nvoffload_counted = True
            weakref.finalize(grad, self.memory.untrack, "device", nbytes)

    # ------------------------------------------------------------------ device tier
    def _to_device(self, block: _Block, headroom_bytes: int) -> None:
        if block.on_device:  # only the training thread moves blocks on and off the device
            return
        # Outside the lock: the optimizer's worker frees gradients (and needs the lock) meanwhile.
        start = time.perf_counter()
        self.memory.allocate(
            "device", block.nbytes, f"parameter block {block.index}", wait_s=_GRAD_WAIT_LIMIT_S, headroom_bytes=headroom_bytes
        )
        self.grad_wait_s += time.perf_counter() - start
        with self._lock:
            try:
                start = time.perf_counter()
                host = self._host(block)
                self.io_wait_s += time.perf_counter() - start
                for j, p in enumerate(block.params):
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                    _alias(p).copy_(block.view(host, j).view(p.shape))
            except BaseException:
                for p in block.params:
                    p.untyped_storage().resize_(0)
                self.memory.free("device", block.nbytes)
                raise
            block.on_device = True
            self._touch(block)

    def _off_device(self, block: _Block) -> None:
        with self._lock:
            if not block.on_device:
                return
            for p in block.params:
                p.untyped_storage().resize_(0)
            block.on_device = False
            self.memory.free("device", block.nbytes)

    # ------------------------------------------------------------------ host tier
    def _host_buffer(self, block: _Block) -> torch.Tensor:
        self._make_room(block.nbytes)
        self.memory.allocate("host", block.nbytes, f"host cache of parameter block {block.index}")
        if self.device.type == "cuda":
            return _device.host_empty(block.numel, block.dtype)
        return aligned_empty(block.nbytes).view(block.dtype)

    def _free_host_buffer(self, block: _Block, host: torch.Tensor) -> None:
        del host
        self.memory.free("host", block.nbytes)

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used host blocks (writing back changed ones) until ``nbytes`` fit."""
        for block in list(self._lru.values()):
            if self.memory.available_bytes("host") >= nbytes:
                return
            if block.pins:
                continue
            self._evict(block)
        if self.memory.available_bytes("host") < nbytes:
            raise MemoryBudgetError(
                f"{nbytes} bytes of host memory are needed for a parameter block, but "
                f"{self.memory.available_bytes('host')} are left and every cached block is in use"
            )

    def _evict(self, block: _Block) -> None:
        self._settle(block)
        if block.dirty:
            self._write_back(block, block.host)
            block.dirty = False
        host, block.host = block.host, None
        del self._lru[block.index]
        self._free_host_buffer(block, host)

    def _write_back(self, block: _Block, host: torch.Tensor) -> None:
        self.store.put(block.name, host).result()
        self.bytes_written += block.nbytes

    def _start_load(self, block: _Block) -> None:
        block.host = self._host_buffer(block)
        block.loading = self.store.get(block.name, out=block.host)
        self.bytes_read += block.nbytes
        self._lru[block.index] = block

    def _settle(self, block: _Block) -> None:
        if block.loading is not None:
            loading, block.loading = block.loading, None
            loading.result()

    def _host(self, block: _Block) -> torch.Tensor:
        """The block's weights in host memory (read from the store when not cached); caller holds the lock."""
        if block.host is None:
            self._start_load(block)
        try:
            self._settle(block)
        except BaseException:
            self._drop_failed_load(block)
            raise
        self._touch(block)
        return block.host

    def _drop_failed_load(self, block: _Block) -> None:
        host, block.host = block.host, None
        self._lru.pop(block.index, None)
        self._free_host_buffer(block, host)

    def _touch(self, block: _Block) -> None:
        if block.index in self._lru:
            self._lru.move_to_end(block.index)

    def _prefetch(self, upcoming: list[_Block]) -> None:
        with self._lock:
            for block in upcoming[: self.prefetch_blocks]:
                if block.host is None:
                    try:
                        self._start_load(block)
                    except MemoryBudgetError:
                        return  # no room to read ahead: the block is read when it is needed

    # ------------------------------------------------------------------ WeightHome (the optimizer)
    def holds(self, param: torch.Tensor) -> bool:
        return param in self._by_param

    def acquire(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's weights in host memory, flat; stays cached until :meth:`release`."""
        block, j = self._by_param[param]
        with self._lock:
            host = self._host(block)
            block.pins += 1
            return block.view(host, j)

    def release(self, param: torch.Tensor, *, modified: bool) -> None:
        block, _ = self._by_param[param]
        with self._lock:
            block.pins -= 1
            block.dirty = block.dirty or modified

    # ------------------------------------------------------------------ checkpoints
    def _before_load(self, block: _Block) -> None:
        self._to_device(block, headroom_bytes=0)
        block.in_use += 1

    def _after_load(self, block: _Block) -> None:
        with self._lock:
            host = self._host(block)
            for j, p in enumerate(block.params):
                block.view(host, j).copy_(p.detach().reshape(-1))
            block.dirty = True
        block.in_use -= 1
        self._off_device(block)

    @contextlib.contextmanager
    def _held(self, param: torch.Tensor):
        """A streamed parameter's current weights in host memory, shaped like it, while the block stays cached."""
        with self._lock:
            flat = self.acquire(param)
            try:
                yield flat.view(param.shape)
            finally:
                self.release(param, modified=False)

    def gather(self, param: torch.Tensor) -> torch.Tensor:
        """A full copy of a streamed parameter's current weights (CPU)."""
        with self._held(param) as weights:
            return weights.clone()

    def save_checkpoint(self, path, metadata: dict[str, str] | None = None) -> None:
        """Write the model's state (as ``state_dict()`` names it) to a safetensors file, one tensor in memory at a time.

        The file appears under ``path`` only once complete (see
        :class:`~nvoffload.checkpoint.SafetensorsWriter`); call it after
        ``optimizer.step()``, not while updates are in flight. A model built on
        the meta device loads it back with ``checkpoint=open_checkpoint(path)``.
        """
        tensors = state_tensors(self.model)
        shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        with SafetensorsWriter(path, shapes, metadata) as writer:
            for name, t in tensors.items():
                if not self.holds(t):
                    writer.write(name, t.detach())
                    continue
                with self._held(t) as weights:  # written from the cache, no copy
                    writer.write(name, weights)

    def flush(self) -> None:
        """Write every changed cached block back to the store."""
        with self._lock:
            for block in self._lru.values():
                self._settle(block)
                if block.dirty:
                    self._write_back(block, block.host)
                    block.dirty = False

    def close(self) -> None:
        """Remove the hooks and give back the host cache (the parameters stay off the device)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        with self._lock:
            for block in list(self._lru.values()):
                self._settle(block)
                self._drop_failed_load(block)


def _state_dict_hook(streamer: ParameterStreamer):
    ref = weakref.ref(streamer)
    names = state_tensors(streamer.model)

    def hook(module, state_dict, prefix, local_metadata):
        s = ref()
        if s is None:
            return
        for name, p in names.items():
            key = prefix + name
            if key in state_dict and s.holds(p):
                state_dict[key] = s.gather(p)

    return hook
