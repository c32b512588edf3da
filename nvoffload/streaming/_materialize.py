"""Setting a model up for streaming: every block written to the store, one at a time, and the rest given memory."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nvoffload.streaming._blocks import Block, state_tensors
from nvoffload.streaming._host_cache import HostCache
from nvoffload.streaming._residency import DeviceResidency

__all__ = ["Materializer"]


class Materializer:
    """Fills a model's parameters and buffers and hands each block to the host cache and the device tier.

    A model may be built on the meta device: its parameters are then replaced by
    new ``nn.Parameter`` objects on the device (in every module that holds them,
    so ties survive; :attr:`replaced` maps old to new) and filled one block at a
    time from ``checkpoint`` or by ``param_init_fn`` (default:
    ``reset_parameters()``), so a model larger than memory never is in memory at
    once. ``checkpoint`` is matched against the model when this object is made:
    a missing or unexpected tensor raises ``KeyError`` and a shape mismatch
    ``ValueError`` before anything is read.
    """

    def __init__(self, model: nn.Module, device: torch.device, *,
                 param_init_fn: Callable[[nn.Module], None] | None, checkpoint):  # fmt: skip
        self.model = model
        self.device = device
        self._param_init_fn = param_init_fn
        self._checkpoint = checkpoint
        self._sources = self._plan_checkpoint() if checkpoint is not None else {}
        self.replaced: dict[nn.Parameter, nn.Parameter] = {}
        self._owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    self._owners.setdefault(p, []).append((module, key))

    def run(self, blocks: list[Block], resident: list[tuple[str, nn.Parameter]], cache: HostCache,
            residency: DeviceResidency) -> None:  # fmt: skip
        """Fill ``resident`` (replaced entries are updated in place), store and park every block, fill buffers."""
        for i, (name, p) in enumerate(resident):
            if p.is_meta:
                p = self._replace_meta(p)
                resident[i] = (name, p)
                self._fill_resident(p)
            elif p.device != self.device:
                raise ValueError(f"parameter {name} is on {p.device}, the streamer's device is {self.device}")
        for block in blocks:
            meta = [j for j, p in enumerate(block.params) if p.is_meta]
            for j in meta:
                block.params[j] = self._replace_meta(block.params[j])
            if meta:
                self._fill_block(block)
            cache.install(block, lambda host, block=block: self._copy_into(block, host))
            residency.park(block)
        self._fill_buffers()

    @staticmethod
    def _copy_into(block: Block, host: torch.Tensor) -> None:
        with torch.no_grad():
            for j, p in enumerate(block.params):
                block.view(host, j).copy_(p)

    def _replace_meta(self, old: nn.Parameter) -> nn.Parameter:
        new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=self.device), requires_grad=old.requires_grad)
        for module, key in self._owners[old]:
            module._parameters[key] = new
        self._owners[new] = self._owners.pop(old)
        self.replaced[old] = new
        if old in self._sources:
            self._sources[new] = self._sources.pop(old)
        return new

    def _fill_resident(self, p: nn.Parameter) -> None:
        if self._checkpoint is not None:
            self._read_checkpoint(p, p.data)
        else:
            for module, _ in self._owners[p]:
                self._call_init(module)

    def _fill_block(self, block: Block) -> None:
        if self._checkpoint is not None:
            for p in block.params:
                self._read_checkpoint(p, p.data)
        else:
            for module in block.module.modules():
                self._call_init(module)

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

    def _fill_buffers(self) -> None:
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
