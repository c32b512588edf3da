"""PEFT models (``peft.get_peft_model``) over a streamed base: how their names and adapters relate to the base model's.

PEFT wraps the base model (``base_model.model.``) and replaces each targeted
module by a tuner layer that holds the original as ``base_layer`` and the
adapters beside it (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``).
:class:`PeftView` maps the PEFT model's state-dict names to the base model's
(so a base model directory fills it), tells the adapters' tensors apart, and
initializes them as PEFT does when they were built on the meta device.

Nothing here imports peft: a model is a PEFT model only once peft is imported.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from nvoffload.streaming._blocks import state_tensors

__all__ = ["PeftView"]

_BASE_LAYER = re.compile(r"(^|\.)base_layer(?=\.|$)")
_BASE_WEIGHT_INITS = (True, False, "gaussian")  # PEFT's LoRA inits that do not read (or change) the base weights


class PeftView:
    """A PEFT model's base model, its tuner layers and its adapters' tensors.

    Attributes:
        base: the wrapped base model (``model.get_base_model()``).
        prefix: the base model's path in the PEFT model, with its dot (``base_model.model.``).
        adapters: the adapters' parameters (every tensor of a tuner layer outside its ``base_layer``).
    """

    def __init__(self, model: nn.Module, tuner_layer: type):
        self.model = model
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = next(name for name, m in model.named_modules() if m is self.base)
        self.prefix = path + "." if path else ""
        self._tuners = [m for m in model.modules() if isinstance(m, tuner_layer)]
        base_params = {p for m in self._tuners for p in m.get_base_layer().parameters()}
        self.adapters = {p for m in self._tuners for p in m.parameters() if p not in base_params}
        self._adapter_modules = {
            sub for m in self._tuners for sub in m.modules()
            if sub is not m and any(p in self.adapters for p in sub.parameters(recurse=False))
        }  # fmt: skip

    @staticmethod
    def of(model: nn.Module) -> PeftView | None:
        """The view of ``model`` if it holds PEFT tuner layers, else None."""
        peft = sys.modules.get("peft")
        if peft is None:
            return None
        from peft.tuners.tuners_utils import BaseTunerLayer

        if not any(isinstance(m, BaseTunerLayer) for m in model.modules()):
            return None
        return PeftView(model, BaseTunerLayer)

    @property
    def adapter(self) -> str:
        """The active adapter's name (``default`` unless named otherwise)."""
        active = getattr(self.model, "active_adapter", "default")
        return active if isinstance(active, str) else active[0]

    def adapter_names(self) -> dict[str, str]:
        """The active adapter's tensors: the name PEFT saves each under (``adapter_model.safetensors``: the
        state-dict name without the adapter's, ``...q_proj.lora_A.weight``) -> its state-dict name, in order."""
        tag = f".{self.adapter}"
        return {
            name.replace(tag, ""): name for name, t in state_tensors(self.model).items()
            if t in self.adapters and (tag + "." in name or name.endswith(tag))
        }  # fmt: skip

    def adapter_state(self) -> dict[str, nn.Parameter]:
        """The active adapter's tensors by the names PEFT saves them under (see :meth:`adapter_names`)."""
        tensors = state_tensors(self.model)
        return {saved: tensors[name] for saved, name in self.adapter_names().items()}

    def save_config(self, directory: str) -> None:
        """``adapter_config.json`` of the active adapter, as ``PeftModel.save_pretrained`` writes it."""
        self.model.peft_config[self.adapter].save_pretrained(directory)

    def merging(self, read: Callable[[torch.Tensor], AbstractContextManager[torch.Tensor]]):
        """``read`` (a tensor -> a context manager yielding its current weights) giving the weight of each LoRA layer's
        base layer with the active adapter merged, as PEFT's ``merge_and_unload`` computes it
        (``W + transpose(B @ A) * scaling``, in ``W``'s dtype); other tensors as they are.

        Raises NotImplementedError naming the layer for an adapter merged otherwise (DoRA, a LoRA embedding, ...)."""
        adapter, merged = self.adapter, {}
        for tuner in self._tuners:
            if not any(adapter in d for d in _adapter_dicts(tuner)):
                continue  # the adapter does not reach this layer
            linear = adapter in getattr(tuner, "lora_A", {}) and not getattr(tuner, "use_dora", {}).get(adapter)
            if not linear or not hasattr(tuner.get_base_layer(), "weight"):
                raise NotImplementedError(
                    f"{type(tuner).__name__} of adapter {adapter!r} is not a plain LoRA linear layer: save the adapter"
                    " (merged=False) and merge it with PEFT's merge_and_unload"
                )
            merged[tuner.get_base_layer().weight] = tuner

        @contextlib.contextmanager
        def current(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
            tuner = merged.get(tensor)
            if tuner is None:
                with read(tensor) as weights:
                    yield weights
                return
            a, b = tuner.lora_A[adapter].weight, tuner.lora_B[adapter].weight
            with read(tensor) as weights, read(a) as a_weights, read(b) as b_weights:
                delta = b_weights @ a_weights
                delta = delta.T if tuner.fan_in_fan_out else delta
                yield (weights + delta * tuner.scaling[adapter]).to(weights.dtype)

        return current

    def tuners_holding(self, params: list[nn.Parameter]) -> list[nn.Module]:
        """The tuner layers that hold any of ``params`` as an adapter."""
        params = set(params)
        return [m for m in self._tuners if any(p in params for p in m.parameters())]

    def base_name(self, name: str) -> str | None:
        """The base model's own name (before PEFT wrapped it) of one of the PEFT model's state-dict names;
        None for a name outside the base model."""
        if not name.startswith(self.prefix):
            return None
        return _BASE_LAYER.sub("", name[len(self.prefix) :])

    def adapter_init(self) -> Callable[[nn.Module], None]:
        """A function initializing the adapters of one module as PEFT does when it creates them: the adapters'
        own modules ``reset_parameters()`` (as built), then each LoRA layer's ``reset_lora_parameters`` with its
        adapter's ``init_lora_weights`` (lora_A Kaiming-uniform or Gaussian, lora_B zero), drawn on the CPU whatever
        the device (:func:`_drawn_on_cpu`); other modules are left.

        Raises ValueError (naming the adapter) for an init that reads the base weights (PiSSA, OLoRA, LoftQ,
        EVA, CorDA: they also change them), which a streamed base built on the meta device cannot give."""
        configs = getattr(self.model, "peft_config", {})
        for name, config in configs.items():
            init = getattr(config, "init_lora_weights", True)
            if init not in _BASE_WEIGHT_INITS:
                raise ValueError(
                    f"adapter {name!r} has init_lora_weights={init!r}, which reads the base weights: a base streamed "
                    "from the meta device cannot give them; use init_lora_weights=True or 'gaussian', or load the "
                    "adapter's weights from a checkpoint"
                )

        def init(module: nn.Module) -> None:
            if module in self._adapter_modules:
                if hasattr(module, "reset_parameters"):
                    with _drawn_on_cpu(module, self._adapter_modules):
                        module.reset_parameters()
            elif module in self._tuners and hasattr(module, "reset_lora_parameters"):
                with _drawn_on_cpu(module, self._adapter_modules):
                    for adapter in module.r:  # LoRA layers: the rank of each adapter
                        module.reset_lora_parameters(adapter, getattr(configs.get(adapter), "init_lora_weights", True))

        return init


@contextlib.contextmanager
def _drawn_on_cpu(module: nn.Module, adapter_modules: set[nn.Module]) -> Iterator[None]:
    """The adapters' parameters under ``module`` (those of ``adapter_modules``) drawn as PEFT draws them wherever the
    base sits: the body initializes copies on the CPU in the default dtype (PEFT builds an adapter's ``nn.Linear``
    so, initializes it, then moves it to the base layer's device and dtype), copied into them after. The same seed
    gives the same adapters on a GPU as on the CPU, from the CPU's generator, not the device's."""
    held = [
        (sub, key, p) for sub in module.modules() if sub in adapter_modules
        for key, p in sub._parameters.items() if p is not None
    ]  # fmt: skip
    for sub, key, p in held:
        dtype = torch.get_default_dtype() if p.is_floating_point() else p.dtype
        sub._parameters[key] = nn.Parameter(p.detach().to("cpu", dtype), requires_grad=p.requires_grad)
    try:
        yield
        with torch.no_grad():
            for sub, key, p in held:
                p.copy_(sub._parameters[key])
    finally:
        for sub, key, p in held:
            sub._parameters[key] = p


def _adapter_dicts(tuner: nn.Module) -> list:
    """The tuner layer's per-adapter containers (``lora_A``, ``lora_embedding_A``, ...)."""
    return [getattr(tuner, name) for name in getattr(tuner, "adapter_layer_names", ()) if hasattr(tuner, name)]
