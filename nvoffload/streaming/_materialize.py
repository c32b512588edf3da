"""Filling a model built on the meta device: its buffers and the parameters outside the blocks, then each block, one
at a time (the streamer writes each to the store before the next)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from nvoffload.streaming._blocks import Block
from nvoffload.streaming._hf_models import CheckpointSources, Index, default_init, rebuilt_buffers
from nvoffload.streaming._peft import PeftView

__all__ = ["Materializer"]


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its descendants, children before parents (as transformers' ``initialize_weights`` visits them,
    so a parent's init of its children's weights, e.g. GPT-2's scaled projections, comes last)."""
    for child in module.children():
        yield from _post_order(child)
    yield module


class Materializer:
    """Fills a model's parameters and buffers, one block at a time (the streamer stores each and takes it off the
    device before the next is filled).

    A model may be built on the meta device: its parameters are then replaced by
    new ``nn.Parameter`` objects on the device (in every module that holds them,
    so ties survive; :attr:`replaced` maps old to new) and filled one block at a
    time from ``checkpoint`` or by ``param_init_fn`` (default: a Hugging Face
    model's own ``_init_weights``, else ``reset_parameters()``), so a model
    larger than memory never is in memory at once. A parameter no init sets
    (it is NaN until then) raises ``ValueError`` naming it. The checkpoint's
    tensors come matched to the model's
    (:class:`~nvoffload.streaming._hf_models.CheckpointSources`). Buffers on the meta device come
    from the checkpoint, or, for those it does not hold (non-persistent ones,
    or all without a checkpoint), from a twin of the model built from its
    ``config`` (:func:`~nvoffload.streaming._hf_models.rebuilt_buffers`).

    A PEFT model (``peft.get_peft_model`` of a model built on the meta device)
    is filled from its base model's checkpoint (names matched through PEFT's
    wrapping, :class:`~nvoffload.streaming._peft.PeftView`) or init; its
    adapters, which no base checkpoint holds, are initialized as PEFT does,
    unless ``checkpoint`` is a list that also holds the adapter's checkpoint
    (``open_checkpoint(adapter_dir)``, as ``PeftModel.save_pretrained`` writes it).
    """

    def __init__(self, model: nn.Module, device: torch.device, *, param_init_fn: Callable[[nn.Module], None] | None,
                 view: PeftView | None):  # fmt: skip
        self.model = model
        self.device = device
        self._checkpoint = None
        self._sources: dict[torch.Tensor, list[tuple[str, Index]]] = {}
        self._init_fn = param_init_fn or default_init(model, view)
        self._init_what = (
            "param_init_fn" if param_init_fn is not None
            else "reset_parameters()" if self._init_fn is None else "the model's _init_weights()"
        )  # fmt: skip
        self._peft = view
        self._adapter_init = view.adapter_init() if view is not None else None
        self.replaced: dict[nn.Parameter, nn.Parameter] = {}
        self._owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    self._owners.setdefault(p, []).append((module, key))

    def filled(self, blocks: list[Block], resident: list[tuple[str, nn.Parameter]],
               sources: CheckpointSources | None) -> Iterator[Block]:  # fmt: skip
        """Fill buffers and ``resident`` (replaced entries are updated in place) from ``sources`` (None: no
        checkpoint) or by the init, then each block, yielded once filled (to be stored and taken off the device
        before the next is filled)."""
        if sources is not None:
            self._checkpoint, self._sources = sources.reader, sources.of
        self._fill_buffers()
        for name, p in resident:
            if not p.is_meta and p.device != self.device:
                raise ValueError(f"parameter {name} is on {p.device}, the streamer's device is {self.device}")
        meta = [i for i, (_, p) in enumerate(resident) if p.is_meta]
        for i in meta:
            resident[i] = (resident[i][0], self._replace_meta(resident[i][1]))
        filled = [resident[i] for i in meta]
        owners = {module: None for _, p in filled for module, _ in self._owners[p]}  # each module once, in order
        if self._peft is not None:  # after the adapters' own modules, the LoRA layers that zero lora_B
            owners.update((m, None) for m in self._peft.tuners_holding([p for _, p in filled]))
        self._fill(filled, owners)
        for block in blocks:
            meta = [j for j, p in enumerate(block.params) if p.is_meta]
            for j in meta:
                block.params[j] = self._replace_meta(block.params[j])
            if meta:
                self._fill([(block.param_names[j], block.params[j]) for j in meta], _post_order(block.module))
            yield block

    def _replace_meta(self, old: nn.Parameter) -> nn.Parameter:
        new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=self.device), requires_grad=old.requires_grad)
        for module, key in self._owners[old]:
            module._parameters[key] = new
        self._owners[new] = self._owners.pop(old)
        self.replaced[old] = new
        if old in self._sources:
            self._sources[new] = self._sources.pop(old)
        return new

    def _fill(self, params: list[tuple[str, nn.Parameter]], modules: Iterable[nn.Module]) -> None:
        """Fill new parameters from the checkpoint, or by initializing ``modules`` (with a checkpoint: only a PEFT
        model's adapters, which it does not hold, as PEFT initializes them); raise for any left unset."""
        with torch.no_grad():
            if self._checkpoint is not None:
                for _, p in params:
                    if p in self._sources:
                        self._read_checkpoint(p, p.data)
                params = [(name, p) for name, p in params if p not in self._sources]
                if not params:
                    return
            for _, p in params:
                p.fill_(math.nan if p.is_floating_point() else 0)
            for module in modules:
                if self._checkpoint is None:  # with one, the base's weights came from it
                    self._init_module(module)
                if self._adapter_init is not None:
                    self._adapter_init(module)
            unset = [name for name, p in params if p.is_floating_point() and bool(p.isnan().any())]
        if unset:
            raise ValueError(
                f"{', '.join(unset[:5])}{', ...' if len(unset) > 5 else ''}: built on the meta device, and "
                f"{self._init_what} left {'them' if len(unset) > 1 else 'it'} unset (NaN): pass a param_init_fn "
                "that initializes every parameter, or a checkpoint that holds them"
            )

    def _init_module(self, module: nn.Module) -> None:
        if self._init_fn is not None:
            self._init_fn(module)
        elif hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()

    def _read_checkpoint(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        for name, index in self._sources[tensor]:
            part = out[index]
            if self._checkpoint.info(name).dtype == part.dtype and part.device.type == "cpu" and part.is_contiguous():
                self._checkpoint.read(name, out=part)
            else:
                with torch.no_grad():
                    part.copy_(self._checkpoint.read(name).view(part.shape))

    def _fill_buffers(self) -> None:
        """Give buffers built on the meta device memory: their checkpoint values, or the rebuilt ones."""
        meta = {}
        for path, module in self.model.named_modules():
            for key, b in module._buffers.items():
                if b is not None and b.is_meta:
                    meta[f"{path}.{key}" if path else key] = (module, key, b)
        unread = [name for name, (_, _, b) in meta.items() if b not in self._sources]
        rebuilt = rebuilt_buffers(self.model, unread, self._peft) if unread else {}
        for name, (module, key, b) in meta.items():
            if name in rebuilt:
                new = rebuilt[name].to(self.device, b.dtype)
            else:
                new = torch.empty(b.shape, dtype=b.dtype, device=self.device)
                self._read_checkpoint(b, new)
            module._buffers[key] = new
